"""Which engine and unit own a parameter, and `GatheredParameters` built on it.

A weak, identity-keyed map instead of attributes bolted onto nn.Parameter. The owner is seen
through `UnitOwner`, the few calls this module and `infinity.deepspeed.utils.full_values` make,
never as the Engine itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from infinity.zero import dist as zdist
from infinity.zero.init import written_before_initialize
from infinity.zero.unit import ParamSlot, Unit, UnitState


class UnitOwner(Protocol):
    """What an engine offers for reading and changing its units' values from outside a step."""

    def gather_for_user(self, unit: Unit) -> None:
        """Gathers a released unit into a fresh buffer, which views may outlive."""

    def release_for_user(self, unit: Unit) -> None: ...

    def set_unit_values(self, unit: Unit, shard: torch.Tensor) -> None:
        """Makes `shard` (host, compute dtype) this rank's shard; its trainable part also
        becomes the fp32 master."""

    def full_optimizer_values(self, unit: Unit, kind: str) -> torch.Tensor | None: ...
    def full_fp32_values(self, unit: Unit) -> torch.Tensor: ...
    def set_fp32_values(self, unit: Unit, full: torch.Tensor) -> None: ...


_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_units(owner: UnitOwner, units: list[Unit]) -> None:
    for u in units:
        for s in u.slots:
            _owners[s.param] = (owner, u, s)


def owner_of(param: torch.Tensor) -> tuple[UnitOwner, Unit, ParamSlot] | None:
    """The engine, unit and slot of a partitioned parameter; None for any other tensor."""
    return _owners.get(param) if isinstance(param, torch.Tensor) else None


@contextmanager
def GatheredParameters(params: torch.nn.Parameter | Iterable[torch.nn.Parameter], modifier_rank: int | None = None,
                       enabled: bool = True):
    """Gathers partitioned parameters for the body of the `with`; partitions them again on exit.

    With `modifier_rank` set, that rank's values at exit are broadcast and become the new
    shards (and the optimizer's fp32 master), as DeepSpeed's context of the same name.
    Parameters that infinity does not manage pass through untouched.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    meta = [p for p in params if enabled and isinstance(p, torch.Tensor) and p.is_meta]
    if meta:  # built under infinity.Init, before initialize ([Note: values written before initialize])
        with written_before_initialize(meta, modifier_rank):
            yield
        return
    owners: dict[int, tuple[UnitOwner, Unit]] = {}
    for p in params:
        if p in _owners:
            owner, unit, _ = _owners[p]
            owners[id(unit)] = (owner, unit)
    gathered = []
    if enabled:
        for owner, unit in owners.values():
            if unit.state is UnitState.RELEASED:
                owner.gather_for_user(unit)
                gathered.append((owner, unit))
    try:
        yield
    finally:
        modified = []
        if enabled and modifier_rank is not None:
            modified = [(owner, unit, _modified_shard(unit, modifier_rank)) for owner, unit in owners.values()]
        for owner, unit in gathered:
            owner.release_for_user(unit)
        for owner, unit, shard in modified:
            owner.set_unit_values(unit, shard)


def _modified_shard(unit: Unit, src: int) -> torch.Tensor:
    """This rank's shard of the modifier's values (a copy, on the device)."""
    full = unit.full
    zdist.broadcast(full, src)
    return unit.local_shard(full)
