"""The async-IO engine through its Python facade: integrity, errors, fallback, API surface."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from infinity.io import AsyncIOHandle, aligned_empty, available_engines

ENGINES = available_engines()
MiB = 1 << 20


def _random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _lengths(rng: random.Random) -> list[int]:
    # Tiny, sub-block, just-off-alignment, multi-block, and one request near 64 MiB.
    return [1, 7, 511, 4095, 4097, rng.randrange(1, 1 << 16), rng.randrange(1 << 16, 3 * MiB),
            3 * MiB + 1, rng.randrange(60 * MiB, 64 * MiB)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "knobs",
    [
        dict(block_size=64 * 1024, queue_depth=4, thread_count=3),
        dict(block_size=1 * MiB, queue_depth=32, thread_count=2, single_submit=True),
        dict(block_size=128 * 1024, queue_depth=8, thread_count=1, overlap_events=False),
    ],
    ids=["3threads", "single_submit", "no_overlap"],
)
def test_read_after_write_is_byte_exact(tmp_path, engine, knobs):
    rng = random.Random(hash((engine, tuple(knobs.items()))) & 0xFFFF)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    handle = AsyncIOHandle(engine=engine, **knobs)
    assert handle.engine == engine
    path = tmp_path / "data.bin"

    # Disjoint regions at random, mostly unaligned offsets, all in flight at once.
    regions, cursor = [], 0
    for n in _lengths(rng):
        cursor += rng.randrange(0, 10_000)
        regions.append((cursor, n))
        cursor += n
    rng.shuffle(regions)
    sources = []
    for offset, n in regions:
        # Some sources start one byte into their allocation: misaligned memory must bounce.
        skew = rng.choice([0, 1])
        src = _random_bytes(n + skew, gen)[skew:]
        sources.append(src)
        handle.submit_write(src, path, offset)
    assert handle.wait() == len(regions)

    targets = []
    for offset, n in regions:
        skew = rng.choice([0, 3])
        dst = torch.zeros(n + skew, dtype=torch.uint8)[skew:]
        targets.append((handle.submit_read(dst, path, offset), dst))
    # Per-request waits, in a different order than submitted.
    for rid, _ in reversed(targets):
        assert handle.wait(rid) == 1
    for src, (_, dst) in zip(sources, targets):
        assert torch.equal(src, dst)


# A second writer that keeps the disk busy: four threads of O_DIRECT 1 MiB writes cycling over
# a 64 MiB file, for at most argv[2] seconds. It prints one line once its first write has landed.
_DISK_HOG = textwrap.dedent(
    """
    import mmap, os, sys, threading, time
    path, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)

    block = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    block.write(os.urandom(1 << 20))

    def hog(first):
        for i in range(first, 1 << 62, 4):
            if time.monotonic() > deadline:
                return
            os.pwrite(fd, block, (i % 64) << 20)

    os.pwrite(fd, block, 0)
    print("busy", flush=True)
    for first in range(4):
        threading.Thread(target=hog, args=(first,)).start()
    """
)


@contextlib.contextmanager
def _busy_disk(directory: Path, seconds: float) -> Iterator[None]:
    path = directory / "busy.bin"
    hog = subprocess.Popen(
        [sys.executable, "-c", _DISK_HOG, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout.readline() == "busy\n"
        yield
    finally:
        hog.kill()
        hog.wait()
        hog.stdout.close()
        path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_unaligned_overwrites_under_disk_load_are_byte_exact(tmp_path, engine):
    """No page is written both through the page cache and through O_DIRECT (DESIGN.md section 6).

    Each round overwrites 32 slots of one existing file with random lengths: the end of most
    writes falls mid-page. Cut at the 512-byte DIO alignment instead of the page, a buffered
    tail and the O_DIRECT body shared that page, and the tail's read-modify-write could read it
    before the body landed and put the old bytes back over it. A second writer keeps the disk
    slow so that the window is wide. The file is written once beforehand: the partial page
    must come from disk, and appends into a new file hardly ever showed the race on ext4.
    """
    if _o_direct_refused(str(tmp_path)):
        pytest.skip("no O_DIRECT here: nothing is written through both paths")
    slot, num_slots, max_rounds, budget_s = 256 * 1024, 32, 80, 4.0
    rng = random.Random(f"overwrite-{engine}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    handle = AsyncIOHandle(engine=engine)
    path = tmp_path / "slots.bin"
    handle.write(aligned_empty(num_slots * slot).fill_(0xEE), path)

    with _busy_disk(tmp_path, seconds=budget_s + 30):
        deadline = time.monotonic() + budget_s
        for round_ in range(max_rounds):
            sources = [_random_bytes(rng.randrange(1, slot + 1), gen) for _ in range(num_slots)]
            for i, src in enumerate(sources):
                handle.submit_write(src, path, i * slot)
            assert handle.wait() == num_slots
            for i, src in enumerate(sources):
                back = torch.empty_like(src)
                handle.read(back, path, i * slot)
                wrong = (back != src).nonzero().flatten()
                if wrong.numel():
                    pytest.fail(
                        f"round {round_}: write of {src.numel()} bytes at {i * slot}: {wrong.numel()} "
                        f"bytes wrong in [{int(wrong[0])}, {int(wrong[-1])}]"
                    )
            if time.monotonic() > deadline:
                break


@pytest.mark.parametrize("engine", ENGINES)
def test_aligned_buffers_and_numpy(tmp_path, engine):
    handle = AsyncIOHandle(engine=engine, block_size=256 * 1024)
    src = aligned_empty(5 * MiB, torch.float32)
    src.copy_(torch.randn(5 * MiB))
    assert src.data_ptr() % 4096 == 0 and src.numel() == 5 * MiB
    handle.write(src, tmp_path / "f", 4096)
    dst = aligned_empty(5 * MiB, torch.float32)
    assert handle.read(dst, tmp_path / "f", 4096) == 20 * MiB
    assert torch.equal(src, dst)
    # Any object with the buffer protocol works too.
    raw = bytearray(1000)
    handle.read(raw, tmp_path / "f", 4096)
    assert bytes(raw) == src.view(torch.uint8)[:1000].numpy().tobytes()


def _o_direct_refused(directory: str) -> bool:
    probe = os.path.join(directory, ".probe")
    open(probe, "wb").close()
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError as e:
        assert e.errno == errno.EINVAL
        return True
    finally:
        os.unlink(probe)


def test_tmpfs_works_with_at_most_one_warning():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = f"/dev/shm/infinity-test-{os.getpid()}"
    os.makedirs(directory, exist_ok=True)
    try:
        # Kernels before 6.6 refuse O_DIRECT on tmpfs; newer ones accept it (as buffered I/O).
        refused = _o_direct_refused(directory)
        handle = AsyncIOHandle(block_size=64 * 1024, thread_count=2)
        data = _random_bytes(300_001, torch.Generator().manual_seed(0))
        if refused:
            with pytest.warns(RuntimeWarning, match=f"O_DIRECT is not supported for {directory}"):
                handle.write(data, f"{directory}/a", 13)
        else:
            handle.write(data, f"{directory}/a", 13)
        back = torch.empty_like(data)
        handle.read(back, f"{directory}/a", 13)  # never a second warning (warnings are errors here)
        assert torch.equal(data, back)
    finally:
        subprocess.run(["rm", "-rf", directory], check=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_buffered_path_is_byte_exact(tmp_path, engine):
    """The path a file system without O_DIRECT takes: everything through the buffered descriptor."""
    gen = torch.Generator().manual_seed(7)
    handle = AsyncIOHandle(engine=engine, block_size=64 * 1024, thread_count=2, use_direct=False)
    regions = [(0, 1), (5, 70_000), (100_000, 3 * MiB + 3), (4 * MiB, 4096)]
    sources = [_random_bytes(n, gen) for _, n in regions]
    for (offset, _), src in zip(regions, sources):
        handle.submit_write(src, tmp_path / "b", offset)
    handle.wait()
    for (offset, n), src in zip(regions, sources):
        dst = torch.empty(n, dtype=torch.uint8)
        handle.read(dst, tmp_path / "b", offset)
        assert torch.equal(src, dst)


@pytest.mark.parametrize("engine", ENGINES)
def test_errors_carry_errno_and_handle_survives(tmp_path, engine):
    handle = AsyncIOHandle(engine=engine, block_size=64 * 1024)
    buf = torch.zeros(10_000, dtype=torch.uint8)

    with pytest.raises(OSError) as missing:
        handle.submit_write(buf, tmp_path / "no" / "such" / "dir", 0)
    assert missing.value.errno == errno.ENOENT

    path = tmp_path / "short"
    handle.write(torch.ones(5000, dtype=torch.uint8), path)
    with pytest.raises(OSError) as eof:
        handle.read(buf, path, 0)  # 10000 bytes from a 5000-byte file
    assert eof.value.errno == errno.ENODATA
    assert "offset" in str(eof.value) and str(path) in str(eof.value)
    with pytest.raises(OSError):
        handle.read(buf, path, 1 << 20)  # starts past the end

    # Still usable, and the failed read did not disturb the file.
    back = torch.zeros(5000, dtype=torch.uint8)
    handle.read(back, path)
    assert bool((back == 1).all())
    assert handle.num_pending == 0
    assert handle.finished_count() == 4  # the failed reads too (Swapper.reap polls by it); not the open


@pytest.mark.parametrize("engine", ENGINES)
def test_a_directory_is_refused_also_where_a_file_was(tmp_path, engine):
    # The engine opens the path at each request and refuses a directory there (EISDIR), a read
    # or a write alike, naming the path: also where a file was at an earlier request.
    handle = AsyncIOHandle(engine=engine, block_size=64 * 1024)
    buf = aligned_empty(8192, pin=False)
    path = tmp_path / "was_a_file"
    handle.write(buf, path)
    handle.read(buf, path)
    path.unlink()
    path.mkdir()
    for where in (tmp_path, path):
        for submit in (handle.submit_write, handle.submit_read):
            with pytest.raises(IsADirectoryError) as refused:
                submit(buf, where, 0)
            assert refused.value.errno == errno.EISDIR and refused.value.filename == str(where)
    assert handle.num_pending == 0


def _drop_dac_override() -> bool:
    """Drops CAP_DAC_OVERRIDE from this thread's effective set (root ignores file modes otherwise)."""
    if os.geteuid() != 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0
    data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    assert libc.capset(ctypes.byref(header), data) == 0
    return True


