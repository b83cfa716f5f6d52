"""Gathers units when they are needed, ahead of time when the order is known, within budgets.

[Note: recorded order]
Each step, every time a unit is needed (forward pre-hook, pre-backward, recomputation) its
index is appended to the step's trace. The previous step's trace is the schedule: while the
current step follows it, the fetcher knows what comes next and (1) asks the parameter tier to
start moving the shards of the next units (up to `prefetch_numel` elements ahead: NVMe reads,
host-to-device copies), and (2) keeps a unit gathered after use when its next use is within
`max_reuse_distance` elements, or is the very next use. A step that departs from the schedule
(another code path) just stops prefetching; at the end of the step its trace becomes the new
schedule.

[Note: live budget]
`live_numel` counts the elements of gathered units that are not persistent. Before a unit is
gathered, kept units are released (the one used furthest in the future first) until the new
unit fits in `max_live_numel`; the unit being gathered is always gathered, so the peak is at
most the budget plus one unit. Units in use (their forward or backward running) are never
released early.

[Note: gathering one unit ahead]
Right after a unit is gathered (before it computes), the next use in the schedule is gathered
too when that costs no wait and no room: its unit is released, its shard is ready in the tier
(`ParamTier.ready`: read from NVMe already; the tier starts its host -> device copy then), and
it fits in `max_live_numel` without releasing anything. On a GPU its copy-in and all-gather are
then queued behind the current unit's work instead of in front of the next one's.

[Note: uses outside a step]
A module can be called outside the engine's forward (`model.get_input_embeddings()(ids)`,
generation loops that call the model itself): such a use gathers and releases as usual, but it
is not traced and prefetches nothing, so it cannot disturb the recorded schedule.
"""

from __future__ import annotations

import time
from typing import Protocol

from infinity.device.timeline import TIMELINE
from infinity.config import ZeroConfig
from infinity.offload.protocols import ParamTier
from infinity.offload.schedule import StepSchedule
from infinity.zero.unit import Unit, UnitState


class UpdatesBeforeUse(Protocol):
    """Updates that wait for a unit's next use ([Note: updates after the norm] in step_policy.py):
    the fetcher runs a unit's before it reads the unit's shard, so `acquire` (and a prefetch one
    use ahead) may run CPU Adam over the unit's shard and its optimizer state's NVMe reads and
    writes ([Note: a unit's update] in step_policy.py)."""

    def is_pending(self, unit: Unit) -> bool: ...

    def run(self, unit: Unit) -> None: ...


