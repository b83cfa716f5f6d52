"""When and how units are updated: in the backward hook that finalizes their gradient, or after
the global gradient norm, with clipping and fp16 loss scaling.

[Note: one step]
forward: units are gathered by their pre-hooks (fetcher.py) and released after use.
backward: the loss is multiplied by loss_scale / gradient_accumulation_steps; as each unit's
  gradients are final they are reduce-scattered (mean over ranks) and accumulated in fp32 in the
  optimizer tier (host memory when offloaded; [Note: gradients to the host] in offload/optimizer/accumulators.py).
step (at the accumulation boundary): the global gradient norm (all ranks) gives the clip
  coefficient; fp16 overflow skips the step; otherwise each unit shard is updated by one Adam
  pass that also writes the new compute-dtype shard into the parameter tier.

[Note: the boundary of a pass]
Whether a pass ends its accumulation decides what its backward does: only then are gradients
final, the units' state read for the update, and (update in backward) units updated as their
gradients become final. The boundary counts only when the backward starts
(`confirm_boundary`, with `engine.is_gradient_accumulation_boundary()` then): DeepSpeed's
protocol knows it from the count before the forward, but accelerate sets it
(`set_gradient_accumulation_boundary(sync_gradients)`) after the forward, right before
`backward`, and calls `step()` at the boundary only. The forward plans with what it expects
(`begin_pass`): the boundary as it stands, or, once a boundary has been set after a forward,
whether this pass completes gradient_accumulation_steps passes. The plan only moves I/O earlier:
the NVMe optimizer tier reads the state of the step's updates under the forward. When the
backward finds otherwise, the plan changes before any gradient is handed on: those reads start
then, or go back to the pool unused. The numbers are the same either way.

[Note: update modes]
When a unit's update runs is decided once per engine (`choose_update_mode`, from the clipping,
the fp16 loss scaling and the optimizer tier) and read by the engine, the policy and the tiers:

  IN_BACKWARD   no clipping, no loss scaling: each unit in the hook that makes its gradient final
                in the backward of the accumulation's last pass ([Note: update during backward]);
                `step()` updates only the persistent units.
  IN_STEP       clipping or loss scaling, the state in memory: every unit in `step()`, after the
                global norm.
  AT_NEXT_USE   clipping or loss scaling, the state on NVMe (`OptimizerTier.updates_can_wait`):
                `step()` takes the norm and updates the persistent units; every other unit's update
                is pending until just before its next use ([Note: updates after the norm]).

Persistent units are updated in `step()` in every mode: their gathered copies are in use while
autograd runs and during the next forward ([Note: persistent units' updates]). Which units' gradients skip the accumulator and in
which order the first step is expected to update units follow from the mode too
(`gradients_used_at_once`, `expected_update_order`).

[Note: update during backward]
Without gradient clipping and without fp16 loss scaling nothing in a unit's update depends on
other units: in the last micro-step's backward, the moment a unit's gradient shard is final it
is updated (`on_unit_grads`), so CPU Adam and the optimizer-state I/O run inside backward
instead of after it, and `step()` only updates what was left (persistent units, whose gathered
copies must not change while autograd runs). The update uses the param groups' values as they
are when backward runs; the numbers are those of a step after backward, since every element's
update is independent of the others'. Non-finite gradients are then applied as PyTorch applies
them (with a warning); only fp16's loss scaling skips steps.

[Note: updates after the norm]
With clipping or fp16 loss scaling every update waits for the global norm. When the optimizer
state is on NVMe (`OptimizerTier.updates_can_wait`: mode AT_NEXT_USE), `step()` then only
computes the norm, the clip coefficient and the step's hyper-parameters, updates the persistent
units, and leaves the others pending: each is updated just before its shard is next read, in
the order the next forward needs them (the fetcher runs a unit's update when it is acquired or
is next to be read, one use ahead: [Note: a unit's update]). So the optimizer-state I/O runs on
the compute thread among the next forward's units instead of after backward, the next forward
finds each unit's new values in the buffer its update wrote them to (no NVMe read), and their
writes to NVMe wait for the backward, whose disk would idle ([Note: parameter writes held for the
backward] in offload/held_writes.py). The update is the one `step()` would have
run, with the hyper-parameters, step count and clip coefficient taken at `step()`: losses and
weights are bit-identical. Whatever reads the values or the state before that forward (a
checkpoint, `consolidated_state_dict`, GatheredParameters, an eval forward, the next `step()`)
first runs the updates of what it touches (`PendingUpdates.run`), or all of them (`run_all`).

[Note: a unit's update]
Each unit's update of the last step is in one state, held by `PendingUpdates` (the engine's
`updates`; it alone changes it):

    CURRENT ──step() leaves the update for the next use (AT_NEXT_USE)──▶ PENDING
       ▲                                                                   │
       └──────────── run(): the update ran whole ◀──────────────────────────┤
       ▲                                                                   │ run() raised part way
       └── run(): resumed from the first piece not done ◀── PARTIAL ◀──────┘

  CURRENT  the unit's values and optimizer state are those of the last step taken (an update
           in backward or in `step()` ran; or the unit has none pending).
  PENDING  `step()` took the norm and the hyper-parameters; the update waits for the unit's
           next use ([Note: updates after the norm]). The fetcher runs it before reading the
           shard (`acquire`, or a prefetch one use ahead); so does anything that reads the
           values or the state first (checkpoints, GatheredParameters, the next `step()`).
  PARTIAL  that update raised part way: the pieces it finished are written, the others not
           (the NVMe tier knows how far: [Note: resuming an update] in offload/optimizer/nvme.py).

The rule after a failure is one of PARTIAL: the next `run()` resumes the update from the first
piece not done, with the same hyper-parameters, step count and clip coefficient, which gives the
numbers of a run without the failure, unless the state is damaged (below); then it refuses, as
every step and save does, until a load replaces all of the state; and `run_all` drops what waits.

[Note: failed updates]
After an I/O error reaches the user, either every update is applied exactly once, or the engine
refuses to go on (`broken`: steps, backward's updates, saves and the forward of a unit whose
update is pending raise, saying to restore a checkpoint) until a load replaces all of the state.
  * An update at the next use that fails on a read has written back the pieces it finished
    (and only those: [Note: resuming an update] in offload/optimizer/nvme.py); it is PARTIAL ([Note: a
    unit's update]), and the next use of the unit resumes it from the failed piece, so going on
    gives the numbers of a run without the failure.
  * Anything else damages the state: an update that fails otherwise (a write that failed, a
    gradient whose spill was lost, an exception that is not an OSError, a commit that failed
    once all pieces were updated), or an update in backward or in `step()` that fails (the
    units updated before it have taken the step, the others not, and the step is abandoned), or
    a backward that failed after updating units. So does any write of new values that failed
    (the swapper tells the tier, the tier the lifecycle): its bytes are gone.
Damage is an event: whoever meets it reports it to the engine's lifecycle (`Lifecycle.damaged`),
the one owner of the run's health, and `check_intact` reads the health there; a load that
replaces every value heals it ([Note: engine lifecycle] in lifecycle.py).
A failed read outside an update (a parameter fetch, a checkpoint's read) changes nothing: the
step or save is abandoned and may be tried again.

[Note: persistent units' updates]
Persistent units have no hooks: they are gathered once and stay so. In AT_NEXT_USE `step()` leaves
their updates waiting like every other unit's (the same hyper-parameters, step count and clip
coefficient), first in the order, and runs them at once. One that fails on a read is PARTIAL as
at a next use: `step()` logs it and returns (the step is taken: its norm, count and
hyper-parameters are fixed, and its gradients were consumed), and the failed update and those
after it resume before the next forward (`Fetcher.ready_persistent`), which raises if the read
fails again; so going on gives the numbers of a run without the failure, where raising from
`step()` would have the caller repeat a step that was taken. An update that cannot resume damages
the state and `step()` raises, as for any unit. A persistent unit that a failed update left
released is gathered again before the next forward, so that a refusing engine says so instead of
running a layer without its weights.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import NamedTuple

import torch

from infinity.device.timeline import TIMELINE
from infinity.engine.accumulation import Accumulation
from infinity.engine.lifecycle import Health, Lifecycle
from infinity.device import Device, InFlight
from infinity.optim.functional import AdamHyper
from infinity.zero import dist as zdist
from infinity.zero.fetcher import Fetcher
from infinity.zero.loss_scaler import LossScaler
from infinity.zero.model_parallel import ModelParallel
from infinity.offload.protocols import OptimizerTier, ParamTier
from infinity.offload.schedule import StepSchedule
from infinity.zero.unit import Unit, UnitState
from infinity.zero.zero_optimizer import ZeroOptimizer

log = logging.getLogger("infinity")


class UpdateMode(enum.Enum):
    """When the units' updates run ([Note: update modes])."""

    IN_BACKWARD = "in backward"
    IN_STEP = "in step"
    AT_NEXT_USE = "at next use"


