"""Swapper: moving shards between NVMe and pool buffers; ordering, caching, pressure, threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from infinity.io import AsyncIOHandle
from infinity.offload.cache import HostCache
from infinity.offload.pool import BufferPool
from infinity.offload.state import ShardState
from infinity.offload.store import NvmeStore
from infinity.offload.swapper import Swapper

SIZES = {0: 5000, 1: 12288, 2: 1, 3: 9000}


class RecordingHandle:
    """A real handle that logs what the swapper asks of it, in order."""

    def __init__(self) -> None:
        self.inner = AsyncIOHandle()
        self.log: list[tuple[str, int]] = []

    def submit_read(self, buffer, path, offset=0):
        rid = self.inner.submit_read(buffer, path, offset)
        self.log.append(("read", rid))
        return rid

    def submit_write(self, buffer, path, offset=0):
        rid = self.inner.submit_write(buffer, path, offset)
        self.log.append(("write", rid))
        return rid

    def wait(self, request=None):
        assert request is not None, "the swapper must only wait for its own requests"
        self.log.append(("wait", request))
        return self.inner.wait(request)


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path, {"param": SIZES, "master": {0: 64}}, job_id="t") as s:
        yield s


def make(store, buffer_count=3, cache_bytes=None, buffer_size=12288, **kwargs):
    pool = BufferPool(buffer_count, buffer_size, shard_sizes=SIZES.values())
    cache = HostCache(cache_bytes) if cache_bytes is not None else None
    return Swapper(store, pool, cache, timeout=10, **kwargs)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fill(swapper: Swapper, seed: int = 0) -> dict[int, torch.Tensor]:
    data = {k: random_bytes(n, seed + k) for k, n in SIZES.items()}
    for k, d in data.items():
        swapper.write("param", k, d)
    swapper.flush()
    return data


def read(swapper: Swapper, key, kind="param") -> torch.Tensor:
    buf = swapper.wait(swapper.fetch(kind, key))
    out = buf.clone()
    swapper.release(kind, key)
    return out


def test_round_trip_and_in_place_update(store):
    with pytest.warns(UserWarning, match="buffer_size: raised from 4096 to 12288"):
        swapper = make(store, buffer_size=4096)
    data = fill(swapper)
    assert all(swapper.state("param", k) is ShardState.NVME for k in SIZES)
    for k in SIZES:
        handle = swapper.fetch("param", k)
        assert swapper.state("param", k) is ShardState.NVME_TO_HOST
        buf = swapper.wait(handle)
        assert swapper.state("param", k) is ShardState.HOST and torch.equal(buf, data[k])
        buf.add_(1)
        data[k] = buf.clone()
        write = swapper.release("param", k, dirty=True)
        assert swapper.state("param", k) is ShardState.HOST_TO_NVME
        swapper.wait(write)
        assert swapper.state("param", k) is ShardState.NVME
        swapper.check_invariants()
    for k in SIZES:
        assert torch.equal(read(swapper, k), data[k])
    stats = swapper.stats
    assert stats.nvme_to_host.count == 8 and stats.host_to_nvme.count == 8 and stats.misses == 8
    assert stats.nvme_to_host.bytes == 2 * (8192 + 12288 + 4096 + 12288)  # whole pages move
    assert stats.host_to_nvme.seconds > 0 and stats.nvme_to_host.wait_seconds > 0


def test_a_pool_too_small_for_the_store_is_refused(store):
    with pytest.raises(ValueError, match=r"offload_param\.buffer_size: the store's largest shard has 12288 bytes"):
        Swapper(store, BufferPool(2, 4096))


def test_any_dtype_is_written_and_read_back(store):
    swapper = make(store)
    src = torch.arange(16, dtype=torch.float32)
    swapper.wait(swapper.write("master", 0, src))
    assert torch.equal(read(swapper, 0, "master").view(torch.float32), src)
    with pytest.raises(ValueError, match="has 64 bytes, src 32"):
        swapper.write("master", 0, src[:8])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        swapper.write("master", 0, torch.zeros(32, dtype=torch.float32)[::2])


def test_usage_errors(store):
    swapper = make(store)
    with pytest.raises(ValueError, match="never written"):
        swapper.fetch("param", 0)
    with pytest.raises(KeyError):
        swapper.fetch("param", 99)
    fill(swapper)
    with pytest.raises(ValueError, match="is not fetched"):
        swapper.release("param", 0)
    handle = swapper.fetch("param", 0)
    with pytest.raises(ValueError, match="cannot be dirty: it was not waited for"):
        swapper.release("param", 0, dirty=True)
    with pytest.raises(ValueError, match="is fetched"):
        swapper.write("param", 0, torch.zeros(5000, dtype=torch.uint8))
    swapper.wait(handle)
    swapper.release("param", 0)
    with pytest.raises(ValueError, match="not fetched"):
        swapper.wait(handle)  # released: its buffer is gone
    with pytest.raises(ValueError, match="must come from the pool"):
        swapper.evict("param", 2, torch.zeros(1, dtype=torch.uint8))
    buf = swapper.acquire(3)
    with pytest.raises(ValueError, match="has 1 bytes, the buffer 3"):
        swapper.evict("param", 2, buf)
    swapper.pool.release(buf)
    swapper.check_invariants()


def test_shared_fetches_and_release_before_wait(store):
    swapper = make(store)
    data = fill(swapper)
    first, second = swapper.fetch("param", 1), swapper.fetch("param", 1)
    assert first.transfer is second.transfer  # one read for both
    assert torch.equal(swapper.wait(second), data[1])
    swapper.release("param", 1)
    assert swapper.state("param", 1) is ShardState.HOST  # still held by the first fetch
    swapper.release("param", 1)
    swapper.fetch("param", 3)
    swapper.release("param", 3)  # never waited: the read is finished, then the buffer freed
    assert swapper.state("param", 3) is ShardState.NVME
    swapper.check_invariants()
    assert swapper.stats.hits == 1 and swapper.stats.misses == 2


def changed_and_being_written(store, value: int):
    """A swapper whose shard ("param", 0) was changed to `value` and is being written back."""
    handle = RecordingHandle()
    swapper = make(store, handle=handle)
    fill(swapper)
    swapper.wait(swapper.fetch("param", 0)).fill_(value)
    write = swapper.release("param", 0, dirty=True)
    return handle, swapper, write


def test_fetch_during_a_write_reads_nothing_and_sees_the_new_bytes(store):
    handle, swapper, _ = changed_and_being_written(store, 7)
    reads = sum(1 for op, _ in handle.log if op == "read")
    again = swapper.fetch("param", 0)  # while the write is in flight
    assert swapper.state("param", 0) is ShardState.HOST_TO_NVME
    assert bool((swapper.wait(again) == 7).all())
    assert swapper.state("param", 0) is ShardState.HOST
    assert sum(1 for op, _ in handle.log if op == "read") == reads
    swapper.release("param", 0)
    swapper.check_invariants()


def test_a_reader_may_borrow_new_bytes_while_their_write_is_in_flight(store):
    handle, swapper, write = changed_and_being_written(store, 9)
    log = len(handle.log)
    again = swapper.fetch("param", 0)
    assert swapper.ready(again, lend=True) and not swapper.ready(again)
    lent = swapper.wait(again, lend=True)
    assert handle.log[log:] == []  # neither a read nor a wait for the write
    assert swapper.state("param", 0) is ShardState.HOST_TO_NVME
    assert bool((lent == 9).all())
    swapper.check_invariants()
    swapper.release("param", 0)
    swapper.wait(write)
    assert swapper.state("param", 0) is ShardState.NVME  # no cache: the buffer went back once written
    assert swapper.pool.num_free == 3
    assert bool((read(swapper, 0) == 9).all())  # and the disk has the new bytes
    swapper.check_invariants()


def test_a_second_write_waits_for_the_first(store):
    handle = RecordingHandle()
    swapper = make(store, handle=handle)
    a, b = random_bytes(5000, 1), random_bytes(5000, 2)
    first = swapper.write("param", 0, a)
    swapper.write("param", 0, b)
    (op1, r1), (op2, r2), (op3, r3) = handle.log
    assert (op1, op2, op3) == ("write", "wait", "write") and r2 == r1 == first.transfer.request
    swapper.flush()
    assert torch.equal(read(swapper, 0), b)


def test_the_cache_saves_reads(store):
    swapper = make(store, cache_bytes=5000 + 12288)
    data = fill(swapper)
    for k in (0, 1):
        read(swapper, k)
    assert swapper.state("param", 0) is ShardState.HOST and swapper.cache.bytes_used == 17288
    assert swapper.pool.num_free == 1 and swapper.buffers_available == 3
    misses = swapper.stats.misses
    assert torch.equal(read(swapper, 0), data[0]) and torch.equal(read(swapper, 1), data[1])
    assert swapper.stats.misses == misses and swapper.stats.hits == 2
    new = random_bytes(5000, 9)
    swapper.wait(swapper.write("param", 0, new))  # a cached shard is updated in place
    assert swapper.state("param", 0) is ShardState.HOST and torch.equal(read(swapper, 0), new)
    swapper.check_invariants()
    swapper.close()
    assert all(swapper.state("param", k) is ShardState.NVME for k in SIZES) and swapper.pool.num_free == 3


def test_pool_pressure_drops_cached_shards(store):
    swapper = make(store, buffer_count=2, cache_bytes=10**6)
    data = fill(swapper)
    swapper.cache.set_schedule([0, 1, 3, 1, 0])
    for k in (0, 1):
        swapper.cache.advance(k)
        read(swapper, k)
    assert swapper.pool.num_free == 0  # both buffers hold cached shards
    swapper.cache.advance(3)
    assert torch.equal(read(swapper, 3), data[3])  # 0 is needed last: it makes way
    assert swapper.state("param", 0) is ShardState.NVME and swapper.state("param", 1) is ShardState.HOST
    swapper.check_invariants()


def test_evict_takes_the_buffer_over(store):
    swapper = make(store, buffer_count=2, cache_bytes=10**6)
    fill(swapper)
    read(swapper, 1)
    buf = swapper.acquire(12288)
    buf.fill_(3)
    swapper.wait(swapper.evict("param", 1, buf))  # replaces the cached copy
    assert swapper.state("param", 1) is ShardState.HOST and swapper.pool.num_free == 1
    assert bool((read(swapper, 1) == 3).all())
    swapper.close()
    assert bool((read(swapper, 1) == 3).all())  # from NVMe this time
    swapper.check_invariants()


def test_waiting_for_a_buffer_times_out_with_the_pool_settings(store):
    swapper = make(store, buffer_count=1)
    fill(swapper)
    swapper.timeout = 0.1
    swapper.fetch("param", 0)
    with pytest.raises(TimeoutError, match=r"offload_param\.buffer_count.*all 1 buffers"):
        swapper.fetch("param", 1)
    swapper.release("param", 0)
    assert torch.equal(read(swapper, 1), read(swapper, 1))
    swapper.check_invariants()


def test_prefetch_on_another_thread(store):
    swapper = make(store, buffer_count=3, cache_bytes=12288)
    data = fill(swapper)
    order = [0, 1, 2, 3, 3, 2, 1, 0] * 3
    swapper.cache.set_schedule([("param", k) for k in order[:8]])
    handles: list = []
    ready = threading.Semaphore(0)
    room = threading.Semaphore(2)  # prefetch at most two ahead: one buffer stays for the cache

    def prefetch() -> None:
        for k in order:
            room.acquire()
            handles.append(swapper.fetch("param", k))
            ready.release()

    thread = threading.Thread(target=prefetch)
    thread.start()
    for i, k in enumerate(order):
        ready.acquire()
        buf = swapper.wait(handles[i])
        swapper.cache.advance(("param", k))
        assert torch.equal(buf, data[k]), (i, k)
        if i % 3 == 0:
            buf.add_(1)
            data[k] = buf.clone()
        swapper.release("param", k, dirty=i % 3 == 0)
        room.release()
    thread.join()
    swapper.flush()
    swapper.check_invariants()
    swapper.close()
    for k in SIZES:
        assert torch.equal(read(swapper, k), data[k])


def test_read_delay_overlaps_with_work(store):
    swapper = make(store, buffer_count=4, read_delay_s=0.15)
    fill(swapper)
    start = time.perf_counter()
    for k in SIZES:
        read(swapper, k)
    serialized = time.perf_counter() - start
    start = time.perf_counter()
    handles = [swapper.fetch("param", k) for k in SIZES]
    for k, handle in zip(SIZES, handles):
        swapper.wait(handle)
        swapper.release("param", k)
    overlapped = time.perf_counter() - start
    assert serialized >= 4 * 0.15 and overlapped < 0.6 * serialized


@pytest.mark.filterwarnings("ignore::UserWarning:torch.*")  # torch's own, about CUDA, on a GPU host
def test_profiler_names(store):
    swapper = make(store)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fill(swapper)
        read(swapper, 0)
    names = {event.key for event in prof.key_averages()}
    assert {"infinity::nvme_read", "infinity::nvme_write", "infinity::nvme_wait"} <= names


def test_no_profiler_range_is_opened_while_no_profiler_records(store, monkeypatch):
    # An idle torch.profiler range still dispatches an op, 8-9 us a pair: two a transfer cost the
    # streaming step ~7% of its time (bench/results/moment_formats.md). Counted where torch makes them.
    opened = []
    real = torch.ops.profiler._record_function_enter_new
    monkeypatch.setattr(torch.ops.profiler, "_record_function_enter_new",
                        lambda *a, **k: opened.append(a[0]) or real(*a, **k), raising=False)
    swapper = make(store)
    fill(swapper)
    read(swapper, 0)
    assert opened == []
    with profile(activities=[ProfilerActivity.CPU]):
        read(swapper, 1)
    assert {"infinity::nvme_read", "infinity::nvme_wait"} <= set(opened)


def test_threads_hammering_shared_and_own_shards(tmp_path):
    # Three threads fetch shards everyone reads and update shards only they write, through a
    # pool with one spare buffer and a small cache; every byte read must be the last written.
    shared = {("s", i): 3000 + 700 * i for i in range(4)}
    own = {("o", t, i): 5000 + 300 * i for t in range(3) for i in range(2)}
    with NvmeStore(tmp_path, {"param": {**shared, **own}}, job_id="h") as store:
        swapper = Swapper(store, BufferPool(4, 6000), HostCache(9000), timeout=30)
        data = {k: random_bytes(n, hash(k) % 1000) for k, n in {**shared, **own}.items()}
        for k, d in data.items():
            swapper.write("param", k, d)
        swapper.flush()
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            rng = torch.Generator().manual_seed(t)
            mine = [k for k in own if k[1] == t]
            try:
                for step in range(150):
                    pick = int(torch.randint(0, 10, (1,), generator=rng))
                    key = mine[pick % 2] if pick < 4 else list(shared)[pick % 4]
                    buf = swapper.wait(swapper.fetch("param", key))
                    assert torch.equal(buf, data[key]), (t, step, key)
                    dirty = key in mine and pick % 3 == 0
                    if dirty:
                        buf.add_(1)
                        data[key] = buf.clone()
                    swapper.release("param", key, dirty=dirty)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        swapper.close()
        swapper.check_invariants()
        for k in data:
            assert torch.equal(read(swapper, k), data[k]), k
        assert swapper.cache.peak_bytes <= 9000 and swapper.pool.stats.peak_in_use <= 4 * 8192


def test_a_write_handle_takes_every_write_and_only_writes(store):
    """With a second handle, reads never queue behind writes: each goes to its own handle, and
    each request is waited for on the handle that issued it."""
    reads, writes = RecordingHandle(), RecordingHandle()
    swapper = make(store, handle=reads, write_handle=writes)
    data = fill(swapper)
    h = swapper.fetch("param", 1)
    buf = swapper.wait(h)
    assert torch.equal(buf[:SIZES[1]], data[1])
    buf.add_(1)
    swapper.release("param", 1, dirty=True)
    swapper.flush()
    assert torch.equal(read(swapper, 1), data[1] + 1)
    assert {op for op, _ in reads.log} == {"read", "wait"} and {op for op, _ in writes.log} == {"write", "wait"}
    for log in (reads.log, writes.log):  # every request waited for once, on its own handle
        issued = [rid for op, rid in log if op != "wait"]
        assert sorted(rid for op, rid in log if op == "wait") == sorted(issued)


def test_reap_gives_finished_writes_buffers_back_without_waiting(store):
    swapper = make(store, buffer_count=3, handle=AsyncIOHandle(), write_handle=AsyncIOHandle())
    data = fill(swapper)
    for k in (0, 1):
        swapper.wait(swapper.fetch("param", k)).add_(1)
        swapper.release("param", k, dirty=True)  # write-back starts; the buffers stay its until completed
    deadline = time.monotonic() + 30
    reaped = 0
    while swapper.pool.num_free < 3:
        reaped += swapper.reap()
        assert time.monotonic() < deadline, "finished writes were never reaped"
        time.sleep(0.001)
    assert reaped == 2
    assert torch.equal(read(swapper, 0), data[0] + 1) and torch.equal(read(swapper, 1), data[1] + 1)
    stats = swapper.stats
    # Busy time is wall time with transfers in flight: never more than the sum of their durations.
    assert 0 < stats.host_to_nvme.busy_seconds <= stats.host_to_nvme.seconds + 1e-9
    assert stats.busy_seconds > 0
    assert stats.host_to_nvme.submitted_bytes == stats.host_to_nvme.bytes


class HeldWrites:
    """A real handle whose writes reach it only at `let_go` (or a wait): until then each is in
    flight and unfinished, as on a slow disk. Counts the swapper's `done` polls."""

    def __init__(self) -> None:
        self.inner = AsyncIOHandle()
        self.held: dict[int, tuple] = {}  # our id -> the write's arguments
        self.real: dict[int, int] = {}  # our id -> the inner handle's
        self.polls = 0

    def submit_write(self, buffer, path, offset=0):
        rid = len(self.held) + len(self.real) + 1
        self.held[rid] = (buffer, path, offset)
        return rid

    def let_go(self) -> None:
        self.real.update({rid: self.inner.submit_write(*args) for rid, args in self.held.items()})
        self.held.clear()

    def done(self, request):
        self.polls += 1
        return request in self.real and self.inner.done(self.real[request])

    def finished_count(self):
        return self.inner.finished_count()

    def wait(self, request=None):
        self.let_go()
        return self.inner.wait(self.real.pop(request))


