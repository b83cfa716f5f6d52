"""`SwapStats`: what the swapper moved between host memory and NVMe, and how much of it was hidden.

`SwapCounters` keeps the running totals; the swapper owns one, updates it under its lock as
transfers are submitted and completed, and hands out `SwapStats` snapshots (`Swapper.stats`).

[Note: busy time]
Transfers overlap, so their summed seconds overstate how long the disk was busy; the busy
figures are the wall time with at least one transfer (of a direction, or of either) in flight.
Transfers are counted as they complete, roughly in the order they were issued (each handle
serves its queue in order), so the union of their intervals is kept as one running end: an
interval adds only what lies beyond it. A transfer seen after a later one adds less than it
might: the figure errs low, never double-counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from infinity.offload.shard import Transfer


class DirectionStats(NamedTuple):
    """Traffic in one direction between host memory and NVMe."""

    bytes: int  # of completed transfers
    count: int
    seconds: float  # submission to completion, summed over transfers (they overlap)
    wait_seconds: float  # callers blocked waiting for these transfers: the I/O not hidden
    busy_seconds: float  # wall time with a transfer of this direction in flight ([Note: busy time])
    submitted_bytes: int  # of transfers issued, complete or not


class SwapStats(NamedTuple):
    nvme_to_host: DirectionStats
    host_to_nvme: DirectionStats
    hits: int  # fetches served without a read (in host memory, or a read already in flight)
    misses: int  # fetches that issued a read
    busy_seconds: float = 0.0  # wall time with any transfer in flight


@dataclass(slots=True)
class _Totals:
    """A direction's running `DirectionStats`."""

    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    busy_seconds: float = 0.0
    submitted_bytes: int = 0

    def stats(self) -> DirectionStats:
        return DirectionStats(self.bytes, self.count, self.seconds, self.wait_seconds, self.busy_seconds,
                              self.submitted_bytes)


class SwapCounters:
    """The running totals behind `Swapper.stats`. Not locked itself: the swapper's lock guards it."""

    hits: int  # fetches served without a read
    misses: int  # fetches that issued a read

    def __init__(self) -> None:
        # write? -> its totals, added to in place: two updates a transfer, where a NamedTuple's
        # _replace took 2 us each
        self._directions = {False: _Totals(), True: _Totals()}
        self._busy_until: dict[bool | None, float] = {False: 0.0, True: 0.0, None: 0.0}  # None: either
        self._busy_any = 0.0
        self.hits = 0
        self.misses = 0

    def snapshot(self) -> SwapStats:
        return SwapStats(self._directions[False].stats(), self._directions[True].stats(), self.hits, self.misses,
                         self._busy_any)

    def submitted(self, write: bool, nbytes: int) -> None:
        self._directions[write].submitted_bytes += nbytes

    def completed(self, transfer: Transfer, began: float, finished: float) -> None:
        """Counts a transfer that completed without error: `began` is when its caller started
        waiting for it, `finished` when the I/O handle says it was done (kept between its
        submission and now)."""
        now = time.monotonic()
        finished = min(max(finished, transfer.started), now)
        totals = self._directions[transfer.write]
        totals.bytes += transfer.buffer.numel()
        totals.count += 1
        totals.seconds += finished - transfer.started
        totals.wait_seconds += now - began
        totals.busy_seconds += self._busy(transfer.write, transfer.started, finished)
        self._busy_any += self._busy(None, transfer.started, finished)

    def _busy(self, direction: bool | None, start: float, end: float) -> float:
        """New wall time that the interval [start, end] adds to `direction`'s busy time
        ([Note: busy time])."""
        until = self._busy_until[direction]
        self._busy_until[direction] = max(until, end)
        return max(0.0, end - max(start, until))