def test_read_only_file_is_refused(tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"x" * 100)
    path.chmod(0o444)
    script = textwrap.dedent(
        f"""
        import errno, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_aio import _drop_dac_override
        from infinity.io import AsyncIOHandle
        _drop_dac_override()
        h = AsyncIOHandle()
        try:
            h.write(torch.zeros(10, dtype=torch.uint8), {str(path)!r})
        except OSError as e:
            assert e.errno in (errno.EACCES, errno.EPERM), e
            print("refused", e.errno)
        else:
            raise SystemExit("write to a read-only file succeeded")
        """
    )
    # A child process: capabilities are per thread, and this one must not lose them.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "refused" in out.stdout
    assert path.read_bytes() == b"x" * 100


@pytest.mark.parametrize("engine", ENGINES)
def test_file_size_limit_fails_the_write_with_efbig(tmp_path, engine):
    script = textwrap.dedent(
        f"""
        import errno, resource, signal, torch
        from infinity.io import AsyncIOHandle
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        h = AsyncIOHandle(engine={engine!r}, block_size=256 * 1024, thread_count=2)
        path = {str(tmp_path / "big")!r}
        try:
            h.write(torch.ones(4 << 20, dtype=torch.uint8), path)
        except OSError as e:
            assert e.errno == errno.EFBIG, e
            print("efbig", e)
        else:
            raise SystemExit("write past RLIMIT_FSIZE succeeded")
        h.write(torch.full((4096,), 2, dtype=torch.uint8), path, 0)
        back = torch.empty(4096, dtype=torch.uint8)
        h.read(back, path, 0)
        assert bool((back == 2).all())
        print("usable")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "efbig" in out.stdout and "usable" in out.stdout


def test_gil_is_released_while_waiting(tmp_path):
    handle = AsyncIOHandle(block_size=1 * MiB)
    data = aligned_empty(256 * MiB)
    data.fill_(3)
    path = tmp_path / "big"
    handle.write(data, path)
    done = threading.Event()
    progress = 0

    def waiter():
        for _ in range(3):
            handle.read(data, path)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    while not done.is_set():
        progress += 1
    t.join()
    # With the GIL held across the wait this loop could not have run while I/O was going on.
    assert progress > 1000


def test_wait_for_unknown_request_is_an_error_and_waiting_again_gives_the_outcome_again(tmp_path):
    """[Note: waiting again] in infinity/io/handle.py: a wait repeated after one that Ctrl-C cut
    off once it had returned gets the request's outcome, errors included."""
    handle = AsyncIOHandle()
    with pytest.raises(ValueError, match="not outstanding"):
        handle.wait(12345)
    rid = handle.submit_write(torch.zeros(10, dtype=torch.uint8), tmp_path / "f")
    handle.wait(rid)
    assert handle.wait(rid) == 1 and handle.done(rid)
    assert handle.wait() == 0 and handle.num_pending == 0
    bad = handle.submit_read(torch.zeros(10, dtype=torch.uint8), tmp_path / "f", offset=1 << 20)
    for _ in range(2):
        with pytest.raises(OSError, match="read past end of file"):
            handle.wait(bad)


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIOHandle(queue_depth=0)
    with pytest.raises(TypeError, match="single_submit"):
        AsyncIOHandle(single_submit=1)
    with pytest.raises(ValueError, match="engine"):
        AsyncIOHandle(engine="spdk")
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        AsyncIOHandle(thread_count=2, intra_op_parallelism=4)
    handle = AsyncIOHandle()
    with pytest.raises(ValueError, match="contiguous"):
        handle.submit_write(torch.zeros(4, 4).t(), tmp_path / "f")
    with pytest.raises(ValueError, match="offset"):
        handle.submit_write(torch.zeros(4), tmp_path / "f", -1)
    with pytest.raises(TypeError, match="buffer"):
        handle.submit_write("text", tmp_path / "f")


def test_deepspeed_names(tmp_path):
    handle = AsyncIOHandle(block_size=65536, queue_depth=4, intra_op_parallelism=2, single_submit=True,
                           overlap_events=False)
    assert handle.get_block_size() == 65536
    assert handle.get_queue_depth() == 4
    assert handle.get_thread_count() == handle.get_intra_op_parallelism() == 2
    assert handle.get_single_submit() is True and handle.get_overlap_events() is False
    example = torch.empty(0, dtype=torch.bfloat16)
    locked = handle.new_cpu_locked_tensor(1000, example)
    assert locked.dtype == torch.bfloat16 and locked.numel() == 1000 and locked.data_ptr() % 4096 == 0
    locked.copy_(torch.randn(1000))
    handle.async_pwrite(locked, str(tmp_path / "f"), 0)
    assert handle.wait() == 1
    scratch = torch.empty_like(locked)
    handle.async_pread(scratch, str(tmp_path / "f"), 0)
    assert handle.wait() == 1 and torch.equal(scratch, locked)
    assert handle.free_cpu_locked_tensor(scratch)
    back = torch.empty_like(locked)
    handle.sync_pread(back, str(tmp_path / "f"), 0)
    assert torch.equal(back, locked)


def test_aligned_empty_shapes():
    t = aligned_empty(3, torch.float64)
    assert t.shape == (3,) and t.dtype == torch.float64 and t.data_ptr() % 4096 == 0
    assert aligned_empty(0).numel() == 0
    with pytest.raises(ValueError, match="numel"):
        aligned_empty(-1)
    assert aligned_empty(10, pin=False).numel() == 10


@pytest.mark.parametrize("nbytes", [(2 << 20) - 4096, 2 << 20, (6 << 20) + 3])
def test_aligned_empty_large_buffers_sit_on_huge_page_boundaries(nbytes):
    # A buffer of one huge page or more starts on a 2 MiB boundary, so that the kernel can back
    # it with transparent huge pages (fewer pages to pin per O_DIRECT request); smaller ones
    # only need the page. Every byte is usable and the memory comes back when the tensor dies.
    t = aligned_empty(nbytes)
    assert t.numel() == nbytes and t.data_ptr() % 4096 == 0
    assert (t.data_ptr() % (2 << 20) == 0) == (nbytes >= 2 << 20)
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t[0]) == 7
    del t


