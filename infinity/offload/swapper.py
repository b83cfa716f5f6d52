"""`Swapper`: moves shards between their NVMe extents and host buffers, asynchronously.

Each shard is a `Shard` record (shard.py) whose state the swapper moves on ([Note: shard life
cycle] in shard.py); what it moved is counted in a `SwapCounters` (stats.py). The records, the
transfers in flight on them and the lock are `ShardTransfers`' (transfers.py), whose steps the
operations here are made of.

[Note: transfer ordering]
What the states guarantee, and how:
  * A shard being written is never read from its old bytes: a fetch during a write waits for
    the write and keeps its buffer (no read at all); a read is only ever issued from NVME.
  * Two writes of one shard are never in flight together (the second waits for the first), so
    the last write issued is the one on disk.
  * A shard being read is handed out only by `wait`, after the read completed; a buffer under a
    transfer goes back to the pool only after the transfer was waited for.
  * A failed write makes the shard INVALID: its bytes are never read back as if they were good,
    and `lost()` names it until a write of it succeeds (new bytes replace the lost ones, so its
    failure is then no longer one for `flush` to raise). A failed read changes nothing on disk:
    the shard is NVME again, its buffer back in the pool, and fetching it again retries.

[Note: lending bytes under a write]
A holder that only reads the bytes (the parameter tier copying a unit's new values to the
device) may take them while their write is still in flight: `wait(handle, lend=True)` hands out
the buffer at once instead of waiting for the write, as the bytes in memory are the newest and
both the disk and the holder only read them. If that write then fails, the shard is INVALID as
usual, but its buffer stays out of the pool ("parked") until every lent holder has released it,
so it is never reused under a reader; their releases end those loans without raising. A holder
that changes the bytes in place must not borrow them (the write would read torn bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable

import torch

from infinity.offload._messages import config_key
from infinity.offload.cache import HostCache
from infinity.offload.pool import BufferPool
from infinity.offload.shard import FetchHandle, ShardKey, Transfer, WriteHandle
from infinity.offload.state import ShardState
from infinity.offload.stats import DirectionStats, SwapStats
from infinity.offload.store import NvmeStore
from infinity.offload.transfers import READ_RETRY, IOHandle, ShardTransfers

# The handles (shard.py), the stats (stats.py) and IOHandle (transfers.py) stay importable from
# here, where they were defined before.
__all__ = [
    "DirectionStats",
    "FetchHandle",
    "IOHandle",
    "ShardKey",
    "SwapStats",
    "Swapper",
    "Transfer",
    "WriteHandle",
]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"src: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"src: expected a contiguous CPU tensor, got one on {tensor.device} (contiguous: {tensor.is_contiguous()})"
        )
    return tensor.reshape(-1).view(torch.uint8)


class Swapper(ShardTransfers):
    """Moves the shards of one store between NVMe and the buffers of one pool.

    Args:
        store: where the shards live on NVMe.
        pool: the host buffers transfers go through (sized for the store's largest shard).
        cache: keeps idle shards in host memory ([Note: eviction policy] in cache.py); its keys
            are `(kind, key)` pairs. None keeps nothing.
        handle: the I/O handle; default: the store's.
        write_handle: a second handle for writes; default: `handle`. Each handle serves its
            requests in order, so with one handle a read the compute thread waits for can sit
            behind writes nobody waits for; with two, reads never queue behind writes.
        read_delay_s: test hook: every read completes no sooner than this many seconds after it
            was issued (a slow disk, without blocking the caller that issued it).
        timeout: seconds to wait for a pool buffer before giving up ([Note: buffers under pressure]
            in transfers.py).

    Thread-safe: one lock guards the shards ([Note: completing transfers] in transfers.py), so
    any thread may fetch, wait and release.
    Typical use: `h = fetch(kind, key)` ahead of time; `buf = wait(h)` when needed; change
    `buf` in place if wanted; `release(kind, key, dirty=True)` writes it back.
    """

    def __init__(
        self,
        store: NvmeStore,
        pool: BufferPool,
        cache: HostCache | None = None,
        handle: IOHandle | None = None,
        write_handle: IOHandle | None = None,
        *,
        read_delay_s: float = 0.0,
        timeout: float | None = 60.0,
        on_lost: Callable[[str, OSError], None] | None = None,
    ) -> None:
        if not isinstance(store, NvmeStore):
            raise TypeError(f"store: expected an NvmeStore, got {type(store).__name__}")
        if not isinstance(pool, BufferPool):
            raise TypeError(f"pool: expected a BufferPool, got {type(pool).__name__}")
        if cache is not None and not isinstance(cache, HostCache):
            raise TypeError(f"cache: expected a HostCache or None, got {type(cache).__name__}")
        largest = max(store.extent(kind, key).nbytes for kind in store.kinds for key in store.keys(kind))
        if largest > pool.buffer_size:
            raise ValueError(
                f"{config_key(pool.name, 'buffer_size')}: the store's largest shard has {largest} bytes, more than "
                f"a {pool.buffer_size}-byte buffer; give the pool the shard sizes (shard_sizes) so it is sized for them"
            )
        handle = handle if handle is not None else store.handle
        super().__init__(store, pool, cache, handle, write_handle if write_handle is not None else handle,
                         float(read_delay_s), timeout)
        self.on_lost = on_lost  # `on_lost(kind, error)` for each write that leaves a shard INVALID
        self._reaped_at: int | None = None  # the write handle's finished_count at the last scan (`reap`)

    # ---- queries -----------------------------------------------------------------------------

    def state(self, kind: str, key: Hashable) -> ShardState:
        with self._cond:
            return self._shard(kind, key).state

    @property
    def buffers_available(self) -> int:
        """Pool buffers a fetch gets without waiting: the free ones plus those of cached shards
        (dropped at once when needed). Decide whether to prefetch by this, not `pool.num_free`,
        which counts the cache's buffers as taken."""
        with self._cond:
            return self.pool.num_free + (len(self.cache) if self.cache is not None else 0)

    def can_spare(self, count: int, nbytes: int | None = None) -> bool:
        """Whether `count` buffers are available without waiting (`buffers_available`; with
        `nbytes`, free ones of the class that serves it: [Note: two sizes of buffer] in pool.py),
        counting those of writes the kernel has finished (`reap`)."""
        def available() -> int:
            return self.buffers_available if nbytes is None else self.pool.free_for(nbytes)
        return available() >= count or (self.reap() > 0 and available() >= count)

    def lost(self, kinds: Collection[str] | None = None) -> OSError | None:
        """Why the bytes of a shard (of one of `kinds`; None: any) are lost: the failure of the
        oldest write that left a shard INVALID and was not followed by a successful one; None
        when there is none. Reported or not, a lost write stays lost until rewritten."""
        with self._cond:
            return next((e for (kind, _), e in self._lost.items() if kinds is None or kind in kinds), None)

    @property
    def stats(self) -> SwapStats:
        with self._cond:
            return self._counters.snapshot()

    # ---- NVMe -> host ------------------------------------------------------------------------

    def fetch(self, kind: str, key: Hashable) -> FetchHandle:
        """Starts bringing a shard into host memory; `wait` on the handle gives its bytes.

        Each fetch must be paired with a `release`, unless the transfer it waits on failed (its
        `wait` raises): a failed fetch holds nothing. Raises ValueError for a shard never
        written and OSError for one whose last write failed.
        """
        with self._cond:
            shard = self._shard(kind, key)
            while True:
                state = shard.state
                if state is ShardState.EMPTY:
                    raise ValueError(f"fetch: {shard.name} was never written, so it has no bytes to read")
                if state is ShardState.INVALID:
                    raise self._invalid_error(shard, "fetch")
                if state is ShardState.HOST_TO_NVME and shard.buffer is None:
                    self._complete(shard)  # written from the caller's tensor: read it back once written
                    continue
                if state is not ShardState.NVME:  # HOST, NVME_TO_HOST, or a write from a pool buffer
                    if shard.holders == 0:
                        self._uncache(shard)
                    shard.holders += 1
                    self._counters.hits += 1
                    return FetchHandle(kind, key, shard.transfer)
                buffer = self._acquire(shard.extent.capacity)
                if shard.state is not ShardState.NVME:  # changed while we waited for the buffer
                    self.pool.release(buffer)
                    continue
                try:
                    transfer = self._submit(False, buffer, shard.extent)
                except OSError as e:
                    self.pool.release(buffer)
                    raise self._transfer_error(shard, e, "read", READ_RETRY) from e
                shard.to_nvme_to_host(buffer, transfer)
                shard.holders, shard.failure = 1, None
                self._counters.misses += 1
                return FetchHandle(kind, key, transfer)

    def wait(self, handle: FetchHandle | WriteHandle, lend: bool = False) -> torch.Tensor | None:
        """Blocks until the transfer of `handle` completed.

        For a FetchHandle, returns the shard's bytes: a 1-D uint8 view of a pool buffer, valid
        until the matching `release`. Raises OSError naming the shard if the transfer failed.
        `lend`: the caller only reads the bytes, which may then be handed out while their write
        is still in flight ([Note: lending bytes under a write]).
        """
        with self._cond:
            shard = self._shard(handle.kind, handle.key)
            if isinstance(handle, WriteHandle):
                self._wait_write(shard, handle.transfer)
                return None
            while True:
                if shard.failure is not None and handle.transfer is shard.failure[0] is not None:
                    self._raise_failure(shard)  # the read, or the write it waited on, failed
                if lend and shard.lendable:
                    shard.lent += 1
                    return shard.buffer[: shard.extent.nbytes]
                if shard.state in (ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME):
                    self._complete(shard)
                elif shard.state is ShardState.HOST and shard.holders > 0:
                    return shard.buffer[: shard.extent.nbytes]
                elif shard.state is ShardState.INVALID:
                    raise self._invalid_error(shard, "wait")
                else:
                    raise ValueError(f"wait: {shard.name} is not fetched (released already, or never fetched)")

    def release(self, kind: str, key: Hashable, dirty: bool = False) -> WriteHandle | None:
        """Ends one fetch. `dirty=True` says its bytes were changed in place: they are written to
        NVMe when the last holder releases the shard, and the handle of that write is returned."""
        with self._cond:
            shard = self._shard(kind, key)
            if shard.holders == 0 and (kind, key) in self._parked:  # a loan whose write failed meanwhile
                buffer, loans = self._parked[(kind, key)]
                if loans > 1:
                    self._parked[(kind, key)] = (buffer, loans - 1)
                else:
                    del self._parked[(kind, key)]
                    self.pool.release(buffer)
                    self._cond.notify_all()
                return None
            if shard.holders == 0:
                raise ValueError(f"release: {shard.name} is not fetched")
            if dirty and shard.state is not ShardState.HOST:
                raise ValueError(f"release: {shard.name} cannot be dirty: it was not waited for ({shard.state.name})")
            shard.holders -= 1
            shard.lent = min(shard.lent, shard.holders)
            shard.dirty |= dirty
            if shard.holders > 0:
                return None
            if shard.state is ShardState.NVME_TO_HOST:
                # Nobody wants these bytes any more, but the buffer is the read's until it ends;
                # a failure here changes nothing on disk, so it is left for a later fetch to meet.
                self._complete(shard)
            if shard.state is not ShardState.HOST or shard.holders > 0:
                return None  # the read failed, a write is still in flight, or it was fetched again
            if shard.dirty:
                shard.dirty = False
                return self._write_back(shard)
            self._keep_or_drop(shard)
            return None

    def let_go(self, handle: FetchHandle) -> None:
        """Ends a fetch that was never waited for, such as a read ahead that is not needed
        after all: like `release`, except that a fetch whose transfer has failed meanwhile
        holds nothing, so nothing is released for it."""
        with self._cond:
            shard = self._shard(handle.kind, handle.key)
            failed = shard.failure is not None and handle.transfer is not None and handle.transfer is shard.failure[0]
            if failed and shard.holders == 0:
                return
        self.release(handle.kind, handle.key)

    # ---- host -> NVMe ------------------------------------------------------------------------

    def evict(self, kind: str, key: Hashable, buffer: torch.Tensor) -> WriteHandle:
        """Writes `buffer`, a pool buffer holding the shard's new bytes, to NVMe and takes it over:
        once written it stays in the host cache or goes back to the pool; do not release it."""
        with self._cond:
            shard = self._shard(kind, key)
            if not isinstance(buffer, torch.Tensor) or not self.pool.owns(buffer):
                raise ValueError(f"evict: the buffer for {shard.name} must come from the pool (Swapper.acquire)")
            nbytes = buffer.numel() * buffer.element_size()
            if nbytes != shard.extent.nbytes:
                raise ValueError(f"evict: {shard.name} has {shard.extent.nbytes} bytes, the buffer {nbytes}")
            self._make_writable(shard, "evict")
            if shard.state is ShardState.HOST:  # cached: its old bytes and buffer make way
                self._uncache(shard)
                self._drop(shard)
            padded = self.pool.base(buffer)[: shard.extent.capacity]
            try:
                transfer = self._submit(True, padded, shard.extent)
            except OSError as e:
                self.pool.release(padded)  # it is ours now
                raise self._fail_write(shard, None, e) from e
            shard.to_host_to_nvme(transfer, padded)
            self._writes[(kind, key)] = shard
            return WriteHandle(kind, key, transfer)

    def write(self, kind: str, key: Hashable, src: torch.Tensor) -> WriteHandle:
        """Writes the bytes of `src`, any contiguous CPU tensor of the shard's size, to NVMe.

        A shard kept in the host cache is updated there and written from its buffer; otherwise
        the write goes straight from `src`, which must then not change until the write is
        waited for (`wait` on the handle, or `flush`).
        """
        data = _as_bytes(src)
        with self._cond:
            shard = self._shard(kind, key)
            if data.numel() != shard.extent.nbytes:
                raise ValueError(f"write: {shard.name} has {shard.extent.nbytes} bytes, src {data.numel()}")
            self._make_writable(shard, "write")
            if shard.state is ShardState.HOST:  # cached: keep it, with the new bytes
                self._uncache(shard)
                shard.buffer[: data.numel()].copy_(data)
                return self._write_back(shard)
            try:
                transfer = self._submit(True, data, shard.extent)
            except OSError as e:
                raise self._fail_write(shard, None, e) from e
            shard.to_host_to_nvme(transfer, None)
            self._writes[(kind, key)] = shard
            return WriteHandle(kind, key, transfer)

    def flush(self) -> None:
        """Waits for every write in flight; raises the first failure nobody has waited for yet."""
        with self._cond:
            while self._writes:
                self._complete(next(iter(self._writes.values())))
            if self._unreported:
                first, count = self._unreported[0], len(self._unreported)
                self._unreported.clear()
                if count > 1:
                    raise OSError(first.errno, f"{first.strerror} (and {count - 1} more failed writes)", first.filename)
                raise first

    def ready(self, handle: FetchHandle, lend: bool = False) -> bool:
        """Whether `wait(handle, lend)` would return at once (its read has finished, or there was
        none to do); never blocks. A handle without `done` is never ready before its wait."""
        with self._cond:
            shard = self._shard(handle.kind, handle.key)
            if shard.state is ShardState.HOST or (lend and shard.lendable):
                return True
            transfer = shard.transfer
            if shard.state is not ShardState.NVME_TO_HOST or transfer is None or shard.completing:
                return False
            done = getattr(self.handle, "done", None)
            return done is not None and done(transfer.request)

    def reap(self) -> int:
        """Completes the writes that have finished in the kernel, so that their buffers go back
        to the pool now rather than when somebody next waits; never blocks. Returns how many.
        (A handle without `done` reaps nothing: its writes complete when waited for.)"""
        done = getattr(self.write_handle, "done", None)
        if done is None:
            return 0
        finished = getattr(self.write_handle, "finished_count", None)
        count = 0
        with self._cond:
            # Nothing completed since the last scan, nothing to reap: the pipeline asks before
            # every read ahead, with tens of writes in flight. Counted before the scan, so a write
            # that finishes during it is seen by the next call.
            seen = finished() if finished is not None else None
            if seen is not None and seen == self._reaped_at:
                return 0
            skipped = False  # a write another thread is completing: looked at again next time
            for shard in list(self._writes.values()):
                transfer = shard.transfer
                skipped |= shard.completing
                if shard.completing or transfer is None or not transfer.write or not done(transfer.request):
                    continue
                self._complete(shard)  # finished already: returns at once
                count += 1
            self._reaped_at = None if skipped else seen
        return count

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pool buffer of `nbytes`, dropping cached shards if none is free ([Note: buffers under
        pressure] in transfers.py); give it to `evict`, or back with `pool.release`."""
        with self._cond:
            return self._acquire(nbytes)[:nbytes]

    def close(self) -> None:
        """Waits for every transfer, then gives the buffers of cached shards back to the pool.

        Raises like `flush`. Shards still fetched keep their buffers.
        """
        with self._cond:
            for shard in list(self._shards.values()):
                if shard.state is ShardState.NVME_TO_HOST:
                    self._complete(shard)
            while self._writes:  # before emptying the cache: a finished write may enter it
                self._complete(next(iter(self._writes.values())))
            if self.cache is not None:
                while (victim := self.cache.pop_victim()) is not None:
                    self._drop(self._shards[victim])
        self.flush()

