"""`offload_param.device: nvme`: every unit's compute-dtype shard lives in the NVMe store.

[Note: parameter shards on NVMe]
The fetcher asks for shards ahead of use in the recorded order (`prefetch`): each is a read
from the store into a pool buffer, issued at once and completed by the I/O threads while the
current unit computes. `fetch` waits for the read and copies the shard to the device (on the
CPU, into a fresh tensor), so that units kept gathered never hold pool buffers; with a GPU the
pool buffer goes back once the host-to-device copy has read it (`done`), never under it. The host cache keeps released shards within
`max_in_cpu` bytes, evicting by next use in the recorded order, so the backward pass can
find the last forward units still in memory. New values from the optimizer go into a pool
buffer (`update_target`) and are written back without another pass (`commit` -> evict).
"""

from __future__ import annotations

import warnings

import torch

from infinity.io import AsyncIOHandle
from infinity.tiers import BufferPool, HostCache, NvmeStore, Swapper
from infinity.tiers.store import default_job_id
from infinity.zero.unit import Unit

KIND = "param"
MIN_BUFFERS = 3  # the unit computing, the next one being read, and one for an update


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _plan_count(count: int, minimum: int = MIN_BUFFERS, name: str = "offload_param") -> int:
    if count >= minimum:
        return count
    warnings.warn(f"zero_optimization.{name}.buffer_count: raised from {count} to {minimum}, the fewest "
                  "that keep reads, compute and writes going at once", UserWarning, stacklevel=3)
    return minimum


def make_handle(aio) -> AsyncIOHandle:
    """The I/O handle an `aio` config section describes."""
    return AsyncIOHandle(block_size=aio.block_size, queue_depth=aio.queue_depth, thread_count=aio.thread_count,
                         single_submit=aio.single_submit, overlap_events=aio.overlap_events, engine=aio.engine)