def _smaps_field(ptr: int, field: str) -> int:
    """`field` (kB) of the mapping holding `ptr`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= ptr < high
            elif inside and head == field + ":":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_aligned_empty_without_huge_pages_stays_on_ordinary_pages():
    # The control of bench_aio --buffers-ab: advised MADV_NOHUGEPAGE, so not one huge page even
    # under THP "always"; page-aligned, every byte usable, still locked when asked.
    t = aligned_empty(8 * MiB + 3, huge_pages=False)
    t.fill_(7)
    assert t.data_ptr() % 4096 == 0 and int(t[-1]) == 7
    assert _smaps_field(t.data_ptr(), "AnonHugePages") == 0
    if not torch.cuda.is_available():
        assert _smaps_field(t.data_ptr(), "Locked") >= 8 * 1024
    with pytest.raises(TypeError, match="huge_pages"):
        aligned_empty(10, huge_pages=1)


def test_aligned_empty_is_page_locked():
    t = aligned_empty(1 << 20, pin=None if torch.cuda.is_available() else True)
    with open("/proc/self/status") as f:
        locked_kib = next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))
    if not torch.cuda.is_available():
        assert locked_kib >= 1024  # mlock'ed, since there is no CUDA to pin with
    del t


@pytest.mark.gpu
def test_aligned_empty_is_pinned_on_cuda():
    t = aligned_empty(1 << 20, torch.float32)
    assert t.is_pinned()
    gpu = t.cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert gpu.shape == t.shape


def test_handle_survives_fork(tmp_path):
    handle = AsyncIOHandle(thread_count=2)
    handle.write(torch.ones(4096, dtype=torch.uint8), tmp_path / "f")
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the handle, whose threads it does not have
        try:
            del handle
            import gc

            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    back = torch.empty(4096, dtype=torch.uint8)
    handle.read(back, tmp_path / "f")
    assert bool((back == 1).all())


def test_done_polls_without_blocking_and_wait_timed_reports_completion(tmp_path):
    handle = AsyncIOHandle()
    buf = aligned_empty(4 << 20)
    buf.fill_(3)
    before = time.monotonic()
    rid = handle.submit_write(buf, str(tmp_path / "f"))
    deadline = time.monotonic() + 30
    while not handle.done(rid):  # polling never blocks, and the request finishes on its own
        assert time.monotonic() < deadline, "the write never completed"
        time.sleep(0.001)
    seen_done = time.monotonic()
    finished = handle.wait_timed(rid)
    assert before <= finished <= seen_done  # when it completed, not when it was waited for
    assert handle.done(rid) and handle.wait_timed(rid) == finished  # [Note: waiting again]


def test_a_wait_cut_off_by_an_interrupt_is_reported_not_a_key_error(tmp_path):
    """Ctrl-C landing after the engine finished a request but before the handle forgot it left
    the handle waiting, at close or __del__, for a request the engine no longer knew: a KeyError
    ('unknown or already completed request') from __del__. Its outcome is lost, so waiting for it
    is an error (never a success), and close() gets past it."""
    handle = AsyncIOHandle(block_size=64 * 1024)
    buf = aligned_empty(1 << 16)
    buf.fill_(7)
    rid = handle.submit_write(buf, tmp_path / "f")
    handle._engine.wait(rid)  # what the engine did before the interrupt arrived  # noqa: SLF001
    with pytest.raises(OSError, match=r"write of .*f: its wait was interrupted"):
        handle.wait(rid)
    rid = handle.submit_write(buf, tmp_path / "f")
    handle._engine.wait(rid)  # noqa: SLF001
    handle.close()  # no KeyError
    assert handle.num_pending == 0


_BLOCKED_READ = """
import os, signal, sys, time
from infinity.io import AsyncIOHandle, aligned_empty
fifo = sys.argv[1]
writer = os.open(fifo, os.O_RDWR)  # a writer exists: opening it to read does not block
handle = AsyncIOHandle(engine="io_uring", queue_depth=1)
buf = aligned_empty(4096)
rid = handle.submit_read(buf, fifo)
print("waiting", flush=True)
try:
    handle.wait(rid)
    print("returned", flush=True)
except KeyboardInterrupt:
    print("interrupted", handle.done(rid), flush=True)
os.write(writer, b"x" * 4096)  # the read can end now, and is waited for again
handle.wait(rid)
print("read", bytes(buf[:2].numpy()), flush=True)
"""


@pytest.mark.skipif("io_uring" not in available_engines(), reason="io_uring is refused here")
def test_a_signal_reaches_python_while_a_wait_blocks(tmp_path):
    """A read of a pipe that nothing writes to never ends on its own: Ctrl-C in the waiting main
    thread raises KeyboardInterrupt there (the engine used to wait in C++ with signals held back,
    so that only kill -9 ended it), the read goes on, and waiting again gives its outcome."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED_READ, str(fifo)], stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path)  # not the checkout, which would shadow the installed package
    try:
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(0.3)  # inside wait(), blocked on the pipe
        child.send_signal(2)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
        child.communicate()
    assert out.split("\n")[:2] == ["interrupted False", "read b'xx'"], out
