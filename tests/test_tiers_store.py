"""NvmeStore: layout and alignment, the directory lock, stale directories, free space, cleanup."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from infinity.io import PAGE_SIZE
from infinity.offload.store import MiB, NvmeStore, default_job_id

LAYOUT = {"param": {0: 5000, 1: 3 * MiB, 2: 100}, "exp_avg": {"a": 8192}}


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "nvme"
    path.mkdir()
    return str(path)


def start_child(body: str, *args: str) -> subprocess.Popen:
    """A Python child running `body` with sys.argv[1:] = args; use it in a `with` block."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tempfile.gettempdir(),  # not the source tree: the child must import the built package
    )


def stop(child: subprocess.Popen, signum: int = signal.SIGKILL) -> str:
    """Sends `signum` and waits for the child; returns its stderr."""
    child.send_signal(signum)
    return child.communicate(timeout=60)[1]


OPEN_AND_SLEEP = """
    import sys, time
    from infinity.offload.store import NvmeStore
    store = NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id=sys.argv[2])
    print(store.directory, flush=True)
    time.sleep(120)
"""


def test_layout_and_files(root):
    with NvmeStore(root, LAYOUT, job_id="j", rank=3) as store:
        assert store.directory == os.path.join(root, "infinity-j", "rank3")
        assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(store.directory)).st_mode) == 0o700
        assert store.kinds == ("param", "exp_avg") and list(store.keys("param")) == [0, 1, 2]
        extents = [store.extent("param", k) for k in (0, 1, 2)]
        assert [e.offset for e in extents] == [0, MiB, 4 * MiB]  # the 3 MiB shard starts on a MiB
        for e in extents:
            assert e.offset % PAGE_SIZE == 0 and e.capacity % PAGE_SIZE == 0 and e.capacity >= e.nbytes
            assert e.path == store.file_path("param") == os.path.join(store.directory, "param.bin")
        for a, b in zip(extents, extents[1:]):
            assert a.offset + a.capacity <= b.offset
        for kind in store.kinds:
            st = os.stat(store.file_path(kind))
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_blocks * 512 >= st.st_size  # preallocated, not sparse
        assert store.bytes_total == 4 * MiB + PAGE_SIZE + 8192
        with pytest.raises(KeyError, match="no shard 9 of kind 'param'"):
            store.extent("param", 9)
        with pytest.raises(KeyError, match="no kind 'grad'"):
            store.extent("grad", 0)
    assert store.closed and os.listdir(root) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layout": {}}, ValueError, "layout"),
        ({"layout": {"a/b": {0: 1}}}, ValueError, "kind names a file"),
        ({"layout": {"param": {0: 0}}}, ValueError, r"layout\['param'\]\[0\]"),
        ({"job_id": "../x"}, ValueError, "job_id"),
        ({"rank": -1}, ValueError, "rank"),
    ],
)
def test_argument_errors(root, kwargs, error, match):
    args = {"layout": LAYOUT, **kwargs}
    with pytest.raises(error, match=match):
        NvmeStore(root, args.pop("layout"), **args)
    assert os.listdir(root) == []


def test_a_missing_nvme_path_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.nvme_path: directory does not exist"):
        NvmeStore(tmp_path / "missing", LAYOUT, name="offload_optimizer")


def test_too_little_free_space_is_an_error_before_anything_is_written(root):
    with pytest.raises(OSError, match=r"offload_param\.nvme_path: the offloaded shards need 4\.0 PiB") as info:
        NvmeStore(root, {"param": {0: 1 << 52}}, job_id="big")
    assert info.value.errno == errno.ENOSPC
    assert re.search(r"need \S+ \S+ \(4503599627370496 bytes\) .* only \S+ \S+ \(\d+ bytes\) is free", str(info.value))
    assert os.listdir(root) == []  # no directory, no lock, no file left behind


def test_two_stores_never_share_a_directory(root):
    with NvmeStore(root, LAYOUT, job_id="j") as first:
        with NvmeStore(root, LAYOUT, job_id="j") as second:  # this process's: one beside it
            assert second.directory == first.directory + ".1"
        with NvmeStore(root, LAYOUT, job_id="j", rank=1), NvmeStore(root, {"master": {0: 1}}, job_id="k"):
            pass  # other ranks and jobs, and several stores in one process, are fine
        assert os.path.isdir(first.directory)
    assert os.listdir(root) == []


OPEN_TWO_AND_SLEEP = """
    import sys, time
    from infinity.offload.store import NvmeStore
    stores = [NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id=sys.argv[2]) for _ in range(2)]
    print(*(s.directory for s in stores), flush=True)
    time.sleep(120)
"""


