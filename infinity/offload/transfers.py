"""`ShardTransfers`: the swapper's bookkeeping, under one lock: a `Shard` record per shard
(shard.py), the NVMe transfers in flight on them, the failures those met, and the pool buffers
they take. `Swapper` (swapper.py) makes its operations of these steps and keeps their
guarantees ([Note: transfer ordering] in swapper.py).

[Note: completing transfers]
Each I/O request is waited for by exactly one thread (a handle's request ids are single-use):
the thread that wants a transfer finished marks the shard `completing`, waits with the lock
released, then moves the shard on; any other thread that needs it meanwhile waits on the
condition variable for the state to change. Errors are recorded on the shard and raised to
whoever waits for that transfer (`wait`), and write errors nobody waited for by `flush`, so
that an unrelated fetch that only reaped a failed write to free its buffer does not raise.

[Note: buffers under pressure]
When no pool buffer is free, the swapper first drops the cached shard the cache would evict
first (free at once: cached shards are always clean), then finishes the oldest write in flight
whose buffer nobody holds, and only then waits for a release by another thread, at most
`timeout` seconds (the pool's error names buffer_count and buffer_size).
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Hashable
from typing import Protocol

import torch

from infinity.device.timeline import TIMELINE, profiled

from infinity.offload.cache import HostCache
from infinity.offload.pool import BufferPool
from infinity.offload.shard import Shard, ShardKey, Transfer, WriteHandle
from infinity.offload.state import ShardState
from infinity.offload.stats import SwapCounters
from infinity.offload.store import Extent, NvmeStore


READ_RETRY = "nothing changed on disk: the next read of it tries again"  # what a failed read tells

class IOHandle(Protocol):
    """What the swapper needs of an I/O handle (`infinity.io.AsyncIOHandle`, or a test's wrapper).
    Optional beyond these: `done(request)`, `wait_timed(request)`, and `finished_count()`, which
    must move whenever a `done` answer may have turned True (`Swapper.reap` looks only then)."""

    def submit_read(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int: ...
    def submit_write(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int: ...
    def wait(self, request: int | None = None) -> int: ...


class ShardTransfers:
    """The shards of one store, the transfers in flight on them, and the lock that guards both.
    Its arguments are `Swapper`'s, with their defaults resolved."""

    _shards: dict[ShardKey, Shard]
    _writes: dict[ShardKey, Shard]  # shards with a write in flight, oldest first
    _unreported: list[OSError]  # failed writes nobody has waited for ([Note: completing transfers])
    _lost: dict[ShardKey, OSError]  # INVALID shards (or rewritten, not yet done): why their bytes are gone
    _counters: SwapCounters  # what moved, for `stats`

    def __init__(self, store: NvmeStore, pool: BufferPool, cache: HostCache | None, handle: IOHandle,
                 write_handle: IOHandle, read_delay_s: float, timeout: float | None) -> None:
        self.store = store
        self.pool = pool
        self.cache = cache
        self.handle = handle
        self.write_handle = write_handle
        self.read_delay_s = read_delay_s
        self._label = getattr(store, "name", "store")  # for the timeline
        self._waits = {False: f"{self._label} read", True: f"{self._label} write"}  # write? -> its waits' name
        self.timeout = timeout
        self._shards = {}
        self._writes = {}
        self._unreported = []
        self._lost = {}
        self.on_lost: Callable[[str, OSError], None] | None = None  # told of every write that loses a shard's bytes
        self._parked: dict[ShardKey, tuple[torch.Tensor, int]] = {}  # failed write's buffer -> loans out
        self._counters = SwapCounters()
        # Guards every Shard and the fields above. Reentrant: Condition.__enter__ is Python code, and
        # a KeyboardInterrupt raised in it right after the lock was taken (Ctrl-C, at the eval
        # breaker of its return) leaves the lock held with no `with` to release it; the close()
        # that the interrupt leads to would then wait for the lock forever (seen: a finetune
        # killed by SIGINT at a step, hung in Swapper.let_go). Only this thread takes it.
        self._cond = threading.Condition(threading.RLock())

    def check_invariants(self, outside: int = 0) -> None:
        """Asserts that memory and states agree (for tests and debugging); `outside` is the
        number of pool buffers the caller holds itself."""
        with self._cond:
            owning = 0
            cached_bytes = 0
            for (kind, key), shard in self._shards.items():
                has_buffer = shard.state in (ShardState.NVME_TO_HOST, ShardState.HOST)
                if shard.state is ShardState.HOST_TO_NVME:
                    has_buffer = shard.buffer is not None
                assert (shard.buffer is not None) == has_buffer, f"{shard.name}: buffer vs {shard.state.name}"
                assert (shard.transfer is not None) == (
                    shard.state in (ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME)
                ), f"{shard.name}: transfer vs {shard.state.name}"
                owning += has_buffer
                cached = self.cache is not None and (kind, key) in self.cache
                if cached:
                    assert shard.state is ShardState.HOST and shard.holders == 0 and not shard.dirty, shard.name
                    cached_bytes += shard.extent.nbytes
                elif shard.state is ShardState.HOST:
                    assert shard.holders > 0, f"{shard.name}: idle in host memory but not cached"
                assert (shard.state is ShardState.HOST_TO_NVME) == ((kind, key) in self._writes), shard.name
                assert shard.lent <= shard.holders, f"{shard.name}: {shard.lent} loans, {shard.holders} holders"
                if shard.state is ShardState.INVALID:
                    assert (kind, key) in self._lost, f"{shard.name}: invalid, but not counted as lost"
                elif (kind, key) in self._lost:
                    assert shard.state is ShardState.HOST_TO_NVME, f"{shard.name}: lost, but {shard.state.name}"
            in_use = self.pool.stats.buffers_in_use
            owning += len(self._parked)
            assert in_use == owning + outside, f"pool: {in_use} buffers in use, shards own {owning} + {outside} outside"
            if self.cache is not None:
                assert self.cache.bytes_used == cached_bytes <= self.cache.max_bytes, "cache accounting"
                assert len(self.cache) == sum(1 for k in self._shards if k in self.cache), "cache holds unknown keys"

    # ---- the machinery (all called with the lock held) ----------------------------------------

    def _shard(self, kind: str, key: Hashable) -> Shard:
        shard = self._shards.get((kind, key))
        if shard is None:
            shard = self._shards[(kind, key)] = Shard(kind, key, self.store.extent(kind, key))
        return shard

    def _submit(self, write: bool, buffer: torch.Tensor, extent: Extent) -> Transfer:
        with profiled("infinity::nvme_write" if write else "infinity::nvme_read"):
            started = time.monotonic()
            if TIMELINE.recording:
                TIMELINE.instant("write issued" if write else "read issued", self._label, nbytes=buffer.numel())
            submit = self.write_handle.submit_write if write else self.handle.submit_read
            request = submit(buffer, extent.path, extent.offset)
        self._counters.submitted(write, buffer.numel())
        return Transfer(buffer, request, write, started)

    def _complete(self, shard: Shard) -> None:
        """Waits for the shard's transfer and moves the shard on ([Note: completing transfers]).

        Releases the lock while it waits; outcomes, failures included, are recorded on the shard.
        """
        if shard.completing:
            while shard.completing:
                self._cond.wait()
            return
        transfer = shard.transfer
        assert transfer is not None, f"{shard.name}: nothing in flight ({shard.state.name})"
        shard.completing = True
        error: OSError | None = None
        began = time.monotonic()
        finished = began
        timed_from = transfer.started  # when the disk got it: a held write's submission, not its queueing
        self._cond.release()
        try:
            with profiled("infinity::nvme_wait"):
                if not transfer.write and self.read_delay_s > 0:
                    time.sleep(max(0.0, transfer.started + self.read_delay_s - time.monotonic()))
                handle = self.write_handle if transfer.write else self.handle
                try:
                    timed = getattr(handle, "wait_timed", None)
                    if timed is not None:
                        finished = timed(transfer.request)
                    else:
                        handle.wait(transfer.request)
                        finished = time.monotonic()
                except OSError as e:
                    error = e
                issued = getattr(handle, "issued_at", None)  # [Note: parameter writes held for the backward]
                if issued is not None and (at := issued(transfer.request)) is not None:
                    timed_from = max(transfer.started, at)
        finally:
            # Timed here, not in a `TIMELINE.span` (a generator a transfer), and labelled only for a
            # timeline that records: with the counters' and the pool's shortcuts, ~10 us of the ~60
            # a transfer took of the step's thread (bench/bench_transfer_overhead.py).
            args = {"shard": f"{shard.kind} {shard.key}"} if TIMELINE.recording else {}
            TIMELINE.add_wait(self._waits[transfer.write], began, time.monotonic(), **args)
            self._cond.acquire()
            shard.completing = False
            self._cond.notify_all()
        if error is None:
            if not transfer.write and self.read_delay_s > 0:
                finished = max(finished, transfer.started + self.read_delay_s)
            self._counters.completed(transfer if timed_from == transfer.started else transfer._replace(started=timed_from),
                                    began, finished)
            if TIMELINE.recording:
                TIMELINE.transfer(f"{self._label} {'writes' if transfer.write else 'reads'}", f"{shard.kind} {shard.key}",
                                  timed_from, finished, transfer.buffer.numel())
        if transfer.write:
            self._finish_write(shard, transfer, error)
        else:
            self._finish_read(shard, transfer, error)

    def _finish_read(self, shard: Shard, transfer: Transfer, error: OSError | None) -> None:
        if error is None:
            shard.to_host()
            return
        shard.failure = (transfer, self._transfer_error(shard, error, "read", READ_RETRY))
        shard.holders = 0  # every fetch that shared this read fails with it
        self.pool.release(shard.to_nvme())
        self._cond.notify_all()

    def _finish_write(self, shard: Shard, transfer: Transfer, error: OSError | None) -> None:
        del self._writes[(shard.kind, shard.key)]
        if error is not None:
            self._fail_write(shard, transfer, error)
            return
        lost = self._lost.pop((shard.kind, shard.key), None)
        if lost is not None:  # written again: its bytes are good, and the old failure is moot
            self._unreported = [e for e in self._unreported if e is not lost]
        if shard.buffer is None:  # written from the caller's tensor
            shard.to_nvme()
        else:
            shard.to_host()
            if shard.holders == 0:
                self._keep_or_drop(shard)

    def _fail_write(self, shard: Shard, transfer: Transfer | None, error: OSError) -> OSError:
        """Marks the shard INVALID; `transfer` None: the write was refused at submission, and the
        caller raises the error at once (so it is not left for `flush`)."""
        failure = self._transfer_error(shard, error, "write", "its bytes on NVMe are invalid until it is written again")
        shard.failure = (transfer, failure)
        self._lost[(shard.kind, shard.key)] = failure
        if self.on_lost is not None:  # the owner of the run's health hears of it now
            self.on_lost(shard.kind, failure)
        shard.holders = 0  # fetches that waited on this write fail with it, as with a failed read
        if transfer is not None:
            self._unreported.append(failure)
        loans, shard.lent = shard.lent, 0
        buffer = shard.to_invalid()
        if buffer is not None and loans:  # [Note: lending bytes under a write] in swapper.py
            self._parked[(shard.kind, shard.key)] = (buffer, loans)
        elif buffer is not None:
            self.pool.release(buffer)
            self._cond.notify_all()
        return failure

    @staticmethod
    def _transfer_error(shard: Shard, error: OSError, verb: str, consequence: str) -> OSError:
        where = f"{shard.extent.nbytes} bytes, {shard.extent.path} at offset {shard.extent.offset}"
        message = f"{verb} of {shard.name} ({where}) failed: {error.strerror}; {consequence}"
        return OSError(error.errno, message, error.filename or shard.extent.path)

    def _invalid_error(self, shard: Shard, verb: str) -> OSError:
        cause = f" ({shard.failure[1].strerror})" if shard.failure is not None else ""
        return OSError(
            errno.EIO,
            f"{verb}: {shard.name} is invalid: its last write failed{cause}, so its bytes on NVMe cannot be "
            f"trusted and are never read; it stays invalid until new values for it are written",
            shard.extent.path,
        )

    def _raise_failure(self, shard: Shard) -> None:
        assert shard.failure is not None
        failure = shard.failure[1]
        self._unreported = [e for e in self._unreported if e is not failure]  # reported now
        raise failure

    def _wait_write(self, shard: Shard, transfer: Transfer) -> None:
        while True:
            if shard.failure is not None and shard.failure[0] is transfer is not None:
                self._raise_failure(shard)
            if shard.transfer is not transfer:
                return  # completed, successfully, before
            self._complete(shard)

    def _write_back(self, shard: Shard) -> WriteHandle:
        """Writes a HOST shard from its own buffer (write-through, [Note: shard life cycle] in
        shard.py)."""
        try:
            transfer = self._submit(True, shard.buffer, shard.extent)
        except OSError as e:
            raise self._fail_write(shard, None, e) from e
        shard.to_host_to_nvme(transfer, shard.buffer)
        self._writes[(shard.kind, shard.key)] = shard
        return WriteHandle(shard.kind, shard.key, transfer)

    def _make_writable(self, shard: Shard, verb: str) -> None:
        """Waits until nothing is in flight on an unheld shard, so a new write may start."""
        while True:
            if shard.holders:
                raise ValueError(f"{verb}: {shard.name} is fetched ({shard.holders} not released); release it first")
            if shard.state not in (ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME):
                return
            self._complete(shard)

    def _keep_or_drop(self, shard: Shard) -> None:
        """An idle, clean HOST shard: kept by the cache if it admits it, else back to NVME."""
        if self.cache is not None:
            victims = self.cache.admit((shard.kind, shard.key), shard.extent.nbytes)
            if victims is not None:
                for victim in victims:
                    self._drop(self._shards[victim])
                return
        self._drop(shard)

    def _uncache(self, shard: Shard) -> None:
        if self.cache is not None:
            self.cache.remove((shard.kind, shard.key))

    def _drop(self, shard: Shard) -> None:
        self.pool.release(shard.to_nvme())
        self._cond.notify_all()

    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A pool buffer ([Note: buffers under pressure]); may release the lock while it waits."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            buffer = self.pool.try_acquire(nbytes)
            if buffer is not None:
                return buffer
            if self.cache is not None and (victim := self.cache.pop_victim()) is not None:
                self._drop(self._shards[victim])
                continue
            writing = next(
                (s for s in self._writes.values() if s.holders == 0 and s.buffer is not None and not s.completing), None
            )
            if writing is not None:
                self._complete(writing)
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self.pool.exhausted(self.timeout)
            # Woken by releases through the swapper; the slice catches `pool.release` by others.
            t0 = time.monotonic()
            self._cond.wait(0.05 if remaining is None else min(0.05, remaining))
            TIMELINE.add_wait(f"{self._label} buffer", t0, time.monotonic())