def test_reap_asks_about_writes_in_flight_only_once_a_request_finished(store):
    """The optimizer's pipeline reaps before every read ahead, with tens of writes in flight, and
    `reap` asked the handle about each of them every time. It now looks again only once the
    handle's count of finished requests has moved, and still reaps every finished write."""
    writes = HeldWrites()
    swapper = make(store, buffer_count=3, handle=AsyncIOHandle(), write_handle=writes)
    data = fill(swapper)
    for k in (0, 1):
        swapper.wait(swapper.fetch("param", k)).add_(1)
        swapper.release("param", k, dirty=True)  # in flight, unfinished until let go
    swapper.reap()
    polls = writes.polls
    assert [swapper.reap() for _ in range(5)] == [0] * 5
    assert writes.polls == polls, "asked about unfinished writes though no request had finished"
    writes.let_go()
    deadline, reaped = time.monotonic() + 30, 0
    while reaped < 2:
        reaped += swapper.reap()
        assert time.monotonic() < deadline, f"{2 - reaped} finished writes were never reaped"
    assert swapper.pool.num_free == 3
    assert torch.equal(read(swapper, 0), data[0] + 1) and torch.equal(read(swapper, 1), data[1] + 1)


class CutOffWaits:
    """A real handle whose waits for writes, once `cut` is set, return from the engine, block
    until `go` is set, and then raise KeyboardInterrupt: a Ctrl-C landing in a thread that had
    finished waiting but not yet recorded it."""

    def __init__(self) -> None:
        self.inner = AsyncIOHandle()
        self.cut, self.inside, self.go = False, threading.Event(), threading.Event()

    def submit_write(self, buffer, path, offset=0):
        return self.inner.submit_write(buffer, path, offset)

    def done(self, request):
        return self.inner.done(request)

    def finished_count(self):
        return self.inner.finished_count()

    def wait(self, request=None):
        n = self.inner.wait(request)
        if self.cut:
            self.cut = False
            self.inside.set()
            self.go.wait(30)
            raise KeyboardInterrupt
        return n


