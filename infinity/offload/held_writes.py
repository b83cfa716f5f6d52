"""`HeldWrites`: a write handle whose writes can be held back, then submitted in their order.

[Note: parameter writes held for the backward]
When the updates wait for the global norm and run at each unit's next use ([Note: updates after
the norm] in infinity/engine/step_policy.py), the next forward does all of the step's
optimizer-state I/O, and its disk is busy throughout; the backward has no I/O of its own (its
updates wait for the norm, and the optimizer pool is full of the next forward's reads), so the
disk idles through it. The parameter tier's writes of the new values, issued as each update
commits, are held from the forward's first update until the backward starts
(`NvmeParams.hold_writes`, `release_writes`) and submitted then, in the order they came: the
same bytes, moved while the disk would idle instead of among the forward's reads. A held write
keeps its pool buffer, so the tier holds writes only while its pool can spare the buffers the
next updates need; when it cannot, it submits the oldest it holds (`submit_oldest`), so that a
buffer comes back without the compute thread waiting for a write to start.

To the swapper a held write is a write in flight (HOST_TO_NVME: its buffer is lent to readers
and never read back from disk), so every guarantee of [Note: transfer ordering] in swapper.py
holds as it is. No wait lasts forever: a wait for a held write (a second write of the shard, a
buffer needed under pressure, `flush`, `close`) first submits everything held. A held write
whose submission fails has failed as a write: its error is raised to whoever waits for it. Its
time counts from its submission (`issued_at`), so the report's write rates and busy time are the
disk's, not the wait's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_HELD = 1 << 62  # the ids of held writes start here, far above any id an I/O handle gives


class HeldWrites:
    """Wraps the I/O handle that one swapper writes with ([Note: parameter writes held for the
    backward]). `hold()` holds the writes submitted after it; `release()` submits those held and
    stops holding. Thread-safe."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._lock = threading.Lock()
        self._holding = False
        self._next = _HELD
        self._held: dict[int, tuple[Any, Any, int]] = {}  # held id -> (buffer, path, offset), oldest first
        self._issued: dict[int, tuple[int | None, OSError | None]] = {}  # held id -> (handle's id, failure)
        self._issued_at: dict[int, float] = {}  # held id -> when it was submitted, until asked (`issued_at`)
        # The swapper looks these up with getattr and does without them: so must this wrapper.
        for optional in ("done", "wait_timed", "finished_count"):
            if not hasattr(handle, optional):
                setattr(self, optional, None)

    @property
    def holding(self) -> bool:
        return self._holding

    def hold(self) -> None:
        self._holding = True

    def release(self) -> None:
        """Submits the writes held, and holds no more."""
        with self._lock:
            self._holding = False
            self._submit(list(self._held))

    def submit_oldest(self) -> None:
        """Submits the oldest write held (its buffer is needed soon), holding the others."""
        with self._lock:
            self._submit(list(self._held)[:1])

    def _submit(self, held: list[int]) -> None:
        for rid in held:
            buffer, path, offset = self._held.pop(rid)
            try:
                self._issued[rid] = (self.handle.submit_write(buffer, path, offset), None)
            except OSError as e:  # raised to whoever waits for this write
                self._issued[rid] = (None, e)
            self._issued_at[rid] = time.monotonic()

    # ---- the I/O handle -------------------------------------------------------------------

    def submit_read(self, buffer, path, offset: int = 0) -> int:
        return self.handle.submit_read(buffer, path, offset)

    def submit_write(self, buffer, path, offset: int = 0) -> int:
        with self._lock:
            if not self._holding:
                return self.handle.submit_write(buffer, path, offset)
            rid = self._next
            self._next += 1
            self._held[rid] = (buffer, path, offset)
            return rid

    def _request(self, rid: int) -> int:
        """The handle's id of `rid`, submitting the held writes first if it is one of them;
        raises the failure of a held write whose submission failed."""
        if rid < _HELD:
            return rid
        with self._lock:
            if rid in self._held:
                self._submit(list(self._held))
            request, error = self._issued.pop(rid)
        if error is not None:
            raise error
        return request

    def wait(self, request: int | None = None) -> int:
        """`request`, or with None every write (the held ones submitted first), as the handle's."""
        if request is None:
            with self._lock:
                self._submit(list(self._held))
            return self.handle.wait()
        return self.handle.wait(self._request(request))

    def wait_timed(self, request: int) -> float:
        return self.handle.wait_timed(self._request(request))

    def done(self, request: int) -> bool:
        if request < _HELD:
            return self.handle.done(request)
        with self._lock:
            if request in self._held:
                return False
            handle_id, error = self._issued[request]
        return error is not None or self.handle.done(handle_id)

    def finished_count(self) -> int:
        return self.handle.finished_count()

    def issued_at(self, request: int) -> float | None:
        """When a write that was held was submitted (time.monotonic()); None for one never held.
        Asked once, after its wait."""
        with self._lock:
            return self._issued_at.pop(request, None)
