"""`offload_param.device: nvme`: every unit's compute-dtype shard lives in the NVMe store.

[Note: parameter shards on NVMe]
The fetcher asks for shards ahead of use in the recorded order (`prefetch`): each is a read
from the store into a pool buffer, issued at once and completed by the I/O threads while the
current unit computes. `fetch` waits for the read and hands out the shard as the device layer
delivers it (host -> device on the copy-in stream; [Note: in-flight copies] in infinity.device);
the unit copies it into its own gathered buffer and `done` gives the pool buffers back once that
copy has read them (at once on the CPU), so that units kept gathered never hold pool buffers. The host cache keeps released
shards within `max_in_cpu` bytes, evicting by next use in the recorded order, so the backward
pass can find the last forward units still in memory. A shard is two extents, kind "param" for
its trainable part and "frozen" for the rest ([Note: flat layout] in unit.py): new values from
the optimizer go into a pool buffer (`update_target`) and only the trainable extent is written
back (`commit` -> evict); the frozen one is written once, at start.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from infinity.device import Device, InFlight
from infinity.offload import BufferPool, HostCache, NvmeStore, Swapper
from infinity.offload.held_writes import HeldWrites
from infinity.offload.store import default_job_id
from infinity.offload.nvme_io import MIN_BUFFERS, IOTally, elsize, make_handle, plan_count
from infinity.offload.optimizer.sizing import HOST_SHARE
from infinity.offload.protocols import ShardParts, TierUnit

KIND = "param"  # the trainable part of a shard
FROZEN = "frozen"  # the frozen part, never written after start


def _parts(unit: TierUnit) -> list[tuple[str, int]]:
    """(store kind, elements) of each non-empty part of the unit's shard, in shard order."""
    return [(kind, n) for kind, n in ((KIND, unit.train_shard_numel), (FROZEN, unit.frozen_shard_numel)) if n]


