"""Publishing checkpoints and exports: a kill at any rename leaves the old model or the new one,
never a mix; a full disk (a real ENOSPC from a small tmpfs) at any stage of a save or an export
leaves the previous state and no temporaries; what a process killed outright left is found and
removed by the next save and by `infinity clean`, and what a live one is writing is never
touched; checkpoints beyond `checkpoint.save_total_limit` are removed once a newer one is
published."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import infinity
from infinity.checkpoint.layout import LATEST

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


def _tree(directory) -> dict[str, bytes]:
    """Every file under `directory` (relative name -> bytes), hidden ones included."""
    out = {}
    for root, dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
        for name in dirs:
            if not os.listdir(os.path.join(root, name)):
                out[os.path.relpath(os.path.join(root, name), directory) + "/"] = b""
    return out


def _engine(layers: int = 2, save_total_limit=None):
    from gpt import TinyGPT, config
    cfg = config(3, "cpu", "cpu")
    if save_total_limit is not None:
        cfg["checkpoint"] = {"save_total_limit": save_total_limit}
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(layers=layers), config=cfg)
    return engine


def _steps(engine, n: int) -> None:
    from gpt import batches, engine_run
    engine_run(engine, batches(n, 4, seed=engine.global_steps + 1), gas=1)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


# ---- a multi-file export appears whole or not at all ---------------------------------------------

KILL_AT_EVERY_RENAME = r"""
import json, os, shutil, signal, sys
sys.path.insert(0, sys.argv[1])
import torch
from infinity.checkpoint.export import consolidate
try:
    from infinity.checkpoint import publish
except ImportError:  # before the fix there was none
    publish = None
ckpt, template, runs, mode = sys.argv[2:6]
if publish is not None and mode == "renames":  # a file system without RENAME_EXCHANGE
    def refuse(a, b):
        raise OSError(22, "Invalid argument")
    publish._exchange = refuse
if publish is not None and mode == "in_place":  # out_dir is a mount point: nothing can replace it
    publish._can_replace = lambda out_dir: False
