"""Where the run is in its gradient accumulation: the one owner of the count of micro-steps, of
whether the pass under way ends an accumulation, and of the backwards the accumulation holds.
The engine tells it what happened (a forward, a backward, a step, a failure, a load), the step
policy reads it (`first`, `last`), and it drives the lifecycle's transitions that depend on it
([Note: the boundary of a pass] in step_policy.py, [Note: engine lifecycle] in lifecycle.py).
"""

from __future__ import annotations

from infinity.engine.lifecycle import Lifecycle


class Accumulation:
    """The accumulation position of one engine over `gas` (gradient_accumulation_steps) passes."""

    def __init__(self, gas: int, lifecycle: Lifecycle):
        self.gas = gas
        self.lifecycle = lifecycle
        self.micro_steps = 0  # `step()` calls (DeepSpeed's counter), a partial accumulation included
        self.passes = 0  # backwards handed on in the accumulation under way
        self.last = True  # the pass under way ends an accumulation: its gradients are final
        self._counted = 0  # micro-steps `step()` counted in the accumulation under way
        self._override: bool | None = None  # set_gradient_accumulation_boundary's, until the step
        # The caller sets the boundary after each forward (accelerate): forwards expect it from the
        # count of passes instead ([Note: the boundary of a pass] in step_policy.py).
        self._after_forward = False

    @property
    def first(self) -> bool:
        """The pass under way starts an accumulation: its gradients replace the accumulators'."""
        return self.passes == 0

    def is_boundary(self) -> bool:
        """Whether the micro-step under way (from its forward to its `step()`) ends an
        accumulation, as DeepSpeed counts: `micro_steps` counts `step()` calls, so this is True
        from the last micro-batch's forward until its step, unless `set_boundary` decided."""
        if self._override is not None:
            return self._override
        return (self.micro_steps + 1) % self.gas == 0

    def expected(self) -> bool:
        """What a training forward expects its backward to find ([Note: the boundary of a pass])."""
        if self._after_forward:
            return (self.passes + 1) % self.gas == 0
        return self.is_boundary()

    def set_boundary(self, is_boundary: bool) -> None:
        """`set_gradient_accumulation_boundary`: overrides the count until the step."""
        if self.lifecycle.set_boundary(is_boundary, used=self.last):
            self._after_forward = True
        self._override = is_boundary

    def begin_pass(self, last: bool) -> bool:
        """A pass expects (or, as its backward starts, finds) `last`; whether that changed."""
        changed, self.last = last != self.last, last
        return changed

    def begin_backward(self) -> bool:
        """The pass's backward starts: the boundary it finds."""
        self.lifecycle.begin_backward(self.gas)
        return self.is_boundary()

    def end_backward(self) -> None:
        """The pass's backward handed every gradient on: the next pass adds to them."""
        self.passes += 1
        self.lifecycle.end_backward(boundary=self.last)

    def count_step(self, applied: bool) -> None:
        """`step()` counted a micro-step; `applied`: it was the boundary's, which ends the accumulation."""
        self.micro_steps += 1
        self._counted = 0 if applied else self._counted + 1

    def step_ended(self) -> None:
        """The boundary's step ran or failed: the next pass starts a new accumulation."""
        self._override = None
        self.passes = 0

    def abandon(self) -> int:
        """A backward failed: the accumulation is abandoned and its micro-steps uncounted; returns
        how many earlier passes it drops."""
        dropped = self.passes
        self.micro_steps -= self._counted
        self._counted = 0
        self.passes = 0
        return dropped

    def restart(self) -> None:
        """New values were loaded: the next pass starts a new accumulation."""
        self.passes = 0
        self._counted = 0