class Fetcher:
    def __init__(self, units: list[Unit], params: ParamTier, zero: ZeroConfig, updates: UpdatesBeforeUse,
                 steps: StepSchedule):
        self.units = units
        self.params = params
        self.updates = updates  # their writes change the shards this fetcher reads: run first
        self.steps = steps  # this fetcher records the uses there ([Note: the step's orders] in offload/schedule.py)
        self.max_live_numel = zero.stage3_max_live_parameters
        self.max_reuse_distance = zero.stage3_max_reuse_distance
        self.prefetch_numel = zero.stage3_prefetch_bucket_size
        self.on_schedule = False
        self.in_step = False
        self.in_use: dict[int, int] = {}  # unit index -> nesting count of current uses
        self.live_numel = 0
        self.peak_live_numel = 0
        self.gather_seconds = 0.0
        self._prefetched: set[int] = set()  # schedule positions whose shard read is already issued

    @property
    def schedule(self) -> list[int] | None:
        """The last step's uses ([Note: recorded order]), None before the first."""
        return self.steps.last_uses

    @property
    def trace(self) -> list[int]:
        """This step's uses so far."""
        return self.steps.uses

    # ---- per step -------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.steps.begin_uses()
        self.on_schedule = self.schedule is not None
        self.in_step = True
        self._prefetched = set()  # reads started by `prefetch_next_step` are the tier's: it serves them

    def ready_persistent(self) -> None:
        """Before a forward: each persistent unit whose update waits (one that failed in `step()`)
        is updated, and one that a failed update left released is gathered again ([Note:
        persistent units' updates] in step_policy.py)."""
        for u in self.units:
            if u.persistent:
                self.updates.run(u)
                if u.state is UnitState.RELEASED:
                    self._gather(u)

    def release_idle(self) -> None:
        """Releases every gathered unit that is neither persistent nor in use."""
        for u in self.units:
            if u.state is UnitState.GATHERED and not u.persistent and u.index not in self.in_use:
                self._release(u)

    def end_step(self) -> None:
        """Releases every non-persistent unit; the step's trace becomes the schedule."""
        self.in_use.clear()
        self.release_idle()
        self.params.drop_prefetched()  # a shard may change before its next use (optimizer step)
        if self.in_step and self.steps.end_uses():
            self.params.set_schedule(self.schedule)
        self.in_step = False
        self.on_schedule = False

    def prefetch_next_step(self) -> None:
        """[Note: reading across the step boundary] Once a step has updated every unit, the
        next step's first shards are read while the host is still between steps (the loss
        print, the next batch), instead of at the next forward's first acquire. A shard that
        changes before it is used (a checkpoint load, `GatheredParameters` with a modifier)
        drops its read first (the parameter tier's `_before_write`); an evaluation forward uses it."""
        if self.schedule and not self.in_step:
            self._prefetched = set()
            self._prefetch(0)

    # ---- per use --------------------------------------------------------------------------

    def acquire(self, unit: Unit) -> None:
        """The unit is about to run: gathered on return, and marked in use."""
        pos = len(self.trace)
        if self.in_step:  # [Note: uses outside a step]
            self.steps.use(unit.index)
        if self.on_schedule and (pos >= len(self.schedule) or self.schedule[pos] != unit.index):
            self.on_schedule = False
        self.in_use[unit.index] = self.in_use.get(unit.index, 0) + 1
        self.updates.run(unit)  # its new values first ([Note: a unit's update] in step_policy.py)
        if unit.state is UnitState.RELEASED:
            self._make_room(unit.padded_numel if not unit.persistent else 0)
            self._gather(unit)
        if self.on_schedule:
            self._prefetch(pos + 1)
            self._gather_ahead(pos + 1)

    def release(self, unit: Unit, *, keep_if_reused: bool = True, force: bool = False) -> None:
        """The unit's current use is over: released now, or kept if it is needed again soon.
        `force` ends every use at once (a unit whose gradients are final is not needed again)."""
        n = 0 if force else self.in_use.get(unit.index, 0) - 1
        if n > 0:
            self.in_use[unit.index] = n
            return
        self.in_use.pop(unit.index, None)
        if unit.persistent or unit.state is UnitState.RELEASED:
            return
        if keep_if_reused and self._reused_soon(unit) and self.live_numel <= self.max_live_numel:
            return
        self._release(unit)
        if self.on_schedule:
            self._prefetch(len(self.trace))  # its next use can be read now that it is released

    # ---- internals ------------------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        t0 = time.perf_counter()
        with TIMELINE.span("gather", unit=unit.index):
            unit.to_gathered(self.params.fetch(unit))
            self.params.done(unit)  # the unit has its own copy now
        self.gather_seconds += time.perf_counter() - t0
        if not unit.persistent:
            self.live_numel += unit.padded_numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gather_ahead(self, pos: int) -> None:
        """[Note: gathering one unit ahead]"""
        if pos >= len(self.schedule):
            return
        u = self.units[self.schedule[pos]]
        if (u.state is UnitState.RELEASED and not u.persistent
                and self.live_numel + u.padded_numel <= self.max_live_numel and self.params.ready(u)):
            self._gather(u)

    def _release(self, unit: Unit) -> None:
        unit.to_released()
        if not unit.persistent:
            self.live_numel -= unit.padded_numel

    def _next_use(self, index: int) -> int:
        """Schedule position of the unit's next use after the current one (large if none)."""
        if not self.on_schedule:
            return 1 << 62
        start = len(self.trace)
        for pos in range(start, len(self.schedule)):
            if self.schedule[pos] == index:
                return pos
        return 1 << 62

    def _reused_soon(self, unit: Unit) -> bool:
        nxt = self._next_use(unit.index)
        if nxt >= len(self.schedule or ()):
            return False
        if nxt == len(self.trace):
            # Its next use is the very next one (the tied head's forward, then its backward):
            # releasing it would only read it again at once, with the same units gathered.
            return True
        between = sum(self.units[i].padded_numel for i in self.schedule[len(self.trace):nxt])
        return between < self.max_reuse_distance  # otherwise 0 keeps nothing, as in DeepSpeed

    def _make_room(self, numel: int) -> None:
        if self.live_numel + numel <= self.max_live_numel:
            return
        kept = [u for u in self.units if u.state is UnitState.GATHERED and not u.persistent
                and u.index not in self.in_use]
        kept.sort(key=lambda u: self._next_use(u.index), reverse=True)
        for u in kept:
            if self.live_numel + numel <= self.max_live_numel:
                break
            self._release(u)

    def _prefetch(self, start: int) -> None:
        """Asks the tier to start moving the shards of the uses in the next `prefetch_numel`
        elements of the schedule. A use whose unit is still gathered or has a read pending for
        an earlier use is retried at the next acquire (a unit used twice is read twice)."""
        ahead = 0
        for pos in range(start, len(self.schedule)):
            if ahead >= self.prefetch_numel:
                break
            u = self.units[self.schedule[pos]]
            if self.updates.is_pending(u):  # its update writes the shard it would read
                if pos != start:
                    break  # updated at most one use ahead
                self.updates.run(u)
            ahead += u.padded_numel
            if pos in self._prefetched or u.state is UnitState.GATHERED:
                continue
            if self.params.prefetch(u):
                self._prefetched.add(pos)