def test_stores_of_one_process_on_one_path_each_keep_their_own_bytes(root):
    """[Note: stores of one process]: a second store of the same job and rank opens beside a live
    one (a second engine), and opening or closing one never touches the other's bytes."""
    first = NvmeStore(root, LAYOUT, job_id="j")
    second = NvmeStore(root, LAYOUT, job_id="j")
    assert second.directory == first.directory + ".1"
    for store, fill in ((first, b"\x11"), (second, b"\x22")):
        with open(store.file_path("param"), "r+b") as f:
            f.write(fill * 5000)
    third = NvmeStore(root, LAYOUT, job_id="j")
    assert third.directory == first.directory + ".2"
    second.close()
    assert not os.path.exists(second.directory)
    with open(first.file_path("param"), "rb") as f:
        assert f.read(5000) == b"\x11" * 5000  # the earlier store's bytes survive the later ones
    again = NvmeStore(root, LAYOUT, job_id="j")
    assert again.directory == second.directory  # the free name is taken again, fresh
    with open(again.file_path("param"), "rb") as f:
        assert f.read(5000) != b"\x22" * 5000
    first.close()
    assert not os.path.exists(first.directory) and os.path.isdir(third.directory) and os.path.isdir(again.directory)
    del third, again
    gc.collect()
    assert os.listdir(root) == []


def test_a_dead_processs_stores_beside_each_other_are_removed_and_a_live_ones_refused(root):
    with start_child(OPEN_TWO_AND_SLEEP, root, "victim") as child:
        try:
            directories = child.stdout.readline().split()
            assert directories[1] == directories[0] + ".1" and all(map(os.path.isdir, directories))
            with pytest.raises(OSError, match=re.escape(directories[0]) + f" is in use by process {child.pid}.*"
                               "another job uses it") as info:
                NvmeStore(root, LAYOUT, job_id="victim")  # not stepped around: another process's
            assert info.value.errno == errno.EBUSY
        finally:
            stop(child)
    assert all(map(os.path.isdir, directories))  # SIGKILL: nothing ran in the child
    with NvmeStore(root, LAYOUT, job_id="next") as store:
        assert os.listdir(root) == [os.path.basename(os.path.dirname(store.directory))]


def test_a_directory_of_a_live_process_is_an_error_and_of_a_dead_one_is_removed(root):
    with start_child(OPEN_AND_SLEEP, root, "victim") as child:
        try:
            directory = child.stdout.readline().strip()
            assert os.path.isdir(directory)
            with pytest.raises(OSError, match=re.escape(directory) + f" is in use by process {child.pid}"):
                NvmeStore(root, LAYOUT, job_id="victim")
            with NvmeStore(root, LAYOUT, job_id="bystander"):
                assert os.path.isdir(directory)  # a live job's directory is left alone
        finally:
            stop(child)
    assert os.path.isdir(directory)  # SIGKILL: nothing ran in the child
    with NvmeStore(root, LAYOUT, job_id="next") as store:
        assert not os.path.exists(os.path.dirname(directory))
        assert os.listdir(root) == [os.path.basename(os.path.dirname(store.directory))]


