"""The engine's lifecycle: one phase, one health, and the named transitions between them.

[Note: engine lifecycle]
A micro-step is a forward, its backward and a `step()`. The engine is in exactly one phase:

    IDLE ──forward──▶ FORWARD ──backward──▶ BACKWARD ──┬──▶ ACCUMULATED ──step()──▶ IDLE
      ▲                 │  ▲ (more forwards)           │        │
      │                 │  └──────────── forward ──────┼────────┘  (accelerate: no step() inside an
      │                 │                              │            accumulation; the next forward)
      │                 │                              └──▶ BOUNDARY ──step()──▶ STEPPING ──▶ IDLE
      │                 └── a forward or backward that fails ──▶ IDLE (the micro-batch is discarded)
      └── save / load (from IDLE or ACCUMULATED) ──▶ CHECKPOINTING ──▶ back where it was

    any phase ──close()──▶ CLOSED (nothing leaves it)

  IDLE          between micro-steps; no pass open (an accumulation may be part way: its
                gradients are in the optimizer tier's accumulators).
  FORWARD       a training forward ran (or runs); its backward has not. Units it gathered are
                released as it goes; the boundary may still be set (accelerate sets it here:
                [Note: the boundary of a pass] in engine/step_policy.py).
  BACKWARD      `engine.backward` runs: gradients are reduced and handed to the optimizer tier,
                units may be updated as their gradients become final ([Note: update during
                backward] in engine/step_policy.py).
  ACCUMULATED   a backward ran that does not end the accumulation; DeepSpeed's protocol calls
                `step()` (which counts the micro-step), accelerate's the next forward.
  BOUNDARY      the backward that ends the accumulation ran: the gradients are final and only
                `step()` may follow (a forward or backward would mix two steps' gradients).
  STEPPING      `step()` at a boundary: the norm, then the updates (some deferred to the next
                forward: [Note: updates after the norm] in engine/step_policy.py).
  CHECKPOINTING a save or a load runs; a second one (from a signal handler) is refused.
  CLOSED        `close()` released the tiers; every call says so.

So `backward()` may be called in FORWARD only; `step()` anywhere but BACKWARD, STEPPING,
CHECKPOINTING and CLOSED (in IDLE or FORWARD it counts a micro-step and applies nothing, as
DeepSpeed's does); `set_gradient_accumulation_boundary` anywhere open, but from BACKWARD to the
end of STEPPING only with the value the backward used. Beside the phase, the health says
whether the values are those of a step:

  SOUND         they are.
  STEP_FAILED   a `step()` raised part way: no checkpoint is taken until a step or a load
                succeeds (the next step updates every unit from where it is).
  PART_LOADED   a load failed part way: no checkpoint is taken until a whole load succeeds (a
                step does not mend the mix).
  DAMAGED       an update was applied to some units and not others and cannot be resumed, or a
                write of new values failed ([Note: failed updates] in engine/step_policy.py):
                steps and saves are refused until a whole load replaces everything.
"""

from __future__ import annotations

import enum
import signal

from infinity.engine.signals import SignalGate


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    ACCUMULATED = "accumulated"
    BOUNDARY = "boundary"
    STEPPING = "stepping"
    CHECKPOINTING = "checkpointing"
    CLOSED = "closed"


class Health(enum.Enum):
    SOUND = "sound"
    STEP_FAILED = "step failed"
    PART_LOADED = "part loaded"
    DAMAGED = "damaged"


CLOSED_MESSAGE = ("this engine was closed (engine.close() released its parameters and optimizer state); build "
                  "(or load) the model again and pass the new one to infinity.initialize")