def choose_update_mode(*, clip: float, loss_scaling: bool, updates_can_wait: bool,
                       whole_tensors: bool = False) -> UpdateMode:
    """The one place the update mode is decided ([Note: update modes]); `updates_can_wait`: the
    optimizer tier's `updates_can_wait`; `whole_tensors`: the rule needs every gradient first
    (LAMB's norms, [Note: LAMB's two passes] in infinity/optim/rules.py)."""
    if clip == 0 and not loss_scaling and not whole_tensors:  # nothing in an update depends on other units
        return UpdateMode.IN_BACKWARD
    return UpdateMode.AT_NEXT_USE if updates_can_wait else UpdateMode.IN_STEP


def updated_in_backward(units: list[Unit], mode: UpdateMode) -> set[int]:
    """The units whose update runs in the hook that makes their gradient final."""
    return {u.index for u in units if mode is UpdateMode.IN_BACKWARD and not u.persistent and u.trainable}


def gradients_used_at_once(units: list[Unit], mode: UpdateMode, gradient_accumulation_steps: int) -> set[int]:
    """The units whose gradient feeds their update the moment it is final, so that it needs no
    accumulator: those updated in backward, when an accumulation is one pass."""
    return updated_in_backward(units, mode) if gradient_accumulation_steps == 1 else set()