class NvmeParams:
    """The NVMe parameter tier (same methods as `ResidentParams`)."""

    def __init__(self, device: torch.device, offload, aio, *, rank: int, units: list[Unit]):
        self.device = device
        self._units = {u.index: u for u in units}
        sizes = {u.index: u.shard_numel * _elsize(u.dtype) for u in units}
        self.handle = make_handle(aio)
        self.store = NvmeStore(offload.nvme_path, {KIND: sizes}, job_id=f"{default_job_id()}-param", rank=rank,
                               handle=self.handle, name="offload_param")
        # buffer_size counts elements in DeepSpeed's config; the pool counts bytes.
        elsize = _elsize(units[0].dtype) if units else 2
        max_in_cpu = offload.max_in_cpu * elsize
        # Cached shards stay in pool buffers: add room for max_in_cpu worth of the largest shard.
        largest = max(sizes.values(), default=1)
        cached = min(len(sizes), max_in_cpu // largest)
        # A buffer larger than the largest shard would only hold unused pinned memory.
        self.pool = BufferPool(_plan_count(offload.buffer_count) + cached, min(offload.buffer_size * elsize, largest),
                               shard_sizes=sizes.values(), name="offload_param")
        self.cache = HostCache(max_in_cpu, name="offload_param")
        # A second handle for writes, so that reads never queue behind them.
        self.swapper = Swapper(self.store, self.pool, self.cache, self.handle, make_handle(aio))
        self._prefetched: dict[int, object] = {}  # unit index -> FetchHandle
        self._held: dict[int, object] = {}  # unit index fetched -> its host-to-device copy's event (None on CPU)
        self._targets: dict[int, torch.Tensor] = {}  # unit index -> pool buffer for the new values
        self._tally = IOTally(self.swapper)

    # ---- ParamTier --------------------------------------------------------------------------

    def add(self, unit: Unit, values: torch.Tensor) -> None:
        shard = values.to(unit.dtype)
        self.swapper.wait(self.swapper.write(KIND, unit.index, shard))

    def prefetch(self, unit: Unit) -> bool:
        if unit.index in self._prefetched or unit.index in self._held:
            return False  # one read per pending use: the next use is served by the one in flight
        if not self.swapper.can_spare(2):  # leave one for an update (the computing unit holds its own)
            return False
        self._prefetched[unit.index] = self.swapper.fetch(KIND, unit.index)
        return True

    def fetch(self, unit: Unit) -> torch.Tensor:
        assert unit.index not in self._held, unit
        handle = self._prefetched.pop(unit.index, None) or self.swapper.fetch(KIND, unit.index)
        if self.cache is not None:
            self.cache.advance((KIND, unit.index))
        with torch.profiler.record_function("infinity::nvme_wait"):
            data = self.swapper.wait(handle).view(unit.dtype)[:unit.shard_numel]
        if self.device.type == "cpu":
            # A copy, not a view: a unit kept gathered (reuse distance, live budget) must not
            # hold a pool buffer, or a pool smaller than the model would run dry.
            with torch.profiler.record_function("infinity::h2d"):
                on_device = data.clone()
            self.swapper.release(KIND, unit.index)
            return on_device
        with torch.profiler.record_function("infinity::h2d"):
            on_device = data.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._held[unit.index] = copied
        return on_device

    def done(self, unit: Unit) -> None:
        if unit.index in self._held:
            copied = self._held.pop(unit.index)
            if copied is not None:
                copied.synchronize()  # the pool buffer goes back only once the copy has read it
            self.swapper.release(KIND, unit.index)

    def drop_prefetched(self) -> None:
        for index in list(self._prefetched):
            self.swapper.release(KIND, index)
        self._prefetched.clear()

    def set_schedule(self, order: list[int]) -> None:
        self.cache.set_schedule([(KIND, i) for i in order])

    def update_target(self, unit: Unit) -> torch.Tensor:
        nbytes = unit.shard_numel * torch.empty((), dtype=unit.dtype).element_size()
        buf = self.swapper.acquire(nbytes)
        self._targets[unit.index] = buf
        return buf.view(unit.dtype)

    def commit(self, unit: Unit) -> None:
        self.swapper.evict(KIND, unit.index, self._targets.pop(unit.index))

    def host_copy(self, unit: Unit) -> torch.Tensor:
        handle = self.swapper.fetch(KIND, unit.index)
        try:
            return self.swapper.wait(handle).view(unit.dtype)[:unit.shard_numel].clone()
        finally:
            self.swapper.release(KIND, unit.index)

    def flush(self) -> None:
        self.swapper.flush()

    def io_stats(self) -> dict[str, float]:
        """Traffic since the last call: bytes, GB/s, and how much of the I/O time was hidden."""
        return self._tally.take()

    def close(self) -> None:
        self.drop_prefetched()
        for index in list(self._held):
            self.swapper.release(KIND, index)
        self._held.clear()
        self.swapper.close()
        self.store.close()


class IOTally:
    """A swapper's traffic since the last `take()`, for the per-step report."""

    def __init__(self, swapper: Swapper):
        self._swapper = swapper
        self._mark = swapper.stats

    def take(self) -> dict[str, float]:
        now = self._swapper.stats
        before, self._mark = self._mark, now
        return io_delta("nvme", now, before)


def io_delta(prefix: str, now, before) -> dict[str, float]:
    """The report's figures for one tier between two `Swapper.stats` snapshots: bytes issued in
    each direction, GB/s over the wall time that direction had transfers in flight, seconds the
    compute thread waited, and the overlap fraction: 1 - waited / wall time with any I/O in flight."""
    read_b = now.nvme_to_host.submitted_bytes - before.nvme_to_host.submitted_bytes
    write_b = now.host_to_nvme.submitted_bytes - before.host_to_nvme.submitted_bytes
    done_r = now.nvme_to_host.bytes - before.nvme_to_host.bytes
    done_w = now.host_to_nvme.bytes - before.host_to_nvme.bytes
    busy_r = now.nvme_to_host.busy_seconds - before.nvme_to_host.busy_seconds
    busy_w = now.host_to_nvme.busy_seconds - before.host_to_nvme.busy_seconds
    busy = now.busy_seconds - before.busy_seconds
    waited = (now.nvme_to_host.wait_seconds - before.nvme_to_host.wait_seconds
              + now.host_to_nvme.wait_seconds - before.host_to_nvme.wait_seconds)
    return {
        f"{prefix}_read_bytes": read_b, f"{prefix}_write_bytes": write_b,
        f"{prefix}_read_gbps": done_r / busy_r / 1e9 if busy_r else 0.0,
        f"{prefix}_write_gbps": done_w / busy_w / 1e9 if busy_w else 0.0,
        f"{prefix}_io_seconds": busy, f"{prefix}_wait_seconds": waited,
        "overlap_fraction": max(0.0, 1.0 - waited / busy) if busy else 1.0,
    }