def test_the_same_job_restarted_after_a_crash_takes_its_directory_over(root):
    with start_child(OPEN_AND_SLEEP, root, "j") as child:
        directory = child.stdout.readline().strip()
        stop(child)
    with NvmeStore(root, LAYOUT, job_id="j") as store:
        assert store.directory == directory and sorted(os.listdir(directory)) == ["exp_avg.bin", "param.bin"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_removes_the_directory(root, signum):
    with start_child(OPEN_AND_SLEEP, root, "sig") as child:
        directory = child.stdout.readline().strip()
        assert os.path.isdir(directory)
        stderr = stop(child, signum)
    if signum == signal.SIGTERM:
        assert child.returncode == -signal.SIGTERM  # passed on: the parent sees the signal
    else:
        assert "KeyboardInterrupt" in stderr
    assert os.listdir(root) == []


OPENING_CASES = [("first of the process", "posix_fallocate"), ("beside an open store", "posix_fallocate"),
                 ("beside an open store", "mkdir"), ("at a kept directory", "mkdir"),
                 ("to keep", "posix_fallocate"), ("for activations", "mkdir")]

# Each case in a process of its own, forked from one that imported infinity once (and opened no
# store, so each case starts with the signal dispositions of a fresh process): a line per case,
# with how the case's process ended and what it left under its root.
SIGNAL_WHILE_OPENING = """
    import json, os, signal, sys
    from infinity.offload.store import NvmeDirectory, NvmeStore

    def opens(root, when, at):
        if when == "beside an open store":
            first = NvmeStore(root, {"param": {0: 4096}}, job_id="first")
        if when == "at a kept directory":
            NvmeStore(root, {"param": {0: 4096}}, job_id="j", keep=True).close()
        real = getattr(os, at)

        def signalled(path, *args):
            try:
                return real(path, *args)
            finally:  # a real SIGTERM as the call ends: its handler runs before the caller's next line
                if at == "posix_fallocate" or str(path).endswith("rank0"):
                    os.kill(os.getpid(), signal.SIGTERM)

        setattr(os, at, signalled)
        if when == "for activations":
            NvmeDirectory(root, job_id="j", key="activation_checkpointing.nvme_path")
        else:
            NvmeStore(root, {"param": {0: 4096}, "master": {0: 8192}}, job_id="j", keep=when == "to keep")

    for i, (when, at) in enumerate(json.loads(sys.argv[2])):
        root = os.path.join(sys.argv[1], str(i))
        os.mkdir(root)
        pid = os.fork()
        if pid == 0:
            opens(root, when, at)
            os._exit(0)  # it lived on
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        left = [os.path.relpath(os.path.join(d, f), root) for d, ds, fs in os.walk(root) for f in ds + fs]
        print(json.dumps([when, at, status, sorted(left)]), flush=True)
"""


@pytest.fixture(scope="module")
def signalled_while_opening(tmp_path_factory):
    root = tmp_path_factory.mktemp("opening")
    with start_child(SIGNAL_WHILE_OPENING, str(root), json.dumps(OPENING_CASES)) as child:
        stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    return {(when, at): (status, left) for when, at, status, left in map(json.loads, stdout.splitlines())}


@pytest.mark.parametrize("when,at", OPENING_CASES)
def test_a_signal_while_a_store_opens_leaves_nothing_behind(signalled_while_opening, when, at):
    # A SIGTERM that arrives after a store claimed its directory, as it makes the directory or
    # its files (the default disposition still in place for the first store, or the handler of
    # an open one not knowing the new one), left the claim and the files behind, as kill -9 does.
    # A store to keep (keep=True) is kept only once it opened: half made, it would be a kept
    # directory without its files.
    status, left = signalled_while_opening[when, at]
    assert status == -signal.SIGTERM  # died of it, as without us
    if when == "at a kept directory":  # never ours to remove: it stays, with its file, unclaimed
        assert left == ["infinity-j", "infinity-j/rank0", "infinity-j/rank0/param.bin"]
    else:
        assert left == []


def test_ctrl_c_as_a_store_makes_its_directory_leaves_nothing_behind(root):
    # Python's own SIGINT handler: the KeyboardInterrupt comes as mkdir returns, before the store
    # marked the directory as made, and the failed open left it behind without its lock (a
    # directory that blocked the job id as a kept one).
    body = """
        import os, signal, sys
        from infinity.offload.store import NvmeStore
        real = os.mkdir

        def interrupted(path, *args):
            try:
                return real(path, *args)
            finally:
                if str(path).endswith("rank0"):
                    os.kill(os.getpid(), signal.SIGINT)

        os.mkdir = interrupted
        try:
            NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id="j")
        except KeyboardInterrupt:
            print(os.listdir(sys.argv[1]), flush=True)
    """
    with start_child(body, root) as child:
        stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0 and stdout == "[]\n", stdout + stderr


def test_exit_paths_in_one_child(root):
    # A forked child (a DataLoader worker) closing the store does not remove its parent's
    # directory; a user's own SIGTERM handler runs with the stores intact (it may save a
    # checkpoint from them: [Note: cleanup on exit]); the normal exit after it removes them.
    body = """
        import os, signal, sys
        from infinity.offload.store import NvmeStore
        signal.signal(signal.SIGTERM, lambda *a: print("user handler", flush=True))
        store = NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id="a")
        pid = os.fork()
        if pid == 0:
            store.close()
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)  # not sys.exit: the I/O engine's threads do not survive a fork
        os.waitpid(pid, 0)
        print("after fork", os.path.isdir(store.directory), flush=True)
        other = NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id="b")
        os.kill(os.getpid(), signal.SIGTERM)
        print("after signal", os.path.isdir(store.directory), os.path.isdir(other.directory), flush=True)
        again = NvmeStore(sys.argv[1], {"param": {0: 4096}}, job_id="c")
    """
    with start_child(body, root) as child:
        stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert stdout.split("\n")[:4] == ["user handler", "after fork True", "user handler", "after signal True True"]
    assert os.listdir(root) == []  # all three went at normal exit


def test_keep(root, caplog):
    store = NvmeStore(root, LAYOUT, job_id="ckpt", keep=True)
    with caplog.at_level(logging.WARNING, logger="infinity.offload.store"):
        store.close()
        store.close()  # idempotent
    message = f"kept {store.directory} (keep=True); remove it when it is no longer needed"
    assert [r.getMessage() for r in caplog.records] == [message]
    assert sorted(os.listdir(store.directory)) == ["exp_avg.bin", "param.bin"]
    with NvmeStore(root, LAYOUT, job_id="other"):
        assert os.path.isdir(store.directory)  # a kept directory is not stale
    with pytest.raises(OSError, match="was kept by an earlier run"):
        NvmeStore(root, LAYOUT, job_id="ckpt")
    assert os.path.isdir(store.directory)


def test_garbage_collection_removes_the_directory(root):
    store = NvmeStore(root, LAYOUT, job_id="gc")
    directory = store.directory
    del store
    gc.collect()
    assert not os.path.exists(directory) and os.listdir(root) == []


def test_default_job_id(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert default_job_id() == str(os.getpid())
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert default_job_id() == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run/1")
    assert default_job_id() == "run_1"