def expected_update_order(units: list[Unit], mode: UpdateMode) -> list[int]:
    """The order the step will update units in, as far as construction can tell (the first step
    records the real one): forward uses the root first (gathered for its whole pass) and the
    other units in module order; updates at their next use run in that order, updates in
    backward in its reverse (and so, as gradients become final, do those in `step()`)."""
    forward = sorted(units, key=lambda u: (u.name != "<root>", u.index))
    order = [u.index for u in forward]
    return order if mode is UpdateMode.AT_NEXT_USE else order[::-1]


def check_intact(lifecycle: Lifecycle, what: str) -> None:
    """Raises unless the state is that of a step (the lifecycle's health, which the tiers and
    this module tell of every damage); `what` is refused ([Note: failed updates])."""
    if lifecycle.health is Health.DAMAGED:
        raise RuntimeError(f"{what}: {lifecycle.why}, so the parameters and optimizer state are not those of any "
                           "step; restore the run from a checkpoint (engine.load_checkpoint, with its optimizer "
                           "states) or build a new engine")


def write_params(params: ParamTier, optim_state: OptimizerTier, unit: Unit, fill=None,
                 new_shard: torch.Tensor | None = None) -> None:
    """Gives `unit` new compute-dtype values: `fill(target)` writes the trainable part into the
    parameter tier's target buffer, which is then committed to the tier, or `new_shard` (host,
    both parts) replaces the whole shard. A gathered unit (a persistent one, or one gathered
    by GatheredParameters) is released first and gathered again with the new values."""
    regather = unit.state is UnitState.GATHERED
    if regather:
        unit.to_released()
    if fill is None:
        params.replace(unit, new_shard)
    else:
        fill(params.update_target(unit, optim_state.on_device))
        params.commit(unit)
    if regather:
        unit.to_gathered(params.fetch(unit))
        params.done(unit)


class UpdateState(enum.Enum):
    """Where a unit's update of the last step stands ([Note: a unit's update])."""

    CURRENT = "current"
    PENDING = "pending"
    PARTIAL = "partial"


