"""Randomized: fetch/wait/update/release/write/evict on shards of random sizes through a small
pool and a small host cache; after every step every shard's bytes are exactly what was last
written, wherever they live, the budgets hold, and the I/O handle never saw a hazard."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infinity.io import AsyncIOHandle
from infinity.offload.cache import HostCache
from infinity.offload.pool import BufferPool
from infinity.offload.state import ShardState
from infinity.offload.store import NvmeStore
from infinity.offload.swapper import Swapper


def overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


class CheckingHandle:
    """The real handle, failing on any hazard the swapper must rule out ([Note: transfer ordering]):
    a buffer under two transfers at once, two transfers on one extent at once, waiting for all."""

    def __init__(self) -> None:
        self.inner = AsyncIOHandle()
        self.inflight: dict[int, tuple[int, int, str, int]] = {}  # id -> (address, bytes, path, offset)

    def submit_read(self, buffer, path, offset=0):
        return self._submit(self.inner.submit_read, buffer, path, offset)

    def submit_write(self, buffer, path, offset=0):
        return self._submit(self.inner.submit_write, buffer, path, offset)

    def _submit(self, submit, buffer, path, offset):
        ptr, n = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        for p, m, other_path, other_offset in self.inflight.values():
            assert not overlap(ptr, n, p, m), "a buffer is under two transfers at once"
            assert other_path != path or not overlap(offset, n, other_offset, m), "two transfers on one extent at once"
        rid = submit(buffer, path, offset)
        self.inflight[rid] = (ptr, n, path, offset)
        return rid

    def wait(self, request=None):
        assert request in self.inflight, "the swapper waited for something not its own"
        try:
            return self.inner.wait(request)
        finally:
            del self.inflight[request]

    def busy(self, tensor: torch.Tensor) -> bool:
        return any(overlap(tensor.data_ptr(), tensor.numel(), p, m) for p, m, _, _ in self.inflight.values())


keys = st.integers(0, 1000)
seeds = st.integers(0, 2**31 - 1)


class SwapperMachine(RuleBasedStateMachine):
    @initialize(
        sizes=st.lists(st.integers(1, 3 * 4096 + 100), min_size=2, max_size=7),
        buffer_count=st.integers(1, 4),
        cache_bytes=st.one_of(st.none(), st.integers(0, 30000)),
    )
    def setup(self, sizes, buffer_count, cache_bytes):
        self.tmp = tempfile.mkdtemp(prefix="tiers-stateful-")
        self.sizes = dict(enumerate(sizes))
        self.handle = CheckingHandle()
        self.store = NvmeStore(self.tmp, {"param": self.sizes}, job_id="m", handle=self.handle)
        self.pool = BufferPool(buffer_count, max(sizes))
        self.cache = HostCache(cache_bytes) if cache_bytes is not None else None
        self.swapper = Swapper(self.store, self.pool, self.cache, timeout=5)
        self.expected: dict[int, torch.Tensor | None] = {k: None for k in self.sizes}
        self.held: dict[int, list] = {}  # key -> fetch handles not released
        self.waited: dict[int, torch.Tensor] = {}  # key -> the bytes a wait gave
        self.dirty: set[int] = set()  # changed in place and not yet released
        self.sources: list[torch.Tensor] = []  # tensors written from, unchanged until flushed

    def teardown(self):
        if not hasattr(self, "swapper"):
            return
        try:
            for k, handles in self.held.items():
                for _ in handles:
                    self.swapper.release("param", k, dirty=k in self.dirty)
            self.swapper.close()
            self.swapper.check_invariants()
            for k, want in self.expected.items():
                if want is not None:
                    buf = self.swapper.wait(self.swapper.fetch("param", k))
                    assert torch.equal(buf, want), f"shard {k} after close"
                    self.swapper.release("param", k)
        finally:
            self.handle.inner.close()  # nothing may still write into the directory
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def key(self, k: int) -> int:
        return k % len(self.sizes)

    def data(self, k: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (self.sizes[k],), dtype=torch.uint8, generator=gen)

    def buffer_free(self, k: int | None = None) -> bool:
        """Whether a new fetch (or acquire) can get a buffer without waiting forever."""
        return k in self.held or len(self.held) < self.pool.buffer_count

    # ---- rules ------------------------------------------------------------------------------------

    @rule(k=keys, seed=seeds, wait_now=st.booleans())
    def write(self, k, seed, wait_now):
        k = self.key(k)
        if k in self.held:
            return
        src = self.data(k, seed)
        handle = self.swapper.write("param", k, src)
        self.expected[k] = src.clone()
        if wait_now:
            self.swapper.wait(handle)
        else:
            self.sources.append(src)

    @rule(k=keys, seed=seeds)
    def evict(self, k, seed):
        k = self.key(k)
        if k in self.held or not self.buffer_free():
            return
        buf = self.swapper.acquire(self.sizes[k])
        buf.copy_(self.data(k, seed))
        self.expected[k] = buf.clone()
        self.swapper.evict("param", k, buf)

    @rule(k=keys)
    def fetch(self, k):
        k = self.key(k)
        if self.expected[k] is None or not self.buffer_free(k):
            return
        self.held.setdefault(k, []).append(self.swapper.fetch("param", k))

    @precondition(lambda self: self.held)
    @rule(k=keys)
    def wait(self, k):
        k = sorted(self.held)[k % len(self.held)]
        buf = self.swapper.wait(self.held[k][-1])
        assert not self.handle.busy(buf), "handed out while a transfer on it is in flight"
        assert torch.equal(buf, self.expected[k]), f"shard {k} read back wrong"
        self.waited[k] = buf

    @precondition(lambda self: self.waited)
    @rule(k=keys, seed=seeds)
    def update(self, k, seed):
        k = sorted(self.waited)[k % len(self.waited)]
        self.waited[k].copy_(self.data(k, seed))
        self.expected[k] = self.waited[k].clone()
        self.dirty.add(k)

    @precondition(lambda self: self.held)
    @rule(k=keys)
    def release(self, k):
        k = sorted(self.held)[k % len(self.held)]
        self.held[k].pop()
        dirty = k in self.dirty
        self.swapper.release("param", k, dirty=dirty)
        if not self.held[k]:  # the last holder: only now are changes written
            del self.held[k]
            self.waited.pop(k, None)
            self.dirty.discard(k)

    @rule()
    def flush(self):
        self.swapper.flush()
        self.sources.clear()

    @precondition(lambda self: self.cache is not None)
    @rule(order=st.permutations(range(7)))
    def schedule(self, order):
        forward = [("param", self.key(k)) for k in order]
        self.cache.set_schedule(forward + forward[::-1])

    @precondition(lambda self: self.cache is not None)
    @rule(k=keys)
    def advance(self, k):
        self.cache.advance(("param", self.key(k)))

    # ---- invariants --------------------------------------------------------------------------------

    @invariant()
    def budgets_hold(self):
        if not hasattr(self, "swapper"):
            return
        self.swapper.check_invariants()
        stats = self.pool.stats
        assert stats.bytes_in_use <= stats.peak_in_use <= stats.bytes_total
        if self.cache is not None:
            assert self.cache.bytes_used <= self.cache.peak_bytes <= self.cache.max_bytes

    @invariant()
    def every_shard_holds_what_was_last_written(self):
        if not hasattr(self, "swapper"):
            return
        for k, want in self.expected.items():
            state = self.swapper.state("param", k)
            if want is None:
                assert state is ShardState.EMPTY
                continue
            shard = self.swapper._shards[("param", k)]  # white box: look at the buffer in place
            if shard.buffer is not None and state in (ShardState.HOST, ShardState.HOST_TO_NVME):
                assert torch.equal(shard.buffer[: self.sizes[k]], want), f"shard {k}: host copy ({state.name})"
            on_disk = state in (ShardState.NVME, ShardState.NVME_TO_HOST) or (
                state is ShardState.HOST and k not in self.dirty
            )
            if on_disk:
                extent = self.store.extent("param", k)
                with open(extent.path, "rb") as f:
                    disk = os.pread(f.fileno(), extent.nbytes, extent.offset)
                assert disk == want.numpy().tobytes(), f"shard {k}: NVMe copy ({state.name})"


SwapperMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_swapper_keeps_every_shard_intact = SwapperMachine.TestCase
