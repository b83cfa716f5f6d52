"""`Swapper`: moves shards between their NVMe extents and host buffers, asynchronously.

[Note: shard life cycle]
Each shard the swapper has seen has one record (`_Shard`) whose `ShardState` changes only
through `to_*()` methods that assert the states they may leave:

    EMPTY, NVME, INVALID --write, evict------------------------------> HOST_TO_NVME
    NVME --fetch----------------------------------------------------> NVME_TO_HOST
    NVME_TO_HOST --read done: HOST; read failed: NVME
    HOST --last release of changed bytes, or write to a cached shard--> HOST_TO_NVME
    HOST --last release, and the cache does not keep it-------------> NVME
    HOST_TO_NVME --done: HOST if held or cached, else NVME; failed: INVALID

A HOST shard is held by its fetchers (`holders`) or, once the last one released it, kept by the
host cache; a HOST shard that is neither goes back to NVME and its buffer to the pool at once.
Changed bytes are written when the last holder releases them (write-through, so that evicting a
cached shard never waits for a write and the optimizer's writes start while it updates the next
unit); the buffer stays with the shard until the write is waited for.

[Note: transfer ordering]
What the states guarantee, and how:
  * A shard being written is never read from its old bytes: a fetch during a write waits for
    the write and keeps its buffer (no read at all); a read is only ever issued from NVME.
  * Two writes of one shard are never in flight together (the second waits for the first), so
    the last write issued is the one on disk.
  * A shard being read is handed out only by `wait`, after the read completed; a buffer under a
    transfer goes back to the pool only after the transfer was waited for.
  * A failed write makes the shard INVALID: its bytes are never read back as if they were good.
    A failed read changes nothing on disk: the shard is NVME again, its buffer back in the
    pool, and fetching it again retries.

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
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch.profiler import record_function

from infinity.tiers._messages import config_key
from infinity.tiers.cache import HostCache
from infinity.tiers.pool import BufferPool
from infinity.tiers.state import ShardState
from infinity.tiers.store import Extent, NvmeStore

ShardKey = tuple[str, Hashable]  # (kind, key): how the swapper and its cache name a shard


class IOHandle(Protocol):
    """What the swapper needs of an I/O handle (`infinity.io.AsyncIOHandle`, or a test's wrapper)."""

    def submit_read(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int: ...
    def submit_write(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int: ...
    def wait(self, request: int | None = None) -> int: ...


class Transfer(NamedTuple):
    """An NVMe transfer in flight and the memory it uses: `buffer` is neither read, changed nor
    reused before `request` was waited for."""

    buffer: torch.Tensor  # 1-D uint8: the bytes moved (whole pages of a pool buffer, or the caller's tensor)
    request: int  # the I/O handle's request id
    write: bool
    started: float  # time.monotonic() at submission


class FetchHandle(NamedTuple):
    """A fetch: `Swapper.wait` turns it into the shard's bytes once `transfer` has completed."""

    kind: str
    key: Hashable
    transfer: Transfer | None  # what the shard was waiting on at fetch time; None: already in host memory


class WriteHandle(NamedTuple):
    """A write to NVMe: `Swapper.wait` returns once it has completed, raising if it failed."""

    kind: str
    key: Hashable
    transfer: Transfer


class DirectionStats(NamedTuple):
    """Traffic in one direction between host memory and NVMe."""

    bytes: int  # of completed transfers
    count: int
    seconds: float  # submission to completion, summed over transfers (they overlap)
    wait_seconds: float  # callers blocked waiting for these transfers: the I/O not hidden
    busy_seconds: float  # wall time with a transfer of this direction in flight (see `_busy`)
    submitted_bytes: int  # of transfers issued, complete or not


class SwapStats(NamedTuple):
    nvme_to_host: DirectionStats
    host_to_nvme: DirectionStats
    hits: int  # fetches served without a read (in host memory, or a read already in flight)
    misses: int  # fetches that issued a read
    busy_seconds: float = 0.0  # wall time with any transfer in flight


_NO_STATS = DirectionStats(0, 0, 0.0, 0.0, 0.0, 0)


@dataclass(slots=True, eq=False)
class _Shard:
    """One shard as the swapper sees it ([Note: shard life cycle])."""

    kind: str
    key: Hashable
    extent: Extent
    state: ShardState = ShardState.EMPTY
    buffer: torch.Tensor | None = None  # 1-D uint8 pool buffer, whole pages: NVME_TO_HOST, HOST, HOST_TO_NVME
    transfer: Transfer | None = None  # in flight: NVME_TO_HOST, HOST_TO_NVME
    holders: int = 0  # fetches not yet released
    dirty: bool = False  # HOST: changed by a holder; written when the last holder releases it
    completing: bool = False  # a thread is waiting on `transfer` ([Note: completing transfers])
    failure: tuple[Transfer | None, OSError] | None = None  # last failed transfer (None: at submission), and why

    @property
    def name(self) -> str:
        return f"shard {self.key!r} of kind {self.kind!r}"

    def _leave(self, *allowed: ShardState) -> None:
        assert self.state in allowed, f"{self.name}: {self.state.name} -> expected one of {[s.name for s in allowed]}"

    def to_nvme_to_host(self, buffer: torch.Tensor, transfer: Transfer) -> None:
        self._leave(ShardState.NVME)
        self.state, self.buffer, self.transfer = ShardState.NVME_TO_HOST, buffer, transfer

    def to_host_to_nvme(self, transfer: Transfer, buffer: torch.Tensor | None) -> None:
        """Starts a write; `buffer` is the pool buffer it writes from (None: the caller's tensor)."""
        if self.state is ShardState.HOST:
            assert buffer is self.buffer and not self.dirty and self.holders == 0
        else:
            self._leave(ShardState.EMPTY, ShardState.NVME, ShardState.INVALID)
        self.state, self.buffer, self.transfer = ShardState.HOST_TO_NVME, buffer, transfer

    def to_host(self) -> None:
        """A read completed, or a write completed and its buffer stays with the shard."""
        self._leave(ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME)
        assert self.buffer is not None
        self.state, self.transfer = ShardState.HOST, None

    def to_nvme(self) -> torch.Tensor | None:
        """The bytes are (still) only on NVMe; returns the buffer to give back, if any."""
        if self.state is ShardState.HOST:
            assert self.holders == 0 and not self.dirty, f"{self.name} is in use or changed"
        else:
            self._leave(ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME)
        buffer = self.buffer
        self.state, self.buffer, self.transfer = ShardState.NVME, None, None
        return buffer

    def to_invalid(self) -> torch.Tensor | None:
        """A write failed (or could not even be submitted); returns its buffer to give back, if any."""
        if self.state is ShardState.HOST:
            assert self.holders == 0, f"{self.name} is in use"
        else:
            self._leave(ShardState.HOST_TO_NVME, ShardState.EMPTY, ShardState.NVME, ShardState.INVALID)
        buffer = self.buffer
        self.state, self.buffer, self.transfer, self.dirty = ShardState.INVALID, None, None, False
        return buffer


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"src: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"src: expected a contiguous CPU tensor, got one on {tensor.device} (contiguous: {tensor.is_contiguous()})"
        )
    return tensor.reshape(-1).view(torch.uint8)


class Swapper:
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
        timeout: seconds to wait for a pool buffer before giving up ([Note: buffers under pressure]).

    Thread-safe: one lock guards the shards ([Note: completing transfers]), so any thread may
    fetch, wait and release.
    Typical use: `h = fetch(kind, key)` ahead of time; `buf = wait(h)` when needed; change
    `buf` in place if wanted; `release(kind, key, dirty=True)` writes it back.
    """

    _shards: dict[ShardKey, _Shard]
    _writes: dict[ShardKey, _Shard]  # shards with a write in flight, oldest first
    _unreported: list[OSError]  # failed writes nobody has waited for ([Note: completing transfers])

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
        self.store = store
        self.pool = pool
        self.cache = cache
        self.handle: IOHandle = handle if handle is not None else store.handle
        self.write_handle: IOHandle = write_handle if write_handle is not None else self.handle
        self.read_delay_s = float(read_delay_s)
        self.timeout = timeout
        self._shards = {}
        self._writes = {}
        self._unreported = []
        self._stats = {False: _NO_STATS, True: _NO_STATS}  # write? -> traffic
        self._busy_until: dict[bool | None, float] = {False: 0.0, True: 0.0, None: 0.0}  # None: either
        self._busy_any = 0.0
        self._hits = 0
        self._misses = 0
        self._cond = threading.Condition(threading.Lock())  # guards every _Shard and the fields above

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

    def can_spare(self, count: int) -> bool:
        """Whether `count` buffers are available without waiting (`buffers_available`),
        counting those of writes the kernel has finished (`reap`)."""
        return self.buffers_available >= count or (self.reap() > 0 and self.buffers_available >= count)

    @property
    def stats(self) -> SwapStats:
        with self._cond:
            return SwapStats(self._stats[False], self._stats[True], self._hits, self._misses, self._busy_any)

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
                    self._hits += 1
                    return FetchHandle(kind, key, shard.transfer)
                buffer = self._acquire(shard.extent.capacity)
                if shard.state is not ShardState.NVME:  # changed while we waited for the buffer
                    self.pool.release(buffer)
                    continue
                try:
                    transfer = self._submit(False, buffer, shard.extent)
                except OSError as e:
                    self.pool.release(buffer)
                    raise self._transfer_error(shard, e, "read", "fetch it again to retry") from e
                shard.to_nvme_to_host(buffer, transfer)
                shard.holders, shard.failure = 1, None
                self._misses += 1
                return FetchHandle(kind, key, transfer)

    def wait(self, handle: FetchHandle | WriteHandle) -> torch.Tensor | None:
        """Blocks until the transfer of `handle` completed.

        For a FetchHandle, returns the shard's bytes: a 1-D uint8 view of a pool buffer, valid
        until the matching `release`. Raises OSError naming the shard if the transfer failed.
        """
        with self._cond:
            shard = self._shard(handle.kind, handle.key)
            if isinstance(handle, WriteHandle):
                self._wait_write(shard, handle.transfer)
                return None
            while True:
                if shard.failure is not None and handle.transfer is shard.failure[0] is not None:
                    self._raise_failure(shard)  # the read, or the write it waited on, failed
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
            if shard.holders == 0:
                raise ValueError(f"release: {shard.name} is not fetched")
            if dirty and shard.state is not ShardState.HOST:
                raise ValueError(f"release: {shard.name} cannot be dirty: it was not waited for ({shard.state.name})")
            shard.holders -= 1
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

    def reap(self) -> int:
        """Completes the writes that have finished in the kernel, so that their buffers go back
        to the pool now rather than when somebody next waits; never blocks. Returns how many.
        (A handle without `done` reaps nothing: its writes complete when waited for.)"""
        done = getattr(self.write_handle, "done", None)
        if done is None:
            return 0
        count = 0
        with self._cond:
            for shard in list(self._writes.values()):
                transfer = shard.transfer
                if shard.completing or transfer is None or not transfer.write or not done(transfer.request):
                    continue
                self._complete(shard)  # finished already: returns at once
                count += 1
        return count

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pool buffer of `nbytes`, dropping cached shards if none is free ([Note: buffers under
        pressure]); give it to `evict`, or back with `pool.release`."""
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
            in_use = self.pool.stats.bytes_in_use // self.pool.buffer_size
            assert in_use == owning + outside, f"pool: {in_use} buffers in use, shards own {owning} + {outside} outside"
            if self.cache is not None:
                assert self.cache.bytes_used == cached_bytes <= self.cache.max_bytes, "cache accounting"
                assert len(self.cache) == sum(1 for k in self._shards if k in self.cache), "cache holds unknown keys"

    # ---- the machinery (all called with the lock held) ----------------------------------------

    def _shard(self, kind: str, key: Hashable) -> _Shard:
        shard = self._shards.get((kind, key))
        if shard is None:
            shard = self._shards[(kind, key)] = _Shard(kind, key, self.store.extent(kind, key))
        return shard

    def _submit(self, write: bool, buffer: torch.Tensor, extent: Extent) -> Transfer:
        with record_function("infinity::nvme_write" if write else "infinity::nvme_read"):
            started = time.monotonic()
            submit = self.write_handle.submit_write if write else self.handle.submit_read
            request = submit(buffer, extent.path, extent.offset)
        old = self._stats[write]
        self._stats[write] = old._replace(submitted_bytes=old.submitted_bytes + buffer.numel())
        return Transfer(buffer, request, write, started)

    def _complete(self, shard: _Shard) -> None:
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
        self._cond.release()
        try:
            with record_function("infinity::nvme_wait"):
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
        finally:
            self._cond.acquire()
            shard.completing = False
            self._cond.notify_all()
        if error is None:
            now = time.monotonic()
            if not transfer.write and self.read_delay_s > 0:
                finished = max(finished, transfer.started + self.read_delay_s)
            finished = min(max(finished, transfer.started), now)
            old = self._stats[transfer.write]
            self._stats[transfer.write] = old._replace(
                bytes=old.bytes + transfer.buffer.numel(), count=old.count + 1,
                seconds=old.seconds + finished - transfer.started, wait_seconds=old.wait_seconds + now - began,
                busy_seconds=old.busy_seconds + self._busy(transfer.write, transfer.started, finished),
            )
            self._busy_any += self._busy(None, transfer.started, finished)
        if transfer.write:
            self._finish_write(shard, transfer, error)
        else:
            self._finish_read(shard, transfer, error)

    def _busy(self, direction: bool | None, start: float, end: float) -> float:
        """New wall time that the interval [start, end] adds to `direction`'s busy time.

        Transfers are counted as they complete, roughly in the order they were issued (each
        handle serves its queue in order), so the union of their intervals is kept as one
        running end: an interval adds only what lies beyond it. A transfer seen after a later
        one adds less than it might: the figure errs low, never double-counts."""
        until = self._busy_until[direction]
        self._busy_until[direction] = max(until, end)
        return max(0.0, end - max(start, until))

    def _finish_read(self, shard: _Shard, transfer: Transfer, error: OSError | None) -> None:
        if error is None:
            shard.to_host()
            return
        shard.failure = (transfer, self._transfer_error(shard, error, "read", "fetch it again to retry"))
        shard.holders = 0  # every fetch that shared this read fails with it
        self.pool.release(shard.to_nvme())
        self._cond.notify_all()

    def _finish_write(self, shard: _Shard, transfer: Transfer, error: OSError | None) -> None:
        del self._writes[(shard.kind, shard.key)]
        if error is not None:
            self._fail_write(shard, transfer, error)
        elif shard.buffer is None:  # written from the caller's tensor
            shard.to_nvme()
        else:
            shard.to_host()
            if shard.holders == 0:
                self._keep_or_drop(shard)

    def _fail_write(self, shard: _Shard, transfer: Transfer | None, error: OSError) -> OSError:
        """Marks the shard INVALID; `transfer` None: the write was refused at submission, and the
        caller raises the error at once (so it is not left for `flush`)."""
        failure = self._transfer_error(shard, error, "write", "its bytes on NVMe are invalid until it is written again")
        shard.failure = (transfer, failure)
        shard.holders = 0  # fetches that waited on this write fail with it, as with a failed read
        if transfer is not None:
            self._unreported.append(failure)
        buffer = shard.to_invalid()
        if buffer is not None:
            self.pool.release(buffer)
            self._cond.notify_all()
        return failure

    @staticmethod
    def _transfer_error(shard: _Shard, error: OSError, verb: str, consequence: str) -> OSError:
        where = f"{shard.extent.nbytes} bytes, {shard.extent.path} at offset {shard.extent.offset}"
        message = f"{verb} of {shard.name} ({where}) failed: {error.strerror}; {consequence}"
        return OSError(error.errno, message, error.filename or shard.extent.path)

    def _invalid_error(self, shard: _Shard, verb: str) -> OSError:
        cause = f" ({shard.failure[1].strerror})" if shard.failure is not None else ""
        return OSError(
            errno.EIO,
            f"{verb}: {shard.name} is invalid: its last write failed{cause}, so its bytes on NVMe cannot be "
            f"trusted; write it again to recover it",
            shard.extent.path,
        )

    def _raise_failure(self, shard: _Shard) -> None:
        assert shard.failure is not None
        failure = shard.failure[1]
        self._unreported = [e for e in self._unreported if e is not failure]  # reported now
        raise failure

    def _wait_write(self, shard: _Shard, transfer: Transfer) -> None:
        while True:
            if shard.failure is not None and shard.failure[0] is transfer is not None:
                self._raise_failure(shard)
            if shard.transfer is not transfer:
                return  # completed, successfully, before
            self._complete(shard)

    def _write_back(self, shard: _Shard) -> WriteHandle:
        """Writes a HOST shard from its own buffer (write-through, [Note: shard life cycle])."""
        try:
            transfer = self._submit(True, shard.buffer, shard.extent)
        except OSError as e:
            raise self._fail_write(shard, None, e) from e
        shard.to_host_to_nvme(transfer, shard.buffer)
        self._writes[(shard.kind, shard.key)] = shard
        return WriteHandle(shard.kind, shard.key, transfer)

    def _make_writable(self, shard: _Shard, verb: str) -> None:
        """Waits until nothing is in flight on an unheld shard, so a new write may start."""
        while True:
            if shard.holders:
                raise ValueError(f"{verb}: {shard.name} is fetched ({shard.holders} not released); release it first")
            if shard.state not in (ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME):
                return
            self._complete(shard)

    def _keep_or_drop(self, shard: _Shard) -> None:
        """An idle, clean HOST shard: kept by the cache if it admits it, else back to NVME."""
        if self.cache is not None:
            victims = self.cache.admit((shard.kind, shard.key), shard.extent.nbytes)
            if victims is not None:
                for victim in victims:
                    self._drop(self._shards[victim])
                return
        self._drop(shard)

    def _uncache(self, shard: _Shard) -> None:
        if self.cache is not None:
            self.cache.remove((shard.kind, shard.key))

    def _drop(self, shard: _Shard) -> None:
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
            self._cond.wait(0.05 if remaining is None else min(0.05, remaining))