class NvmeParams:
    """The NVMe parameter tier (same methods as `ResidentParams`)."""

    def __init__(self, device: Device, offload, aio, *, rank: int, units: list[TierUnit], prefetch_numel: int = 0,
                 on_damage: Callable[[str], None] = lambda why: None):
        self.device = device
        self._units = {u.index: u for u in units}
        layout: dict[str, dict[int, int]] = {KIND: {}, FROZEN: {}}
        for u in units:
            for kind, n in _parts(u):
                layout[kind][u.index] = n * elsize(u.dtype)
        layout = {kind: sizes for kind, sizes in layout.items() if sizes}
        sizes = [n for kind_sizes in layout.values() for n in kind_sizes.values()]
        self.handle = make_handle(aio)
        self.store = NvmeStore(offload.nvme_path, layout, job_id=f"{default_job_id()}-param", rank=rank,
                               handle=self.handle, name="offload_param")
        # buffer_size counts elements in DeepSpeed's config; the pool counts bytes.
        itemsize = elsize(units[0].dtype) if units else 2
        max_in_cpu = offload.max_in_cpu * itemsize
        # Cached shards stay in pool buffers: add room for max_in_cpu worth of the largest shard.
        largest = max(sizes, default=1)
        cached = min(len(sizes), max_in_cpu // largest)
        # A fetch of a unit with frozen and trainable parts holds a buffer for each. A prefetch
        # leaves enough for a fetch that was not prefetched (or for an update's target: a unit
        # holds no buffer once gathered, and an update fetches nothing meanwhile).
        parts = max((len(_parts(u)) for u in units), default=1)
        self._spare = parts
        # A buffer larger than the largest shard would only hold unused pinned memory: the bytes
        # of buffer_count x buffer_size (what DeepSpeed pins for them) are cut into buffers of the
        # largest shard instead ([Note: the pool is a budget] in offload/optimizer/sizing.py), as many more as
        # the prefetch reads ahead (`prefetch_numel`, stage3_prefetch_bucket_size elements), so it
        # finds buffers to read into; never more than there are shards, nor a quarter of the
        # host's free memory.
        least = count = plan_count(offload.buffer_count, max(MIN_BUFFERS, 2 * parts))
        if offload.buffer_size * itemsize > largest:
            host = psutil.virtual_memory().available // HOST_SHARE
            ahead = least + prefetch_numel * itemsize // largest
            count = max(least, min(min(offload.buffer_count * offload.buffer_size * itemsize, host) // largest,
                                   len(sizes), ahead))
        self.pool = BufferPool(count + cached,
                               min(offload.buffer_size * itemsize, largest), shard_sizes=sizes, name="offload_param",
                               pin=(device.pin() or None) if offload.pin_memory else False, on_release=device.scribble)
        # The cache may also keep released shards in the pool's idle buffers: a transfer that needs
        # a buffer drops a cached shard at once ([Note: cache memory] in offload/cache.py), so this
        # costs no memory and no read, and a unit used again soon (the head at the turn from
        # forward to backward, every unit under stage3_max_reuse_distance 0) is not read again.
        self.cache = HostCache(max_in_cpu + count * min(offload.buffer_size * itemsize, largest),
                               name="offload_param")
        # A second handle for writes, so that reads never queue behind them; they may be held
        # for the backward ([Note: parameter writes held for the backward] in offload/held_writes.py).
        # A failed write of new values loses them: the run's health hears of it at once.
        self._writes = HeldWrites(make_handle(aio))
        self.swapper = Swapper(self.store, self.pool, self.cache, self.handle, self._writes,
                               on_lost=lambda kind, e: on_damage(f"a write of parameters failed ({e.strerror})"))
        self._prefetched: dict[int, list] = {}  # unit index -> FetchHandles, one per part
        self._copying: dict[int, list[InFlight]] = {}  # read, on its way to the device, not yet fetched
        self._held: dict[int, list[InFlight]] = {}  # unit index fetched -> its parts' host -> device copies
        self._returning: list[tuple[int, list[InFlight]]] = []  # done, pool buffers back once copied
        self._targets: dict[int, tuple[torch.Tensor, bool]] = {}  # unit index -> (buffer for the new values, on device)
        self._tally = IOTally(self.swapper)

    # ---- ParamTier --------------------------------------------------------------------------

    def add(self, unit: TierUnit, values: torch.Tensor) -> None:
        self._write(unit, values.to(unit.dtype))

    def _write(self, unit: TierUnit, shard: torch.Tensor) -> None:
        parts = unit.split(shard)
        for kind, part in ((KIND, parts.train), (FROZEN, parts.frozen)):
            if part.numel():
                self.swapper.wait(self.swapper.write(kind, unit.index, part.contiguous()))

    def _room(self, count: int) -> None:
        """Before taking `count` buffers in a way that may block: buffers whose device copies
        have ended go back first (only this thread gives them back, so the swapper would wait
        for them in vain)."""
        if not self.swapper.can_spare(count):
            self._return(block=True)

    def _fetch_parts(self, unit: TierUnit) -> list:
        self._room(len(_parts(unit)))
        return [self.swapper.fetch(kind, unit.index) for kind, _ in _parts(unit)]

    def prefetch(self, unit: TierUnit) -> bool:
        self._return(block=False)
        if unit.index in self._prefetched or unit.index in self._held or unit.index in self._copying:
            return False  # one read per pending use: the next use is served by the one in flight
        if not self.swapper.can_spare(len(_parts(unit)) + self._spare):
            return False
        self._prefetched[unit.index] = self._fetch_parts(unit)
        return True

    def ready(self, unit: TierUnit) -> bool:
        """A prefetched shard whose reads have finished starts its host -> device copy now, one
        unit ahead of its use ([Note: gathering one unit ahead] in fetcher.py)."""
        if unit.index in self._copying:
            return True
        handles = self._prefetched.get(unit.index)
        if handles is None or not all(self.swapper.ready(h, lend=True) for h in handles):
            return False
        self._copying[unit.index] = self._to_device(unit, self._prefetched.pop(unit.index))
        return True

    def _to_device(self, unit: TierUnit, handles: list) -> list[InFlight]:
        """The parts' host -> device copies, once their reads are waited for. If a read failed
        (it then holds nothing), the parts already read go back, and those not yet waited for."""
        copies = []
        for i, ((kind, n), handle) in enumerate(zip(_parts(unit), handles)):  # the swapper times the waits
            self.cache.advance((kind, unit.index))
            try:
                data = self.swapper.wait(handle, lend=True)  # new values still being written: copied meanwhile
            except OSError:
                for c in copies:
                    self.device.wait_host(c)
                for done_kind, _ in _parts(unit)[:i]:
                    self.swapper.release(done_kind, unit.index)
                for rest in handles[i + 1:]:
                    self.swapper.let_go(rest)
                raise
            copies.append(self.device.to_device(data.view(unit.dtype)[:n]))
        return copies

    def fetch(self, unit: TierUnit) -> ShardParts:
        assert unit.index not in self._held, unit
        copies = self._copying.pop(unit.index, None)
        if copies is None:
            copies = self._to_device(unit, self._prefetched.pop(unit.index, None) or self._fetch_parts(unit))
        self._held[unit.index] = copies
        data = iter(self.device.wait_compute(c) for c in copies)
        empty = self.device.empty(0, unit.dtype)
        return ShardParts(next(data) if unit.train_shard_numel else empty,
                          next(data) if unit.frozen_shard_numel else empty)

    def done(self, unit: TierUnit) -> None:
        if unit.index in self._held:
            self._returning.append((unit.index, self._held.pop(unit.index)))
            self._return(block=False)

    def _before_write(self, index: int) -> None:
        """Before the unit's shard is written: a read of it started ahead is dropped (its bytes
        are about to be old), and its pool buffers must be back, once the device copies that
        read them have ended (on a GPU the host learns that only by asking)."""
        for handle in self._prefetched.pop(index, ()):
            self.swapper.let_go(handle)
        if index in self._copying:
            self._returning.append((index, self._copying.pop(index)))
        mine = [(i, copies) for i, copies in self._returning if i == index]
        if mine:
            self._returning = [(i, copies) for i, copies in self._returning if i != index]
            for i, copies in mine:
                for c in copies:
                    self.device.wait_host(c)
                for kind, _ in _parts(self._units[i]):
                    self.swapper.release(kind, i)

    def _return(self, block: bool) -> None:
        """Gives back the pool buffers of fetched shards whose device copies have read them."""
        waiting = []
        for index, copies in self._returning:
            if block:
                for c in copies:
                    self.device.wait_host(c)
            elif not all(self.device.done(c) for c in copies):
                waiting.append((index, copies))
                continue
            for kind, _ in _parts(self._units[index]):
                self.swapper.release(kind, index)
        self._returning = waiting

    def drop_prefetched(self) -> None:
        while self._prefetched:
            _, handles = self._prefetched.popitem()
            for handle in handles:
                self.swapper.let_go(handle)
        self._returning.extend(self._copying.items())  # their pool buffers go back once copied
        self._copying.clear()
        self._return(block=False)

    def set_schedule(self, order: list[int]) -> None:
        self.cache.set_schedule([(kind, i) for i in order for kind, _ in _parts(self._units[i])])

    def hold_writes(self) -> None:
        self._writes.hold()

    def release_writes(self) -> None:
        self._writes.release()

    def update_target(self, unit: TierUnit, on_device: bool) -> torch.Tensor:
        self._before_write(unit.index)
        if unit.index in self._targets:  # an update that failed part way resumes into the same buffer
            target, was_on_device = self._targets[unit.index]  # ([Note: resuming an update] in offload/optimizer/nvme.py)
            assert was_on_device == on_device, unit
            return target
        if on_device:  # copied into a pool buffer at commit
            target = self.device.empty(unit.train_shard_numel, unit.dtype)
        else:
            self._room(1)
            target = self.swapper.acquire(unit.train_shard_numel * elsize(unit.dtype)).view(unit.dtype)
        self._targets[unit.index] = (target, on_device)
        return target

    def commit(self, unit: TierUnit) -> None:
        target, on_device = self._targets.pop(unit.index)
        if on_device:
            self._room(1)
            buf = self.swapper.acquire(target.numel() * target.element_size())
            self.device.wait_host(self.device.to_host(target, buf.view(unit.dtype)))
            target = buf
        self.swapper.evict(KIND, unit.index, target.view(torch.uint8))
        if self._writes.holding and not self.swapper.can_spare(self._spare + 1):
            self._writes.submit_oldest()  # its buffer is needed back soon (held_writes.py)

    def _drop_target(self, index: int) -> None:
        """Gives back the target of an update that will never be committed (it failed for good)."""
        target, on_device = self._targets.pop(index, (None, True))
        if not on_device:
            self.pool.release(target.view(torch.uint8))

    def replace(self, unit: TierUnit, shard: torch.Tensor) -> None:
        self._before_write(unit.index)
        self._drop_target(unit.index)
        self._write(unit, shard)

    def host_copy(self, unit: TierUnit) -> torch.Tensor:
        self._before_write(unit.index)
        out = torch.empty(unit.shard_numel, dtype=unit.dtype)
        start = 0
        for kind, n in _parts(unit):
            data = self.swapper.wait(self.swapper.fetch(kind, unit.index))  # a failed read holds nothing
            try:
                out[start:start + n].copy_(data.view(unit.dtype)[:n])
            finally:
                self.swapper.release(kind, unit.index)
            start += n
        return out

    def flush(self) -> None:
        self._return(block=True)
        self.swapper.flush()

    def io_stats(self) -> dict[str, float]:
        """Traffic since the last call: bytes, GB/s, and how much of the I/O time was hidden."""
        return self._tally.take()

    def close(self) -> None:
        self.drop_prefetched()
        self._returning.extend(self._held.items())
        self._held.clear()
        self._return(block=True)
        for index in list(self._targets):
            self._drop_target(index)
        try:
            self.swapper.close()  # raises a failed write nobody has met yet
        finally:
            self.store.close()  # its files go all the same
