"""`offload_optimizer.max_in_cpu`: the optimizer state of some units in host memory, the rest on
NVMe ([Note: host memory before the disk] in offload/placement.py).

`SplitOptimizerState` has the methods of the other optimizer tiers and hands each call about a
unit to the tier that holds it: `ResidentOptimizerState` in host memory for the units kept,
`NvmeOptimizerState` for the others. Calls about the step go to both. Updates wait for the next
forward as with everything on NVMe ([Note: updates after the norm] in step_policy.py); a kept
unit's pending update reads nothing, so it costs no more than one in `step()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from infinity.device import Device, InFlight
from infinity.offload.placement import units_in_memory
from infinity.offload.optimizer.memory import ResidentOptimizerState
from infinity.offload.protocols import TierUnit

log = logging.getLogger("infinity")


def split_by_budget(device: Device, budget: int, units: list[TierUnit], order: list[int],
                    nvme: Callable[[list[TierUnit]], object], rule=None, one_pass: bool = False):
    """The optimizer tier for `units` with `budget` elements of state in host memory: all of it
    there, all on NVMe (`nvme(units)` builds that tier), or split."""
    kept = units_in_memory(units, budget, order)
    if not kept:
        return nvme(units)
    if len(kept) == len(units):
        log.info("infinity: offload_optimizer.max_in_cpu %d: the optimizer state of all %d units stays in host "
                 "memory (%d elements); nothing goes to NVMe", budget, len(units), sum(u.train_shard_numel for u in units))
        return ResidentOptimizerState(device, on_device=False, units=units, rule=rule, one_pass=one_pass)
    on_disk = [u for u in units if u not in kept]
    log.info("infinity: offload_optimizer.max_in_cpu %d: the optimizer state of %d of %d units (%d of %d elements) "
             "stays in host memory, the rest on NVMe", budget, len(kept), len(units),
             sum(u.train_shard_numel for u in kept), sum(u.train_shard_numel for u in units))
    return SplitOptimizerState(ResidentOptimizerState(device, on_device=False, units=kept, rule=rule, one_pass=one_pass),
                               nvme(on_disk), kept)


class SplitOptimizerState:
    """Kept units' state in `memory`, the others' in `disk` (module docstring)."""

    on_device = False
    updates_can_wait = True  # as the NVMe tier's ([Note: update modes] in step_policy.py)

    def __init__(self, memory: ResidentOptimizerState, disk, kept: list[TierUnit]):
        self.memory, self.disk = memory, disk
        self._kept = {u.index for u in kept}
        self.handle = disk.handle  # the NVMe tier's I/O handle (tests, reports)
        self.chosen = disk.chosen  # what the NVMe tier sized ([Note: the pool is a budget] in sizing.py)

    def _tier(self, unit: TierUnit):
        return self.memory if unit.index in self._kept else self.disk

    @property
    def kept(self) -> set[int]:
        """Indices of the units whose state is in host memory."""
        return set(self._kept)

    # ---- about one unit ---------------------------------------------------------------------

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        self._tier(unit).add(unit, master)

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight | None:
        return self._tier(unit).accumulate(unit, grad_shard, first, last)

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        return self._tier(unit).grad_sq(unit)

    def update(self, unit: TierUnit, hypers: list, step: int, grad_scale: float, out: torch.Tensor) -> None:
        self._tier(unit).update(unit, hypers, step, grad_scale, out)

    def norms(self, unit: TierUnit, hypers: list, step: int, grad_scale: float) -> torch.Tensor:
        return self._tier(unit).norms(unit, hypers, step, grad_scale)

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor | None:
        return self._tier(unit).read(unit, kind)

    def write(self, unit: TierUnit, values: dict[str, torch.Tensor]) -> None:
        self._tier(unit).write(unit, values)

    # ---- about the step ---------------------------------------------------------------------

    def step_order(self, units: list[TierUnit]) -> list[TierUnit]:
        """The NVMe units in the order their reads started, then the kept ones."""
        return (self.disk.step_order([u for u in units if u.index not in self._kept])
                + [u for u in units if u.index in self._kept])

    def set_pending(self) -> None:
        self.disk.set_pending()  # it reads the schedule's pending order, its own units of it

    def begin_pass(self, last: bool) -> None:
        self.memory.begin_pass(last)
        self.disk.begin_pass(last)

    def poll(self) -> None:
        self.disk.poll()

    def abort_pass(self) -> None:
        self.memory.abort_pass()
        self.disk.abort_pass()

    def finish_step(self) -> None:
        self.memory.finish_step()
        self.disk.finish_step()

    def drop_pending(self) -> None:
        self.memory.drop_pending()
        self.disk.drop_pending()

    def flush(self) -> None:
        self.memory.flush()
        self.disk.flush()

    def io_stats(self) -> dict[str, float]:
        return self.disk.io_stats()

    def close(self) -> None:
        try:
            self.memory.close()
        finally:
            self.disk.close()
