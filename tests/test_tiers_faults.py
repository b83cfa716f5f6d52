"""Fault injection: failed writes mark only their shard invalid; failed reads leave everything
consistent and can be retried. Faults come from a wrapper around the real I/O handle, and from
the kernel itself (a truncated file, RLIMIT_FSIZE) through the real engine."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infinity.io import AsyncIOHandle
from infinity.offload.pool import BufferPool
from infinity.offload.state import ShardState
from infinity.offload.store import NvmeStore
from infinity.offload.swapper import Swapper

SIZES = {k: 8192 + 1000 * k for k in range(4)}


class FaultyHandle:
    """The real handle, with one-shot failures armed per extent: `fail(extent, op, mode)`.

    Modes: "error" (the transfer happens, then reports EIO), "short" (a write moves only half
    its bytes, then reports ENOSPC, like a full disk), "submit" (refused at submission).
    """

    def __init__(self) -> None:
        self.inner = AsyncIOHandle()
        self.armed: dict[tuple[str, str, int], str] = {}
        self.errors: dict[int, OSError] = {}

    def fail(self, extent, op: str, mode: str = "error") -> None:
        self.armed[(op, extent.path, extent.offset)] = mode

    def submit_read(self, buffer, path, offset=0):
        return self._submit("read", buffer, path, offset)

    def submit_write(self, buffer, path, offset=0):
        return self._submit("write", buffer, path, offset)

    def _submit(self, op, buffer, path, offset):
        mode = self.armed.pop((op, path, offset), None)
        if mode == "submit":
            raise OSError(errno.EACCES, f"Permission denied: cannot open {path} (injected)", path)
        if mode == "short":
            buffer = buffer[: buffer.numel() // 2]
        submit = self.inner.submit_write if op == "write" else self.inner.submit_read
        rid = submit(buffer, path, offset)
        if mode == "short":
            self.errors[rid] = OSError(errno.ENOSPC, f"No space left on device: {op} of {path} failed (injected)", path)
        elif mode == "error":
            self.errors[rid] = OSError(errno.EIO, f"Input/output error: {op} of {path} failed (injected)", path)
        return rid

    def wait(self, request=None):
        assert request is not None
        self.inner.wait(request)
        error = self.errors.pop(request, None)
        if error is not None:
            raise error
        return 1


@pytest.fixture
def rig(tmp_path):
    handle = FaultyHandle()
    with NvmeStore(tmp_path, {"param": SIZES}, job_id="f", handle=handle) as store:
        swapper = Swapper(store, BufferPool(2, max(SIZES.values())), handle=handle, timeout=10)
        data = {k: torch.full((n,), k + 1, dtype=torch.uint8) for k, n in SIZES.items()}
        for k, d in data.items():
            swapper.write("param", k, d)
        swapper.flush()
        yield swapper, handle, data


def read(swapper: Swapper, key) -> torch.Tensor:
    buf = swapper.wait(swapper.fetch("param", key))
    out = buf.clone()
    swapper.release("param", key)
    return out


def assert_others_intact(swapper, data, bad):
    for k in SIZES:
        if k != bad:
            assert swapper.state("param", k) is ShardState.NVME
            assert torch.equal(read(swapper, k), data[k]), k
    swapper.check_invariants()
    assert swapper.pool.num_free == 2


@pytest.mark.parametrize("mode", ["error", "short", "submit"])
def test_a_failed_write_invalidates_only_its_shard(rig, mode):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 1), "write", mode)
    buf = swapper.wait(swapper.fetch("param", 1))
    buf.fill_(99)
    expected = "Permission denied" if mode == "submit" else ("No space" if mode == "short" else "Input/output")
    match = rf"write of shard 1 of kind 'param' \(9192 bytes, .*param.bin at offset 8192\) failed: {expected}"
    with pytest.raises(OSError, match=match) as info:
        write = swapper.release("param", 1, dirty=True)  # refused at once ("submit"), else in flight
        swapper.wait(write)
    assert "invalid until it is written again" in str(info.value)
    assert swapper.state("param", 1) is ShardState.INVALID
    with pytest.raises(OSError, match="fetch: shard 1 of kind 'param' is invalid: its last write failed") as info:
        swapper.fetch("param", 1)
    assert info.value.errno == errno.EIO
    assert_others_intact(swapper, data, bad=1)
    swapper.flush()  # already reported: not raised twice
    new = torch.full((SIZES[1],), 7, dtype=torch.uint8)
    swapper.wait(swapper.write("param", 1, new))  # writing it again recovers it
    assert torch.equal(read(swapper, 1), new)


def test_a_lost_write_is_named_until_the_shard_is_written_again(rig):
    """`lost()`: what the engine asks before it goes on ([Note: failed updates] in
    infinity/engine/step_policy.py). A failed read loses nothing; a failed write loses its shard's
    bytes, reported or not, until a new write of it succeeds, which also makes its failure moot
    for `flush` (a load that rewrites the state is not refused for an old failure)."""
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 0), "read")
    with pytest.raises(OSError, match="read of shard 0"):
        swapper.wait(swapper.fetch("param", 0))
    assert swapper.lost() is None
    handle.fail(swapper.store.extent("param", 1), "write")
    handle.fail(swapper.store.extent("param", 2), "write")
    first, second = swapper.write("param", 1, data[1]), swapper.write("param", 2, data[2])
    with pytest.raises(OSError, match="write of shard 1"):
        swapper.wait(first)  # reported
    with pytest.raises(OSError, match="fetch: shard 2 of kind 'param' is invalid"):
        swapper.fetch("param", 2)  # completes the write: met, but its failure not reported yet
    assert "write of shard 1" in swapper.lost().strerror  # the oldest, reported or not
    assert "write of shard 1" in swapper.lost(["param"]).strerror and swapper.lost(["grad"]) is None
    swapper.wait(swapper.write("param", 2, data[2]))
    assert "write of shard 1" in swapper.lost().strerror  # 2 is good again...
    swapper.flush()  # ...and its failure moot: nothing left to raise
    swapper.check_invariants()
    swapper.wait(swapper.write("param", 1, data[1]))
    assert swapper.lost() is None
    assert_others_intact(swapper, data, bad=None)


def test_a_failure_nobody_waited_for_is_raised_by_flush(rig):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 2), "write")
    handle.fail(swapper.store.extent("param", 3), "write", "short")
    swapper.write("param", 2, data[2])
    swapper.write("param", 3, data[3])
    with pytest.raises(OSError, match=r"write of shard 2 .* \(and 1 more failed writes\)"):
        swapper.flush()
    swapper.flush()
    assert [swapper.state("param", k) for k in SIZES] == [ShardState.NVME] * 2 + [ShardState.INVALID] * 2


def test_a_fetch_that_reaps_a_failed_write_does_not_raise_it(rig):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 0), "write")
    for k in (0, 1):
        buf = swapper.wait(swapper.fetch("param", k))
        swapper.release("param", k, dirty=k == 0)  # 0: a failing write in flight; 1: freed
    swapper.fetch("param", 2)
    assert torch.equal(swapper.wait(swapper.fetch("param", 3)), data[3])  # needs 0's buffer
    assert swapper.state("param", 0) is ShardState.INVALID
    for k in (2, 3):
        swapper.release("param", k)
    with pytest.raises(OSError, match="write of shard 0"):
        swapper.flush()
    assert_others_intact(swapper, data, bad=0)
    del buf


def test_a_fetch_during_a_failing_write_fails_too(rig):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 0), "write")
    swapper.wait(swapper.fetch("param", 0))
    swapper.release("param", 0, dirty=True)
    again = swapper.fetch("param", 0)  # waits for the write: its failure is this fetch's
    with pytest.raises(OSError, match="write of shard 0 of kind 'param'"):
        swapper.wait(again)
    with pytest.raises(ValueError, match="not fetched"):
        swapper.release("param", 0)  # a failed fetch holds nothing
    swapper.flush()  # reported already
    with pytest.raises(OSError, match="fetch: shard 0 of kind 'param' is invalid"):
        swapper.fetch("param", 0)
    assert_others_intact(swapper, data, bad=0)


def test_a_write_failing_under_a_loan_keeps_its_buffer_until_the_loan_ends(rig):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 0), "write")
    swapper.wait(swapper.fetch("param", 0)).fill_(5)
    swapper.release("param", 0, dirty=True)
    lent = swapper.wait(swapper.fetch("param", 0), lend=True)  # the write is still in flight
    with pytest.raises(OSError, match="write of shard 0 of kind 'param'"):
        swapper.flush()
    assert swapper.state("param", 0) is ShardState.INVALID
    assert swapper.pool.num_free == 1  # the borrowed buffer is not handed out again...
    other = swapper.wait(swapper.fetch("param", 1))
    swapper.timeout = 0.5  # no buffer is free and none will be: the wait below can only time out
    with pytest.raises(OSError, match="exhausted|buffer"):
        swapper.wait(swapper.fetch("param", 2))  # ...not even under pressure
    assert bool((lent == 5).all())
    swapper.release("param", 1)
    swapper.release("param", 0)  # ends the loan: no error, the buffer goes back
    assert swapper.pool.num_free == 2
    with pytest.raises(OSError, match="fetch: shard 0 of kind 'param' is invalid"):
        swapper.fetch("param", 0)
    assert_others_intact(swapper, data, bad=0)
    del other


@pytest.mark.parametrize("mode", ["error", "submit"])
def test_a_failed_read_leaves_everything_consistent_and_a_retry_works(rig, mode):
    swapper, handle, data = rig
    handle.fail(swapper.store.extent("param", 2), "read", mode)
    if mode == "submit":
        with pytest.raises(OSError, match=r"read of shard 2 of kind 'param' .* Permission denied.*the next read of it tries again"):
            swapper.fetch("param", 2)
    else:
        first, second = swapper.fetch("param", 2), swapper.fetch("param", 2)
        for h in (first, second):  # both fetches that shared the read see it fail
            with pytest.raises(OSError, match=r"read of shard 2 of kind 'param' .* failed: Input/output error"):
                swapper.wait(h)
        with pytest.raises(ValueError, match="not fetched"):
            swapper.release("param", 2)  # a failed fetch holds nothing
    assert swapper.state("param", 2) is ShardState.NVME
    swapper.check_invariants()
    assert swapper.pool.num_free == 2
    assert torch.equal(read(swapper, 2), data[2])


def test_a_read_past_the_end_of_a_truncated_file(rig):
    # The real engine's error path: ENODATA, with path and offset, for a file cut short.
    swapper, _, data = rig
    extent = swapper.store.extent("param", 3)
    size = os.path.getsize(extent.path)
    os.truncate(extent.path, extent.offset + 100)
    with pytest.raises(OSError, match=r"read of shard 3 of kind 'param' .* failed: read past end of file") as info:
        swapper.wait(swapper.fetch("param", 3))
    assert info.value.errno == errno.ENODATA
    assert swapper.state("param", 3) is ShardState.NVME and swapper.pool.num_free == 2
    os.truncate(extent.path, size)
    swapper.wait(swapper.write("param", 3, data[3]))
    assert torch.equal(read(swapper, 3), data[3])
    assert_others_intact(swapper, data, bad=3)


FULL_DISK = """
    import json, resource, signal, sys, torch
    from infinity.offload.pool import BufferPool
    from infinity.offload.store import NvmeStore
    from infinity.offload.swapper import Swapper
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    sizes = {k: 65536 for k in range(4)}
    with NvmeStore(sys.argv[1], {"param": sizes}, job_id="full") as store:
        swapper = Swapper(store, BufferPool(2, 65536))
        for k in sizes:
            swapper.write("param", k, torch.full((65536,), k, dtype=torch.uint8))
        swapper.flush()
        limit = store.extent("param", 2).offset + 4096
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the disk is full from here on
        for k in sizes:
            buf = swapper.wait(swapper.fetch("param", k))
            buf.fill_(100 + k)
            swapper.release("param", k, dirty=True)
        try:
            swapper.flush()
            error = None
        except OSError as e:
            error = [e.errno, str(e)]
        states = [swapper.state("param", k).name for k in sizes]
        good = [int(swapper.wait(swapper.fetch("param", k))[0]) for k in (0, 1)]
        try:
            swapper.fetch("param", 2)
            refetch = None
        except OSError as e:
            refetch = str(e)
        print(json.dumps({"error": error, "states": states, "good": good, "refetch": refetch}))
"""


def test_a_full_disk_through_the_real_engine(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,  # not the source tree
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["error"][0] == errno.EFBIG
    assert "write of shard 2 of kind 'param'" in result["error"][1] and "and 1 more failed writes" in result["error"][1]
    assert result["states"] == ["NVME", "NVME", "INVALID", "INVALID"]
    assert result["good"] == [100, 101]
    assert "is invalid" in result["refetch"]
    assert os.listdir(tmp_path) == []
