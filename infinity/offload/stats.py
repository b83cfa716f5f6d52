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


_NO_STATS = DirectionStats(0, 0, 0.0, 0.0, 0.0, 0)


class SwapCounters:
    """The running totals behind `Swapper.stats`. Not locked itself: the swapper's lock guards it."""

    hits: int  # fetches served without a read
    misses: int  # fetches that issued a read

    def __init__(self) -> None:
        self._directions = {False: _NO_STATS, True: _NO_STATS}  # write? -> traffic
        self._busy_until: dict[bool | None, float] = {False: 0.0, True: 0.0, None: 0.0}  # None: either
        self._busy_any = 0.0
        self.hits = 0
        self.misses = 0

    def snapshot(self) -> SwapStats:
        return SwapStats(self._directions[False], self._directions[True], self.hits, self.misses, self._busy_any)

    def submitted(self, write: bool, nbytes: int) -> None:
        old = self._directions[write]
        self._directions[write] = old._replace(submitted_bytes=old.submitted_bytes + nbytes)

    def completed(self, transfer: Transfer, began: float, finished: float) -> None:
        """Counts a transfer that completed without error: `began` is when its caller started
        waiting for it, `finished` when the I/O handle says it was done (kept between its
        submission and now)."""
        now = time.monotonic()
        finished = min(max(finished, transfer.started), now)
        old = self._directions[transfer.write]
        self._directions[transfer.write] = old._replace(
            bytes=old.bytes + transfer.buffer.numel(), count=old.count + 1,
            seconds=old.seconds + finished - transfer.started, wait_seconds=old.wait_seconds + now - began,
            busy_seconds=old.busy_seconds + self._busy(transfer.write, transfer.started, finished),
        )
        self._busy_any += self._busy(None, transfer.started, finished)

    def _busy(self, direction: bool | None, start: float, end: float) -> float:
        """New wall time that the interval [start, end] adds to `direction`'s busy time
        ([Note: busy time])."""
        until = self._busy_until[direction]
        self._busy_until[direction] = max(until, end)
        return max(0.0, end - max(start, until))
