"""BufferPool: sizing from the real shards, waiting for releases, accounting, thread safety."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from infinity.io import PAGE_SIZE, aligned_empty
from infinity.offload.pool import BufferPool


def test_buffers_are_exact_views_of_aligned_memory():
    pool = BufferPool(2, 10000)
    assert pool.buffer_size == 12288  # rounded up to whole pages
    a = pool.acquire(100)
    b = pool.acquire(12288)
    assert a.dtype == torch.uint8 and a.shape == (100,) and b.shape == (12288,)
    assert a.data_ptr() % PAGE_SIZE == 0 and b.data_ptr() % PAGE_SIZE == 0
    assert a.data_ptr() != b.data_ptr()
    assert pool.base(a).numel() == pool.buffer_size and pool.base(a).data_ptr() == a.data_ptr()
    assert a.view(torch.float32).numel() == 25  # callers view it as their dtype
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 2


def test_buffer_size_is_raised_to_the_largest_shard_with_one_warning():
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param\.buffer_size: raised from 1000 to 50000"):
        pool = BufferPool(3, 1000, shard_sizes=[10, 50000, 700])
    assert pool.buffer_size == 53248  # 50000 rounded up to a page
    pool.release(pool.acquire(50000))


def test_no_warning_when_the_shards_fit():
    pool = BufferPool(1, 4096, shard_sizes=[4096, 1])  # warnings are errors in this suite
    assert pool.buffer_size == 4096


def test_a_request_larger_than_a_buffer_names_buffer_size():
    pool = BufferPool(1, 4096, name="offload_optimizer")
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.buffer_size"):
        pool.acquire(4097)


def test_acquire_waits_for_a_release():
    pool = BufferPool(1, 4096)
    held = pool.acquire(1)
    released = threading.Event()

    def release():
        released.set()
        pool.release(held)

    threading.Timer(0.1, release).start()
    again = pool.acquire(1, timeout=10)
    assert released.is_set()  # it returned only once the buffer was given back
    assert again.data_ptr() == held.data_ptr()
    pool.release(again)


def test_acquire_times_out_with_an_error_naming_the_settings():
    pool = BufferPool(2, 4096)
    held = [pool.acquire(1), pool.acquire(1)]
    with pytest.raises(TimeoutError, match=r"buffer_count.*all 2 buffers of 4096 bytes.*buffer_size"):
        pool.acquire(1, timeout=0.05)
    assert pool.try_acquire(1) is None
    for buf in held:
        pool.release(buf)


def test_release_checks_what_it_is_given():
    pool = BufferPool(1, 4096)
    buf = pool.acquire(10)
    with pytest.raises(ValueError, match="not a buffer handed out"):
        pool.release(torch.zeros(10, dtype=torch.uint8))
    pool.release(buf[:5])  # any view that starts the buffer
    with pytest.raises(ValueError, match="not a buffer handed out"):
        pool.release(buf)  # twice
    with pytest.raises(TypeError):
        pool.release("buffer")  # type: ignore[arg-type]


def test_accounting():
    pool = BufferPool(3, 4096)
    assert pool.stats.bytes_total == 3 * 4096 and pool.stats.bytes_in_use == 0
    assert pool.stats.pinned == torch.cuda.is_available()  # the default pins through CUDA where it is there
    a, b = pool.acquire(1), pool.acquire(1)
    assert pool.stats.bytes_in_use == 2 * 4096
    pool.release(a)
    c = pool.acquire(1)
    pool.release(b)
    pool.release(c)
    stats = pool.stats
    assert (stats.bytes_in_use, stats.peak_in_use) == (0, 2 * 4096)


def test_a_second_size_of_buffer_serves_the_requests_it_holds_and_only_them():
    """[Note: two sizes of buffer]: a request takes the smallest class that holds it, and waits for
    that class alone; the buffers are the sizes asked for, in real memory."""
    pool = BufferPool(2, 3 * PAGE_SIZE, small=(3, PAGE_SIZE + 1))
    sizes = sorted(pool.base(b).numel() for b in [pool.acquire(PAGE_SIZE) for _ in range(3)])
    assert sizes == [2 * PAGE_SIZE] * 3  # PAGE_SIZE + 1 rounded up to whole pages
    assert pool.stats.bytes_total == 2 * 3 * PAGE_SIZE + 3 * 2 * PAGE_SIZE and pool.buffer_count == 5
    assert pool.free_for(1) == 0 and pool.free_for(2 * PAGE_SIZE + 1) == 2
    with pytest.raises(TimeoutError, match="buffer_count"):
        pool.acquire(1, timeout=0.05)  # two large buffers free, none of its own size
    big = pool.acquire(2 * PAGE_SIZE + 1)
    assert pool.base(big).numel() == 3 * PAGE_SIZE
    assert pool.stats.buffers_in_use == 4 and pool.stats.bytes_in_use == 3 * 2 * PAGE_SIZE + 3 * PAGE_SIZE


def test_a_second_size_no_smaller_than_the_first_makes_one_class():
    pool = BufferPool(2, PAGE_SIZE, small=(2, PAGE_SIZE))
    assert pool.buffer_count == 4 and pool.free_for(1) == 4 and pool.stats.bytes_total == 4 * PAGE_SIZE


def test_a_pool_larger_than_ram_is_refused_before_allocating():
    match = r"offload_param: buffer_count x buffer_size = 1000000 x .*lower buffer_count or buffer_size"
    with pytest.raises(ValueError, match=match):
        BufferPool(1_000_000, 1 << 30)


@pytest.mark.parametrize(
    ("count", "size", "error", "key"),
    [
        (0, 4096, ValueError, "buffer_count"),
        (True, 4096, TypeError, "buffer_count"),
        (2, "4096", TypeError, "buffer_size"),
        (2, 1.5, TypeError, "buffer_size"),
        (2, -1, ValueError, "buffer_size"),
    ],
)
def test_config_errors_name_the_key(count, size, error, key):
    with pytest.raises(error, match=rf"zero_optimization\.offload_param\.{key}"):
        BufferPool(count, size)


def test_sizes_written_as_floats_are_accepted():
    assert BufferPool(2.0, 4e3).buffer_size == 4096  # DeepSpeed configs write 1e8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinning_without_cuda_names_pin_memory():
    with pytest.raises(ValueError, match=r"offload_param\.pin_memory"):
        BufferPool(1, 4096, pin=True)


def test_threads_never_share_a_buffer():
    pool = BufferPool(3, 4096)
    owners: dict[int, int] = {}
    guard = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            buf = pool.acquire(rng.randint(1, 4096), timeout=10)
            with guard:
                if buf.data_ptr() in owners:
                    errors.append("a buffer was handed out twice")
                owners[buf.data_ptr()] = seed
            buf.fill_(seed)
            time.sleep(rng.random() * 1e-4)
            if not bool((buf == seed).all()):
                errors.append("a buffer changed under its holder")
            with guard:
                del owners[buf.data_ptr()]
            pool.release(buf)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.num_free == 3 and pool.stats.peak_in_use <= pool.stats.bytes_total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buffers_are_pinned_when_a_gpu_is_present():
    pool = BufferPool(2, 4096)
    assert pool.pinned and pool.stats.pinned
    buf = pool.acquire(4096)
    assert buf.is_pinned()
    buf.fill_(5)
    on_device = buf.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(on_device.sum()) == 5 * 4096
    pool.release(buf)
    assert not BufferPool(1, 4096, pin=False).pinned


def _huge_bytes(buffers: list[torch.Tensor]) -> int:
    """Bytes of `buffers` the kernel backs with huge pages: AnonHugePages of the mappings of
    /proc/self/smaps that hold them (each mapping counted once)."""
    mappings, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = (lo, hi) if any(lo <= b.data_ptr() < hi for b in buffers) else None
            elif current is not None and head == "AnonHugePages:":
                mappings[current] = int(line.split()[1]) * 1024
    return sum(mappings.values())


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_buffers_of_any_size_lie_on_huge_pages():
    """[Note: one mapping a class] in infinity/offload/pool.py: 1M-element fp32 pieces (4,096,000
    bytes, not a multiple of 2 MiB) and 0.5M ones of a second class are backed by huge pages as a
    2 MiB-multiple buffer is; one mapping a buffer backed 51% and 0% of them, and the block layer
    cut each O_DIRECT request into pieces of at most 254 ordinary pages."""
    control = aligned_empty(16 << 21, pin=False)  # 32 MiB, 2 MiB-aligned: what the kernel gives here
    control.fill_(1)
    if _huge_bytes([control]) < 0.9 * control.numel():
        pytest.skip("the kernel gives no transparent huge pages here (THP never, or memory fragmented)")
    pool = BufferPool(8, 4_096_000, small=(8, 2_048_000), pin=False)
    buffers = [pool.acquire(4_096_000) for _ in range(8)] + [pool.acquire(2_048_000) for _ in range(8)]
    for b in buffers:
        b.fill_(1)  # fault the pages in
    total = sum(b.numel() for b in buffers)
    assert _huge_bytes(buffers) >= total - 2 * (2 << 20)  # all but a class's tail on huge pages
    for b in buffers:
        pool.release(b)