class Lifecycle:
    """The engine's phase and health ([Note: engine lifecycle]); each transition checks the phase
    it leaves, and the errors users see come from those checks. It also holds the user's
    signal handlers from the forward that opens an accumulation to the `step()` that ends it
    ([Note: signals at step boundaries] in infinity/engine/signals.py)."""

    def __init__(self, signals: SignalGate) -> None:
        self.phase = Phase.IDLE
        self.health = Health.SOUND
        self.why: str | None = None  # what made the health other than SOUND
        self.signals = signals
        self._holding = False  # the signals are held for the accumulation under way
        self._before_checkpoint: Phase | None = None

    # ---- the pass ---------------------------------------------------------------------------

    def begin_forward(self, training: bool) -> bool:
        """A forward starts; True when it opens a pass (the others run inside one). An
        evaluation forward (no gradients) opens a pass that ends inside it and changes no phase."""
        self.check_open()
        if self.phase in (Phase.FORWARD, Phase.BACKWARD):
            return False
        if not training:
            return True
        if self.phase is Phase.BOUNDARY:
            raise RuntimeError("forward: backward() ended an accumulation and step() has not run; call engine.step() "
                               "first, so that this forward sees the updated parameters")
        if self.phase not in (Phase.IDLE, Phase.ACCUMULATED):
            raise RuntimeError(f"forward: the engine is {self.phase.value}; run a training forward between steps")
        if not self._holding:
            self.signals.hold()  # first, before anything changes ([Note: where a held handler may run])
            self._holding = True
        self.phase = Phase.FORWARD
        return True

    def forward_failed(self) -> None:
        """The forward raised: nothing will run its backward."""
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE
            self._let_go()

    def begin_backward(self, gas: int) -> None:
        """`gas`: gradient_accumulation_steps, for the message."""
        self.check_open()
        if self.phase is Phase.FORWARD:
            self.phase = Phase.BACKWARD
            return
        if self.phase in (Phase.ACCUMULATED, Phase.BOUNDARY):
            what = ("the gradients of the last accumulation boundary have not been applied" if self.phase is Phase.BOUNDARY
                    else "this micro-batch's gradients are accumulated already, and would count twice")
            raise RuntimeError(
                f"engine.backward() was called again before engine.step(): {what} (gradient_accumulation_steps="
                f"{gas}); call engine.step() after every engine.backward(), as with DeepSpeed, and sum the losses "
                "of one micro-batch before its backward")
        raise RuntimeError(f"engine.backward(): the engine is {self.phase.value}, not after a training forward; run "
                           "this micro-batch's forward through the engine (engine(...), not engine.module(...)) with "
                           "gradients enabled first")

    def end_backward(self, boundary: bool) -> None:
        assert self.phase is Phase.BACKWARD, self.phase
        self.phase = Phase.BOUNDARY if boundary else Phase.ACCUMULATED

    def backward_failed(self) -> None:
        """The backward raised (or was refused): the micro-batch is discarded."""
        if self.phase in (Phase.FORWARD, Phase.BACKWARD):
            self.phase = Phase.IDLE
            self._let_go()

    def set_boundary(self, is_boundary: bool, used: bool) -> bool:
        """`set_gradient_accumulation_boundary(is_boundary)`; `used`: the boundary the pass
        under way expects. True when it decides the pass under way (FORWARD: its backward has not
        run), False when the next pass; raises once a backward has used another value."""
        self.check_open()
        if self.phase in (Phase.BACKWARD, Phase.BOUNDARY, Phase.STEPPING) and is_boundary != used:
            raise RuntimeError("set_gradient_accumulation_boundary: the backward of this micro-batch has run as "
                               f"{'the last' if used else 'not the last'} of its accumulation; set the boundary "
                               "before the backward")
        return self.phase is Phase.FORWARD

    @property
    def in_pass(self) -> bool:
        return self.phase in (Phase.FORWARD, Phase.BACKWARD)

    @property
    def grads_final(self) -> bool:
        return self.phase is Phase.BOUNDARY

    # ---- the step ---------------------------------------------------------------------------

    def begin_step(self) -> bool:
        """`step()` starts; True when it applies an update (at a boundary), False when it only
        counts the micro-step."""
        self.check_open()
        if self.phase is Phase.BOUNDARY:
            self.phase = Phase.STEPPING
            return True
        if self.phase is Phase.ACCUMULATED:
            self.phase = Phase.IDLE
        elif self.phase not in (Phase.IDLE, Phase.FORWARD):
            raise RuntimeError(f"step(): the engine is {self.phase.value}; call it after engine.backward()")
        return False

    def end_step(self, ok: bool, why: str | None = None) -> None:
        """The step at the boundary ended (`ok`) or raised (`why`): the next micro-step starts a
        new accumulation either way, and the held signal handlers run now."""
        assert self.phase is Phase.STEPPING, self.phase
        self.phase = Phase.IDLE
        if ok and self.health is Health.STEP_FAILED:
            self._heal()
        elif not ok:
            self.step_failed(why or "a step failed")
        self._let_go(boundary=ok)

    # ---- checkpoints ------------------------------------------------------------------------

    def begin_checkpoint(self) -> None:
        """A save or a load starts: from IDLE or ACCUMULATED only (see `check_between_steps`),
        once at a time; the user's handlers wait for its end."""
        self.check_open()
        if self.phase is Phase.CHECKPOINTING:
            raise RuntimeError("a checkpoint is being saved or loaded by this engine (a signal handler called "
                               "save_checkpoint or load_checkpoint inside it?); wait for it to finish")
        self.signals.hold()  # a pending handler runs here, before this save begins
        self._before_checkpoint, self.phase = self.phase, Phase.CHECKPOINTING

    def end_checkpoint(self, ok: bool) -> None:
        assert self.phase is Phase.CHECKPOINTING, self.phase
        self.phase, self._before_checkpoint = self._before_checkpoint, None
        self.signals.release(boundary=ok)

    def check_between_steps(self, what: str, replaces_all: bool = False) -> None:
        """Raises unless the values are a step's result and no step is part way (what a save
        reads); `replaces_all`: a load of every value, which mends any health."""
        self.check_open()
        if self.health is not Health.SOUND and not replaces_all:
            remedy = {Health.STEP_FAILED: "Run a step, load a checkpoint",
                      Health.PART_LOADED: "Load a whole checkpoint (with its optimizer states)",
                      Health.DAMAGED: "Load a whole checkpoint (with its optimizer states)"}[self.health]
            raise RuntimeError(f"{what}: {self.why}, so the parameters and optimizer state may be partly updated; no "
                               f"checkpoint is taken of them. {remedy}, or build a new engine")
        phase = self._before_checkpoint if self.phase is Phase.CHECKPOINTING else self.phase
        if phase in (Phase.FORWARD, Phase.BACKWARD):
            raise RuntimeError(f"{what}: a training forward is under way and its backward has not run; call it "
                               "between steps (after engine.step())")
        if phase is Phase.BOUNDARY:
            raise RuntimeError(f"{what}: backward() ended an accumulation and step() has not run; call engine.step() "
                               "first, so that the state is the step's result")

    # ---- health -----------------------------------------------------------------------------

    def step_failed(self, why: str) -> None:
        """An update was abandoned part way: until a step or a load succeeds (a worse health stays)."""
        if self.health is Health.SOUND:
            self.health, self.why = Health.STEP_FAILED, why

    def part_loaded(self, why: str) -> None:
        if self.health is not Health.DAMAGED:  # a worse health stays
            self.health, self.why = Health.PART_LOADED, why

    def damaged(self, why: str) -> None:
        """A damage event (the tiers and the step policy report each one): steps and saves are
        refused until a load replaces every value. The first reason is kept."""
        if self.health is not Health.DAMAGED:
            self.health, self.why = Health.DAMAGED, why

    def loaded(self) -> None:
        """A load replaced every value: nothing of the step before it carries over."""
        if self._before_checkpoint in (Phase.ACCUMULATED, Phase.BOUNDARY):
            self._before_checkpoint = Phase.IDLE
        self._heal()

    def _heal(self) -> None:
        self.health, self.why = Health.SOUND, None

    # ---- the end ----------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.phase is Phase.CLOSED:
            late = "".join(f"; {signal.Signals(n).name} arrived during engine.close() and its handler ran once the "
                           "close was done, with nothing left to save or train" for n in self.signals_in_close[:1])
            raise RuntimeError(CLOSED_MESSAGE + late + self.closed_note)

    closed_note = ""  # what closed it, where that needs saying (engine.destroy())
    signals_in_close: list[int] = []  # held signals that arrived during the cleanup ([Note: signals during cleanup])

    def close(self) -> bool:
        """True the first time: the caller releases the tiers. The signals held go back first."""
        if self.phase is Phase.CLOSED:
            return False
        self._holding = False
        self.signals.close()  # the user's handlers are back, and run for what arrived, while it is open
        if self.phase is Phase.CLOSED:  # one of them closed the engine itself
            return False
        self.phase = Phase.CLOSED
        return True

    def _let_go(self, boundary: bool = False) -> None:
        if self._holding:
            self._holding = False
            self.signals.release(boundary)
