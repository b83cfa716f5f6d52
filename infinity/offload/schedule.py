"""The orders a training step follows, recorded once and read by everyone who plans by them
([Note: the step's orders]).

[Note: the step's orders]
Three orders decide what is read ahead and what is kept, and each has one writer:

  uses         the units in the order this step used them (forward pre-hooks, pre-backward,
               recomputation): the fetcher appends each use and, at the end of the step,
               makes them `last_uses` (when they differ). `last_uses` is what the fetcher
               prefetches and keeps units by ([Note: recorded order] in infinity/zero/fetcher.py),
               what the parameter tier evicts by, and the order in which updates that wait for
               the next forward run (the step policy's `forward_order`).
  final        the units whose gradient became final this step, in that order: the optimizer tier
               appends each as it takes the final gradient in. At the end of the step it becomes
               `expected`, the order the next step is expected to need the optimizer state in
               ([Note: reading ahead in the expected order] in optimizer/nvme.py), unless updates
               wait for the next forward: then `expected` is the pending order.
  pending      the units whose update waits for their next use, in the order they will run
               ([Note: updates after the norm] in infinity/engine/step_policy.py): the pending
               updates set it at `step()` (and keep it as `last_pending`) and take each unit out
               once its update has run.

Before the first step nothing was recorded: `expected` (and, when updates wait for the next
forward, `last_pending`) is the order construction expects (`expected_update_order`).
"""

from __future__ import annotations


class StepSchedule:
    """The step's orders ([Note: the step's orders]); lists of unit indices."""

    def __init__(self, expected: list[int], at_next_use: bool):
        self.uses: list[int] = []
        self.last_uses: list[int] | None = None
        self.final: list[int] = []
        self.expected: list[int] = list(expected)
        self.pending: list[int] = []
        self.last_pending: list[int] = list(expected) if at_next_use else []

    # ---- the fetcher's --------------------------------------------------------------------

    def use(self, index: int) -> None:
        self.uses.append(index)

    def begin_uses(self) -> None:
        self.uses = []

    def end_uses(self) -> bool:
        """The step's uses become the recorded order; whether it changed."""
        if not self.uses or self.uses == self.last_uses:
            return False
        self.last_uses = list(self.uses)
        return True

    def forward_order(self, indices: list[int]) -> list[int]:
        """`indices` in the order of their first use in the recorded order, the others after."""
        first: dict[int, int] = {}
        for pos, index in enumerate(self.last_uses or ()):
            first.setdefault(index, pos)
        return sorted(indices, key=lambda i: (first.get(i, 1 << 62), i))

    # ---- the optimizer tier's ---------------------------------------------------------------

    def gradient_final(self, index: int) -> None:
        self.final.append(index)

    def end_step(self) -> None:
        """The step ended: what it learnt of the order becomes what the next one expects."""
        if self.final:
            self.expected, self.final = self.last_pending or self.final, []

    # ---- the pending updates' ---------------------------------------------------------------

    def set_pending(self, order: list[int]) -> None:
        self.pending = list(order)
        self.last_pending = list(order)

    def ran(self, index: int) -> None:
        """A pending update ran whole."""
        self.pending.remove(index)

    def drop_pending(self) -> None:
        self.pending = []