class PendingUpdates:
    """Each unit's `UpdateState` ([Note: a unit's update]) and the updates that wait for a
    unit's next use: `step()` leaves them (`leave`), the fetcher runs each before it reads the
    unit's shard (`run`), and whatever reads values or state runs those it touches first."""

    def __init__(self, params: ParamTier, optim_state: OptimizerTier, lifecycle: Lifecycle, schedule: StepSchedule):
        self.params, self.optim_state, self.lifecycle = params, optim_state, lifecycle
        self.schedule = schedule  # the order they run in is its `pending` ([Note: the step's orders])
        self._waiting: dict[int, tuple[Unit, UpdateState]] = {}  # the units not CURRENT
        self._step_args: tuple[list[AdamHyper], int, float] | None = None  # their step's hypers, count, grad scale

    def state(self, unit: Unit) -> UpdateState:
        return self._waiting[unit.index][1] if unit.index in self._waiting else UpdateState.CURRENT

    def is_pending(self, unit: Unit) -> bool:
        """Whether an update (PENDING or PARTIAL) waits for the unit's next use."""
        return unit.index in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def leave(self, order: list[Unit], hypers: list[AdamHyper], step: int, grad_scale: float) -> None:
        """`step()` leaves these units' updates for their next use, run in this order: CURRENT -> PENDING."""
        assert not self._waiting, "the last step's updates run before the next step's norm"
        self._waiting = {u.index: (u, UpdateState.PENDING) for u in order}
        self._step_args = (hypers, step, grad_scale)
        self.schedule.set_pending([u.index for u in order])
        self.optim_state.set_pending()

    def run(self, unit: Unit) -> None:
        """Runs the unit's waiting update (PENDING), or resumes it (PARTIAL): CURRENT when it
        ends, PARTIAL when it raises ([Note: a unit's update])."""
        if unit.index not in self._waiting:
            return
        check_intact(self.lifecycle, f"the update of unit {unit.index} that waits for its next use")
        hypers, step, grad_scale = self._step_args
        filled = False

        def fill(target: torch.Tensor) -> None:
            nonlocal filled
            self.optim_state.update(unit, hypers, step, grad_scale, target)
            filled = True

        self.params.hold_writes()  # until the backward: [Note: parameter writes held for the backward]
        try:
            write_params(self.params, self.optim_state, unit, fill)
        except BaseException as e:
            self._waiting[unit.index] = (unit, UpdateState.PARTIAL)
            if filled or not isinstance(e, OSError):  # updated whole (its commit failed), or not by I/O: no resuming
                self.lifecycle.damaged(f"the update of unit {unit.index} failed ({type(e).__name__}: {e}) and "
                                       "cannot be resumed")
            raise  # the next run() resumes it, or refuses
        del self._waiting[unit.index]
        self.schedule.ran(unit.index)

    def run_all(self) -> None:
        """Runs every waiting update. Once the state is damaged none can run: they are dropped
        (what refuses is `check_intact`; a load that replaces everything may follow)."""
        if self._waiting and self.lifecycle.health is Health.DAMAGED:
            self._waiting.clear()
            self.schedule.drop_pending()
            self.optim_state.drop_pending()
        for index in list(self.schedule.pending):
            self.run(self._waiting[index][0])


class StepOutcome(NamedTuple):
    grad_norm: float  # before clipping, unscaled
    applied: bool  # False when fp16 overflow skipped the step
    updated_in_backward: int  # units updated inside backward this step


