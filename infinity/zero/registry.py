"""Which engine and unit own a parameter, and `GatheredParameters` built on it.

A weak, identity-keyed map instead of attributes on nn.Parameter (see STYLE.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from infinity.zero import dist as zdist
from infinity.zero.unit import UnitState

if TYPE_CHECKING:
    from infinity.engine import Engine
    from infinity.zero.unit import ParamSlot, Unit

_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_units(engine: "Engine") -> None:
    for u in engine.units:
        for s in u.slots:
            _owners[s.param] = (engine, u, s)


def owner_of(param: torch.Tensor) -> tuple["Engine", "Unit", "ParamSlot"] | None:
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
    owners: dict[int, tuple["Engine", "Unit"]] = {}
    for p in params:
        if p in _owners:
            engine, unit, _ = _owners[p]
            owners[id(unit)] = (engine, unit)
    gathered = []
    if enabled:
        for engine, unit in owners.values():
            if unit.state is UnitState.RELEASED:
                unit.to_gathered(engine.params.fetch(unit), fresh=True)  # views may outlive the `with`
                engine.params.done(unit)
                gathered.append((engine, unit))
    try:
        yield
    finally:
        modified = []
        if enabled and modifier_rank is not None:
            modified = [(engine, unit, _modified_shard(engine, unit, modifier_rank)) for engine, unit in owners.values()]
        for engine, unit in gathered:
            unit.to_released()
        for engine, unit, shard in modified:
            engine.write_params(unit, new_shard=shard)


def _modified_shard(engine: "Engine", unit: "Unit", src: int) -> torch.Tensor:
    """This rank's shard of the modifier's values (a host copy); its trainable part also becomes
    the fp32 master."""
    full = unit.full
    if zdist.world_size() > 1:
        torch.distributed.broadcast(full, src)
    shard = unit.local_shard(full).cpu()
    if unit.trainable:
        # The modifier wrote compute-dtype values; fp32 parameters keep full precision.
        engine.optim_state.set_master(unit, unit.split(shard).train.to(torch.float32))
    return shard