calls = [0]
kill_at = [-1, -1]  # before call k + 1 (after k calls); and after the last of `total` calls
def counted(fn):
    def wrapped(*args, **kwargs):
        if calls[0] == kill_at[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        result = fn(*args, **kwargs)
        calls[0] += 1
        if calls[0] == kill_at[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapped
os.rename, os.replace = counted(os.rename), counted(os.replace)
if publish is not None:
    publish._exchange = counted(publish._exchange)
def export(k, total=-1):
    run = os.path.join(runs, str(k))
    shutil.copytree(template, run, symlinks=True)
    pid = os.fork()
    if pid == 0:
        kill_at[:] = [k, -1] if k < total else [-1, total]
        consolidate(ckpt, os.path.join(run, "out"), tag="global_step8", max_shard_size=25_000)
        with open(os.path.join(runs, "calls"), "w") as f:
            f.write(str(calls[0]))
        os._exit(0)
    return os.waitpid(pid, 0)[1]
status = [export(-1)]
total = int(open(os.path.join(runs, "calls")).read())
status += [export(k, total) for k in range(total + 1)]
print(json.dumps({"calls": total, "status": status}))
"""


def _loads(out) -> dict[str, torch.Tensor] | None:
    """What a reader finds in `out` (the index, else model.safetensors); None when nothing."""
    from infinity.checkpoint.pretrained import TensorIndex
    try:
        index = TensorIndex(str(out))
    except FileNotFoundError:
        return None
    return {name: index.read(name).clone() for name in index.where}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def two_states(tmp_path_factory):
    """A checkpoint directory with tags global_step2 and global_step8, the old export (step 2,
    5 shards, a file of the user's beside it) and the tensors of each."""
    from infinity.checkpoint.export import consolidate
    base = tmp_path_factory.mktemp("states")
    engine = _engine()
    _steps(engine, 2)
    engine.save_checkpoint(base / "ckpt")
    _steps(engine, 6)
    engine.save_checkpoint(base / "ckpt")
    engine.close()
    template = base / "template"
    consolidate(str(base / "ckpt"), str(template / "out"), tag="global_step2", max_shard_size=25_000)
    (template / "out" / "notes.txt").write_text("mine")
    consolidate(str(base / "ckpt"), str(base / "new"), tag="global_step8", max_shard_size=25_000)
    old, new = _loads(template / "out"), _loads(base / "new")
    assert len([n for n in os.listdir(template / "out") if n.endswith(".safetensors")]) >= 4
    assert not _same(old, new)
    return base, old, new


@pytest.mark.parametrize("mode", ["exchange", "renames", "in_place"])
def test_a_kill_at_any_rename_of_an_export_leaves_the_old_model_or_the_new_one(two_states, tmp_path, mode):
    """SIGKILL after every rename of a sharded export over an older one (the issue's
    consolidate): the directory holds the old model or the new one, whole, never shards of both.
    `exchange`: the old directory and the new one swap in one step. `renames`: a file system
    without it: old aside, new in; a kill between leaves no directory, and the next export or
    `infinity clean` puts the old one back. `in_place`: out_dir cannot be replaced (a mount
    point): the old index is withdrawn first, so a kill leaves nothing loadable, never a mix."""
    from infinity.apps.cli import main
    base, old, new = two_states
    runs = tmp_path / "runs"
    runs.mkdir()
    out = subprocess.run([sys.executable, "-c", KILL_AT_EVERY_RENAME, HERE, str(base / "ckpt"), str(base / "template"),
                          str(runs), mode], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"][0] == 0 and all(s == signal.SIGKILL for s in result["status"][1:]), result
    assert result["calls"] >= 1
    seen = []
    for k in range(result["calls"] + 1):
        found = _loads(runs / str(k) / "out")
        seen.append("nothing" if found is None else "old" if _same(found, old) else "new" if _same(found, new)
                    else "mix")
    assert set(seen) <= ({"old", "new"} if mode == "exchange" else {"old", "new", "nothing"}), seen
    assert seen[0] == ("nothing" if mode == "in_place" else "old") and seen[-1] == "new", seen
    for k in range(result["calls"] + 1):
        run = runs / str(k)
        assert main(["clean", str(run)]) == 0  # what the killed export left beside out, and out put back
        assert main(["clean", str(run / "out")]) == 0  # what it left inside (in place)
        found = _loads(run / "out")
        if mode == "in_place" and seen[k] == "nothing":
            assert found is None, k
        else:
            assert found is not None and (_same(found, old) or _same(found, new)), k
        assert (run / "out" / "notes.txt").read_text() == "mine"
        assert sorted(os.listdir(run)) == ["out"], (k, os.listdir(run))  # no staging directory left
        assert not [n for n in os.listdir(run / "out") if ".tmp-" in n or n.startswith(".")], k
    done = runs / "-1" / "out"
    assert _same(_loads(done), new) and (done / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(runs / "-1") if n != "out"]


def test_an_export_over_a_single_file_keeps_the_users_files(two_states, tmp_path):
    """A sharded export replaces a single-file one: the old file goes (it would shadow the
    shards), the user's files stay, links as links, with the directory's mode; this process's
    working directory, which was the old directory, follows to the new one."""
    from infinity.checkpoint.export import consolidate
    base, old, new = two_states
    out = tmp_path / "out"
    consolidate(str(base / "ckpt"), str(out), tag="global_step2")
    (out / "vocab.json").write_text("{}")
    (out / "link").symlink_to("vocab.json")
    os.chmod(out, 0o750)
    cwd = os.getcwd()
    os.chdir(out)
    try:
        consolidate(str(base / "ckpt"), ".", tag="global_step8", max_shard_size=25_000)
        assert os.path.samefile(os.getcwd(), out)  # not the removed old directory
        assert "model.safetensors" not in os.listdir(".")
    finally:
        os.chdir(cwd)
    assert _same(_loads(out), new)
    assert (out / "vocab.json").read_text() == "{}" and os.readlink(out / "link") == "vocab.json"
    assert os.stat(out).st_mode & 0o777 == 0o750
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_export_into_a_directory_with_subdirectories_is_published_in_place(two_states, tmp_path):
    """A directory holding more than files (a training run's output, with its checkpoints) is
    not rebuilt: the files are renamed into it, after the old export's entry points went."""
    from infinity.checkpoint.export import consolidate
    base, old, new = two_states
    out = tmp_path / "out"
    consolidate(str(base / "ckpt"), str(out), tag="global_step2", max_shard_size=25_000)
    shutil.copytree(base / "ckpt", out / "ckpt")
    inode = os.stat(out).st_ino
    consolidate(str(base / "ckpt"), str(out), tag="global_step8")  # one file now
    assert os.stat(out).st_ino == inode
    assert _same(_loads(out), new)
    assert sorted(os.listdir(out)) == ["ckpt", "model.safetensors"]
    assert _tree(out / "ckpt") == _tree(base / "ckpt")


# ---- a full disk at every stage ----------------------------------------------------------------------


class SmallDisk:
    """A tmpfs whose size is set to what it holds plus a budget: writes past it fail with a real
    ENOSPC from the kernel."""

    def __init__(self, path):
        self.path = path

    def used(self) -> int:
        s = os.statvfs(self.path)
        return (s.f_blocks - s.f_bfree) * s.f_frsize

    def reachable(self) -> int:
        total = 0
        for root, dirs, names in os.walk(self.path):
            total += sum(os.lstat(os.path.join(root, n)).st_blocks * 512 for n in dirs + names)
        return total

    def allow(self, nbytes: int) -> None:
        # A removed file's space comes back when its last descriptor closes, which an I/O thread
        # may do a moment after the failure was reported: wait for it, or the budget is off.
        for _ in range(500):
            if self.used() == self.reachable():
                break
            time.sleep(0.01)
        size = self.used() + nbytes
        subprocess.run(["mount", "-o", f"remount,size={max(size, 4096)}", str(self.path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _stage(filename: str) -> str:
    name = os.path.basename(filename)
    for stage in ("master", "exp_avg_sq", "exp_avg", "state", "buffers", "manifest", "latest"):
        if stage in name:
            return stage
    return name


def test_a_full_disk_at_any_stage_of_a_save_leaves_the_previous_checkpoint_and_no_temporaries(small_disk):
    """The budget grows a page at a time from nothing to what the save needs: every failure is
    ENOSPC naming the file being written (shards, small state, buffers, manifest, `latest`),
    and leaves the previous checkpoint and `latest` byte for byte with nothing beside them,
    except a failure at `latest`, which keeps the new tag whole and says that `latest` still
    names the previous one."""
    ckpt = small_disk.path / "ckpt"
    engine = _engine()
    try:
        _steps(engine, 2)
        engine.save_checkpoint(ckpt, tag="first")
        before = _tree(ckpt)
        _steps(engine, 1)
        stages = []
        for pages in range(0, 400):
            small_disk.allow(pages * 4096)
            try:
                engine.save_checkpoint(ckpt, tag="second")
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                assert e.filename and str(ckpt) in e.filename, e  # names the file
                stages.append(_stage(e.filename))
                if stages[-1] == "latest":
                    assert "second" in str(e) and "'first'" in str(e), e
                    assert (ckpt / LATEST).read_text() == "first\n"
                    after = _tree(ckpt)
                    assert {n for n in after if not n.startswith("second/")} == set(before), sorted(after)
                    from infinity.checkpoint.layout import Manifest
                    Manifest.read(str(ckpt / "second"))  # whole
                    shutil.rmtree(ckpt / "second")
                assert _tree(ckpt) == before, (pages, stages[-1], sorted(set(_tree(ckpt)) ^ set(before)))
            else:
                break
        else:
            pytest.fail("the save never fitted")
        assert (ckpt / LATEST).read_text() == "second\n"
        assert {"master", "state", "buffers", "manifest", "latest"} <= set(stages), sorted(set(stages))
    finally:
        engine.close()


def test_a_full_disk_at_any_stage_of_an_export_leaves_the_previous_export(small_disk, two_states):
    """consolidate over an earlier export on a disk that fills at every point in turn: each
    failure names the file, leaves the earlier export (and the user's file) byte for byte, no
    staging directory and no empty temporary (a failed safetensors header)."""
    from infinity.checkpoint.export import consolidate
    base, old, new = two_states
    out = small_disk.path / "out"
    shutil.copytree(base / "template" / "out", out)
    before = _tree(small_disk.path)
    for pages in range(0, 400):
        small_disk.allow(pages * 4096)
        try:
            consolidate(str(base / "ckpt"), str(out), tag="global_step8", max_shard_size=25_000)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            assert e.filename and str(small_disk.path) in e.filename, e
            assert _tree(small_disk.path) == before, (pages, sorted(set(_tree(small_disk.path)) ^ set(before)))
        else:
            break
    else:
        pytest.fail("the export never fitted")
    assert pages > 1
    assert _same(_loads(out), new) and (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(small_disk.path)) == ["out"]


def test_a_safetensors_header_that_does_not_fit_leaves_no_file(small_disk):
    from infinity.checkpoint.safetensors_io import StreamWriter
    path = small_disk.path / "model.safetensors"
    small_disk.allow(0)
    entries = [(f"layer{i}.weight", torch.float32, [1024, 1024]) for i in range(200)]  # a header of pages
    with pytest.raises(OSError) as failed:
        StreamWriter(str(path), entries).close()
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert os.listdir(small_disk.path) == []


# ---- leftovers of kill -9 --------------------------------------------------------------------------

KILLED_SAVE = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import torch, infinity
from gpt import TinyGPT, batches, config, engine_run
ckpt, where = sys.argv[2], sys.argv[3]
torch.manual_seed(0)
engine, *_ = infinity.initialize(TinyGPT(layers=2), config=config(3, "cpu", "cpu"))
engine_run(engine, batches(2, 4), gas=1)
if where == "writing":  # the extents of the save are on their way
    from infinity.checkpoint import files
    write = files.ExtentWriter.write
    def die(self, *a):
        write(self, *a)
        os.kill(os.getpid(), signal.SIGKILL)
    files.ExtentWriter.write = die
else:  # `latest` is written, not yet renamed into place
    replace = os.replace
    def die(src, dst):
        if dst.endswith("latest"):
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)
    os.replace = die
engine.save_checkpoint(ckpt, tag="second" if where == "latest" else where)
"""

KILLED_LOCK = r"""
import os, signal, sys
from infinity.offload import lock
link = os.link
def die(src, dst):
    link(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)  # the lock is published, its private name not yet removed
os.link = die
lock.DirectoryLock.take(os.path.join(sys.argv[1], "infinity-killed", "rank0"))
"""


def _kill(tmp_path, script: str, *args: str) -> None:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]


def _leftovers(ckpt) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.startswith(".") or ".tmp" in n)


def test_the_next_save_removes_what_a_killed_save_left_and_nothing_of_a_live_writer(tmp_path):
    ckpt = tmp_path / "ckpt"
    engine = _engine()
    try:
        _steps(engine, 1)
        engine.save_checkpoint(ckpt, tag="first")
        _kill(tmp_path, KILLED_SAVE, HERE, str(ckpt), "writing")
        assert [n for n in _leftovers(ckpt) if n.startswith(".writing.partial-")], _leftovers(ckpt)
        _kill(tmp_path, KILLED_SAVE, HERE, str(ckpt), "latest")  # a save of another tag, killed in its turn
        assert [n[:len("latest.tmp-")] for n in _leftovers(ckpt)] == ["latest.tmp-"], _leftovers(ckpt)
        assert (ckpt / LATEST).read_text() == "first\n"
        live = [f".x.partial-{socket.gethostname()}-{os.getpid()}", ".y.partial-another-host-1",
                f"latest.tmp-{socket.gethostname()}-1"]  # pid 1 lives as long as the machine
        os.mkdir(ckpt / live[0])
        os.mkdir(ckpt / live[1])
        (ckpt / live[2]).write_text("being written")
        engine.save_checkpoint(ckpt, tag="third")  # another tag
        assert _leftovers(ckpt) == sorted(live)
        assert (ckpt / LATEST).read_text() == "third\n"
    finally:
        engine.close()


def test_infinity_clean_finds_what_killed_saves_and_stores_left(tmp_path, capsys):
    from infinity.apps.cli import main
    ckpt = tmp_path / "ckpt"
    engine = _engine()
    _steps(engine, 1)
    engine.save_checkpoint(ckpt, tag="first")
    engine.close()
    _kill(tmp_path, KILLED_SAVE, HERE, str(ckpt), "writing")
    (ckpt / f"latest.tmp-{socket.gethostname()}-{_dead_pid()}").write_text("second\n")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    _kill(tmp_path, KILLED_LOCK, str(nvme))
    lock_tmp = [n for n in os.listdir(nvme / "infinity-killed") if n.endswith(".tmp")]
    assert lock_tmp, os.listdir(nvme / "infinity-killed")
    live = f".x.partial-{socket.gethostname()}-{os.getpid()}"
    os.mkdir(ckpt / live)
    first = _tree(ckpt / "first")

    assert main(["clean", str(ckpt), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert ".writing.partial" in said and "latest.tmp" in said and "in use" in said, said
    assert len(_leftovers(ckpt)) == 3
    assert main(["clean", str(ckpt)]) == 0
    assert "removed 2" in capsys.readouterr().out
    assert _leftovers(ckpt) == [live] and _tree(ckpt / "first") == first
    assert (ckpt / LATEST).read_text() == "first\n"

    assert main(["clean", str(nvme)]) == 0
    capsys.readouterr()
    assert not os.path.exists(nvme / "infinity-killed")  # the stale store and its lock's private name


def test_clean_leaves_a_private_lock_name_of_a_live_writer(tmp_path):
    from infinity.offload.lock import remove_stale
    job = tmp_path / "infinity-job"
    job.mkdir()
    mine = job / f"rank0.lock.{socket.gethostname()}.{os.getpid()}.tmp"
    foreign = job / f"rank1.lock.another-host.{_dead_pid()}.tmp"
    dead = job / f"rank2.lock.{socket.gethostname()}.{_dead_pid()}.tmp"
    for path in (mine, foreign, dead):
        path.write_text("{}")
    remove_stale(str(tmp_path), "infinity-*/rank*")
    assert sorted(os.listdir(job)) == sorted([mine.name, foreign.name])


# ---- checkpoints kept: the last N -------------------------------------------------------------------


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    engine = _engine(save_total_limit=2)
    try:
        (ckpt / "notes").mkdir(parents=True)  # not a checkpoint: never removed
        engine.save_checkpoint(tmp_path / "other", tag="elsewhere")
        (ckpt / "linked").symlink_to(tmp_path / "other" / "elsewhere")  # the oldest, but a link of the user's
        for _ in range(4):
            _steps(engine, 1)
            engine.save_checkpoint(ckpt)
            assert (ckpt / LATEST).read_text() == f"global_step{engine.global_steps}\n"
        assert sorted(os.listdir(ckpt)) == ["global_step3", "global_step4", "latest", "linked", "notes"]
        engine.save_checkpoint(ckpt, tag="kept", save_latest=False)  # newer, but `latest` names global_step4
        assert sorted(os.listdir(ckpt)) == ["global_step4", "kept", "latest", "linked", "notes"]
        _steps(engine, 1)
        engine.save_checkpoint(ckpt, tag="global_step3")  # a re-save counts as the newest
        assert sorted(os.listdir(ckpt)) == ["global_step3", "kept", "latest", "linked", "notes"]
        assert (tmp_path / "other" / "elsewhere" / "manifest.json").is_file()
    finally:
        engine.close()
    engine = _engine(save_total_limit=2)
    try:
        _, client = engine.load_checkpoint(ckpt)
        assert engine.global_steps == 5
    finally:
        engine.close()


@pytest.mark.slow  # a variant of the killed save above, with save_total_limit
def test_a_kill_during_a_save_with_a_limit_leaves_every_tag(tmp_path):
    ckpt = tmp_path / "ckpt"
    engine = _engine(save_total_limit=2)
    try:
        for _ in range(2):
            _steps(engine, 1)
            engine.save_checkpoint(ckpt)
        before = _tree(ckpt)
        limit_config = KILLED_SAVE.replace('config(3, "cpu", "cpu")',
                                           '{**config(3, "cpu", "cpu"), "checkpoint": {"save_total_limit": 2}}')
        _kill(tmp_path, limit_config, HERE, str(ckpt), "writing")
        _kill(tmp_path, limit_config, HERE, str(ckpt), "latest")
        after = _tree(ckpt)
        assert {n: v for n, v in after.items() if n.split("/")[0] in ("global_step1", "global_step2", LATEST)} == before
        assert (ckpt / LATEST).read_text() == "global_step2\n"
    finally:
        engine.close()


def test_a_bad_save_total_limit_is_named():
    with pytest.raises((TypeError, ValueError), match="checkpoint.save_total_limit"):
        _engine(save_total_limit=0)


# ---- misuse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n", "..\n", "a/b\n"])
def test_a_latest_that_names_no_tag_is_named(tmp_path, content):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LATEST).write_text(content)
    engine = _engine()
    try:
        with pytest.raises(ValueError, match=f"{ckpt / LATEST}: holds {content.strip()!r}"):
            engine.load_checkpoint(ckpt)
    finally:
        engine.close()


def test_a_half_loaded_engine_exports_nothing(tmp_path):
    """After a load that failed part way, the weights are a mix of the checkpoint's and the
    model's own: consolidated_state_dict, state_dict (save_pretrained's source) and
    save_16bit_model refuse, as save_checkpoint does, until a load succeeds."""
    from infinity.checkpoint.layout import shard_file
    engine = _engine()
    _steps(engine, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    path = tmp_path / "ckpt" / "global_step2" / shard_file(0, "exp_avg")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1  # the last unit's extent: the units before it are loaded already
    path.write_bytes(bytes(raw))
    engine = _engine()
    try:
        with pytest.raises(Exception, match="checksum mismatch"):
            engine.load_checkpoint(tmp_path / "ckpt")
        for refused in (engine.consolidated_state_dict, engine.module.state_dict, engine.module.blocks[0].state_dict,
                        lambda: engine.save_16bit_model(tmp_path / "out")):
            with pytest.raises(RuntimeError, match="load_checkpoint failed part way"):
                refused()
        assert not (tmp_path / "out").exists()
        raw[-100] ^= 1
        path.write_bytes(bytes(raw))
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.consolidated_state_dict().keys() == engine.module.state_dict().keys()
    finally:
        engine.close()