class StepPolicy:
    """Owns the update order of one engine's units; the engine only says when a pass starts,
    when a unit's gradients are final, and when the step is asked for."""

    def __init__(self, units: list[Unit], params: ParamTier, optim_state: OptimizerTier, fetcher: Fetcher,
                 updates: PendingUpdates, optimizer: ZeroOptimizer, accelerator: Device, accumulation: Accumulation,
                 *, mode: UpdateMode,
                 clip: float, scaler: LossScaler | None, skip_nonfinite: bool = True,
                 model_parallel: ModelParallel | None = None):
        self.units, self.params, self.optim_state, self.fetcher = units, params, optim_state, fetcher
        self.model_parallel = model_parallel  # the norm is summed over its group too
        self.updates = updates  # [Note: a unit's update]
        self.optimizer, self.accelerator = optimizer, accelerator
        self.clip = clip
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite  # bf16.check_grad_overflow: skip a step whose norm is inf or nan
        self.mode = mode  # [Note: update modes]
        # Units updated in the hook that finalizes their gradient (the others wait for step()).
        self.in_hook = updated_in_backward(units, mode)
        self.accumulation = accumulation  # where the accumulation is: read here, owned by the engine
        self.lifecycle = accumulation.lifecycle  # the run's health: damage is reported to it ([Note: failed updates])
        self._hypers: list[AdamHyper] | None = None  # this step's, once its first unit was updated
        self._updated: set[int] = set()  # units updated this step
        self._updated_in_backward = 0
        # One flat gradient buffer per unit size, and the copy that still reads it.
        self._grad_buffers: dict[tuple[int, torch.dtype], tuple[torch.Tensor, InFlight | None]] = {}

    # ---- the pass -------------------------------------------------------------------------

    def begin_pass(self, last: bool) -> None:
        """A training forward opens a pass; `last`: it is expected to end the accumulation (its
        gradients final), so the optimizer tier may start reading the state its updates need."""
        self.accumulation.begin_pass(last)
        self.optim_state.begin_pass(last=last)

    def confirm_boundary(self, last: bool) -> None:
        """The pass's backward starts, and `last` is whether it ends the accumulation: if the
        forward expected otherwise, the plan changes now ([Note: the boundary of a pass])."""
        if self.accumulation.begin_pass(last):
            self.optim_state.begin_pass(last=last)

    # ---- backward -------------------------------------------------------------------------

    def on_unit_grads(self, unit: Unit) -> None:
        """The unit's gradients are final for this pass: reduce, hand on, maybe update."""
        self.updates.run(unit)  # its last update read the accumulator this gradient overwrites
        with TIMELINE.span("reduce_scatter", unit=unit.index):
            key = (unit.train_padded_numel, unit.dtype)
            if key not in self._grad_buffers:
                buffer = torch.zeros(unit.train_padded_numel, dtype=unit.dtype, device=self.accelerator.compute)
                self._grad_buffers[key] = (buffer, None)
            buffer, reading = self._grad_buffers[key]
            if reading is not None:  # the last gradient's copy to the host must have read it
                self.accelerator.wait_compute(reading)
            shard = zdist.reduce_scatter_mean(unit.take_grad(buffer))
        first, last = self.accumulation.first, self.accumulation.last
        reading = self.optim_state.accumulate(unit, shard, first=first, last=last)
        self._grad_buffers[key] = (buffer, reading)
        if last and unit.index in self.in_hook:  # [Note: update during backward]
            # Its backward is over: release it first, so that no gathered copy holds the
            # shard's buffer in the parameter tier while the update writes the new values.
            self.fetcher.release(unit, keep_if_reused=False, force=True)
            self._update(unit, 1.0, "backward")
            self._updated_in_backward += 1

    def abandon(self) -> None:
        """A backward failed: whatever it updated stays updated, but the step it belonged to is
        over, half applied ([Note: failed updates])."""
        for index in sorted(self._updated):
            self.lifecycle.damaged(f"a backward that updated units as their gradients became final failed after "
                                   f"updating {len(self._updated)} of them")
        self._hypers, self._updated, self._updated_in_backward = None, set(), 0

    # ---- failed updates ([Note: failed updates]) -------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the parameters and optimizer state are not those of any step, or None."""
        return self.lifecycle.why if self.lifecycle.health is Health.DAMAGED else None

    def check_intact(self, what: str) -> None:
        """Raises unless the state is that of a step; `what` is refused."""
        check_intact(self.lifecycle, what)

    # ---- the step -------------------------------------------------------------------------

    def step(self, step_number: int) -> StepOutcome:
        try:
            outcome = self._step(step_number)
        finally:  # also when an update failed: the step is abandoned, its buffers given back
            self._hypers, self._updated, self._updated_in_backward = None, set(), 0
            self.updates.schedule.end_step()  # what the step learnt of the order, for the next one
            self.optim_state.finish_step()
        self.params.flush()  # parameter writes are few (2 bytes a parameter): finish them here
        return outcome

    def _step(self, step_number: int) -> StepOutcome:
        self.check_intact("step")  # [Note: failed updates]
        # The previous step's optimizer-state writes drained behind this step's forward and
        # backward; a failed one is raised now if nothing met it yet (a read of its shard, such
        # as an update in backward, raises at once: its bytes are never taken for good ones).
        self.updates.run_all()  # the last step's updates that no use reached (their units did not run)
        self.optim_state.flush()
        units = [u for u in self.units if u.trainable]
        sq = torch.zeros(2, dtype=torch.float32)  # [model-parallel slices, the rest]
        for u in units:
            sq += self.optim_state.grad_sq(u)
        total = self.accelerator.move(sq)
        zdist.all_reduce_sum(total)
        if self.model_parallel is not None:  # [Note: model parallelism] in zero/model_parallel.py
            sliced = total[:1].clone()
            zdist.all_reduce_sum(sliced, group=self.model_parallel.group)
            total = torch.cat([sliced, total[1:]])
        sq = (total[0] + total[1]).item()
        nonfinite = not math.isfinite(sq)  # a square sum is inf or nan iff some gradient was (or overflowed)
        loss_scale = self.scaler.scale if self.scaler else 1.0
        grad_norm = (sq ** 0.5) / loss_scale
        grad_scale = 1.0 / loss_scale
        # fp16 loss scaling always skips an overflow; otherwise, as DeepSpeed 0.19.8's ZeRO-3, a
        # non-finite norm skips the step (bf16.check_grad_overflow), unless units were updated in
        # backward already.
        overflow = nonfinite and (self.scaler is not None or (self.skip_nonfinite and not self._updated))
        if nonfinite and not overflow:
            log.warning("step %d: the global gradient norm is inf or nan (a gradient holds inf or nan, or a "
                        "weight it came from does); applied as it is (%s)", step_number,
                        "bf16.check_grad_overflow is false" if not self.skip_nonfinite else
                        "units were updated during backward, as gradient_clipping is 0")
        elif overflow and self.scaler is None:
            log.warning("step %d: the global gradient norm is inf or nan (a gradient holds inf or nan, or a "
                        "weight it came from does); the step is skipped (bf16.check_grad_overflow)", step_number)
        if self.clip > 0 and not nonfinite:
            coef = torch.tensor(self.clip, dtype=torch.float32) / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6)
            grad_scale *= float(torch.clamp(coef, max=1.0))
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            if self.scaler is not None:
                log.info("step %d: gradient overflow, skipped; loss scale now %g", step_number, self.scaler.scale)
        else:
            left = [u for u in units if u.index not in self._updated]
            if self.optimizer.rule.two_pass:  # [Note: LAMB's two passes] in infinity/optim/rules.py
                self._trust_ratios(left, grad_scale)
            if self.mode is not UpdateMode.AT_NEXT_USE:
                for u in self.optim_state.step_order(left):
                    self._update(u, grad_scale, "step")
            elif left:  # [Note: updates after the norm]
                now = self.optim_state.step_order([u for u in left if u.persistent])
                later = self._forward_order([u for u in left if not u.persistent])
                self._begin_update()
                self.updates.leave(now + later, self._hypers, self.optimizer.step_count, grad_scale)
                self._update_persistent(now, step_number)
        return StepOutcome(grad_norm, not overflow, self._updated_in_backward)

    def _trust_ratios(self, units: list[Unit], grad_scale: float) -> None:
        """The first of LAMB's passes over every unit's state, summed over ranks: the ratios its
        updates use."""
        rule, hypers = self.optimizer.rule, self.optimizer.hypers()
        sums = torch.zeros(rule.tensors, 2, dtype=torch.float64)
        for u in units:
            sums += self.optim_state.norms(u, hypers, self.optimizer.step_count + 1, grad_scale)
        total = self.accelerator.move(sums)
        zdist.all_reduce_sum(total)
        rule.set_ratios(total.cpu(), hypers)

    def _forward_order(self, units: list[Unit]) -> list[Unit]:
        """`units` in the order of their first use in the recorded order, the others after."""
        by_index = {u.index: u for u in units}
        return [by_index[i] for i in self.updates.schedule.forward_order(list(by_index))]

    def _update_persistent(self, units: list[Unit], step_number: int) -> None:
        """Runs the waiting updates of the persistent units now ([Note: persistent units' updates])."""
        for u in units:
            try:
                self.updates.run(u)
            except OSError as e:
                if self.broken is not None:  # not resumable: steps refuse from now on
                    raise
                log.warning("step %d: the update of persistent unit %d failed part way (%s); the step is taken, "
                            "and the update resumes from where it failed before the next forward (which raises "
                            "if it fails again)", step_number, u.index, e)
                return  # the others wait with it: the disk just failed

    def _begin_update(self) -> None:
        if self._hypers is None:  # the step's first update
            self.optimizer.step_count += 1
            self.optimizer.mark_stepped()
            self._hypers = self.optimizer.hypers()

    def _update(self, unit: Unit, grad_scale: float, where: str) -> None:
        """Updates the unit now, in backward or in `step()`: a failure leaves the step half applied."""
        self.check_intact(where)
        self._begin_update()
        try:
            self.write_params(unit, lambda target: self.optim_state.update(
                unit, self._hypers, self.optimizer.step_count, grad_scale, target))
        except BaseException as e:  # [Note: failed updates]
            self.lifecycle.damaged(f"the update of unit {unit.index} in {where} failed ({type(e).__name__}: {e}) when "
                                   f"{len(self._updated)} other units had taken the step and it may have taken part of it")
            raise
        self._updated.add(unit.index)

    def write_params(self, unit: Unit, fill=None, new_shard: torch.Tensor | None = None) -> None:
        """`write_params` of this engine's tiers."""
        write_params(self.params, self.optim_state, unit, fill, new_shard)