def test_reap_looks_again_at_a_write_another_thread_was_completing(store):
    """A reap that skipped a finished write while another thread completed it must look again:
    if that thread is cut off before it records the write, no request may finish after it to
    move the handle's count (reap stored that count and skipped the write every time after)."""
    writes = CutOffWaits()
    swapper = make(store, buffer_count=3, handle=AsyncIOHandle(), write_handle=writes)
    data = fill(swapper)
    swapper.wait(swapper.fetch("param", 0)).add_(1)
    handle = swapper.release("param", 0, dirty=True)
    deadline = time.monotonic() + 30
    while not writes.inner.done(handle.transfer.request):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    writes.cut = True
    completing = threading.Thread(target=lambda: pytest.raises(KeyboardInterrupt, swapper.wait, handle))
    completing.start()
    assert writes.inside.wait(30)
    assert swapper.reap() == 0  # the write is the other thread's to complete
    writes.go.set()
    completing.join(30)
    assert swapper.reap() == 1, "the finished write was left in flight"
    assert swapper.pool.num_free == 3 and torch.equal(read(swapper, 0), data[0] + 1)


def test_a_completion_cut_off_after_the_wait_returned_is_finished_by_the_next(store):
    """Ctrl-C landing after the handle's wait for a write returned, before the swapper recorded
    it ([Note: waiting again] in infinity/io/handle.py): the shard still looks in flight, and the
    next flush waited for that request again, which the handle no longer knew (ValueError, so
    `infinity finetune` interrupted during a step exited from its cleanup with an error). Now the
    flush finishes it with the outcome the first wait had, and the bytes read back are those
    written."""
    swapper = make(store)
    data = random_bytes(SIZES[0], seed=3)
    handle = swapper.write("param", 0, data)
    swapper.write_handle.wait_timed(handle.transfer.request)  # what the interrupted completion did
    swapper.flush()
    assert swapper.state("param", 0) is ShardState.NVME
    assert torch.equal(swapper.wait(swapper.fetch("param", 0))[: SIZES[0]], data)
    swapper.release("param", 0)
    swapper.close()
