"""`NvmeStore`: the files on NVMe that hold every shard of one job and rank.

[Note: file layout]
    <nvme_path>/infinity-<job id>/rank<r>.lock   the claim ([Note: directory lock] in lock.py)
    <nvme_path>/infinity-<job id>/rank<r>/       mode 0700
        <kind>.bin                               one file per kind: param, master, exp_avg, ...
    <nvme_path>/infinity-<job id>/rank<r>.<n>/   the same, for a store opened beside a live one
                                                 of the same process ([Note: stores of one process])
A file holds the shards of its kind back to back, in the order the layout lists them (the
engine lists them in order of use, so a sweep reads the file front to back). Each shard owns a
fixed extent, allocated once when the store opens and overwritten in place for the rest of the
run: large sequential extents rather than thousands of small files, and on ext4 writing into
fresh extents runs at about half the speed of overwriting allocated ones (measured here with
1 MiB O_DIRECT writes: sparse 0.4-2.3 GB/s, fallocate()d 3.3 GB/s, overwrite 5 GB/s).

[Note: extent alignment]
Every extent starts on a page (O_DIRECT needs it) and shards of 1 MiB or more on a MiB, so the
I/O engine's block_size pieces line up with the file system's allocation. An extent's capacity
is its size rounded up to a page, and the pool's buffers are whole pages too, so the swapper
can move whole pages with no bounce buffer; the few padding bytes carry no meaning.

[Note: cleanup on exit]
A store removes its directory when closed, when garbage-collected and at interpreter exit
(weakref.finalize): never while the user's code can still reach it. The fp32 masters and Adam
moments in it exist nowhere else, so a signal handler of the user's (a preemption handler that
saves a checkpoint) always runs first and finds them: infinity installs a handler only for a
signal whose disposition is still the default, to die of (SIGTERM when nobody handles it, and
SIGINT where it is not Python's KeyboardInterrupt, which already ends in the exit path). That
handler removes every open store and then dies of the signal as the default would have; a
handler installed later replaces it, and then the exit path cleans up. A process killed
outright (SIGKILL, OOM killer) leaves its directory behind; the next store opened under the
same nvme_path finds it (its lock is free) and removes it, and `infinity clean NVME_PATH` lists
and removes such leftovers by hand. `keep=True` keeps the directory, with a message, and drops
the lock; a kept directory is never removed automatically and cannot be opened again as a new
store.

[Note: stores of one process]
A process may hold several stores of one job and rank on one nvme_path at once: a second engine
(Lightning's `trainer.test(model, ckpt_path=...)` on a new model while the fitted model's engine
lives, a model evaluated beside the one in training) opens its own. The first takes `rank<r>`;
one opened while a store of this same process holds that name takes `rank<r>.1`, the next free
`rank<r>.<n>` after it, each with its own lock, claimed and cleaned by the rules of [Note:
directory lock] like any other: a scan judges a directory by its flock alone, and a live store of
this process holds its flock as one of another process does, so no store ever removes a sibling
(each goes when it is closed or collected). Another process's `rank<r>` is still refused, not
stepped around: two processes of one job and rank are a launch mistake.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import threading
import weakref
from collections.abc import Callable, Hashable, KeysView, Mapping
from numbers import Integral
from typing import Any, NamedTuple

from infinity.io import PAGE_SIZE, AsyncIOHandle
from infinity.offload._messages import config_key, human_bytes
from infinity.offload.lock import DirectoryLock, owner, remove_stale, rmdir_if_empty
from infinity.offload.pool import round_up

logger = logging.getLogger(__name__)

MiB = 1 << 20
_KIND = re.compile(r"[A-Za-z0-9_]+")
_JOB_ID = re.compile(r"[A-Za-z0-9._-]+")


class Extent(NamedTuple):
    """Where one shard lives on NVMe."""

    path: str  # the kind's file
    offset: int  # byte offset in the file; a multiple of PAGE_SIZE ([Note: extent alignment])
    nbytes: int  # the shard's size
    capacity: int  # bytes reserved: nbytes rounded up to a page


def default_job_id() -> str:
    """The launcher's job id (torchrun, Slurm), so every rank of a job shares a directory; else the pid."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":
            return re.sub(r"[^A-Za-z0-9._-]", "_", value)
    return str(os.getpid())


class NvmeStore:
    """Preallocated files under `<nvme_path>/infinity-<job_id>/rank<rank>/` holding every shard.

    Args:
        nvme_path: an existing directory on the NVMe drive (`zero_optimization.<name>.nvme_path`).
        layout: kind ("param", "master", "exp_avg", "exp_avg_sq", "grad", ...) -> {shard key:
            bytes}. Every shard gets its extent now; the order is the order on disk.
        job_id: names the job directory; default: the launcher's job id, else the pid.
        rank: this process's rank; each rank has its own directory.
        keep: keep the directory on close (e.g. for a checkpoint) instead of removing it.
        handle: the I/O handle transfers go through; default: a new `AsyncIOHandle()`.
        name: the config section, for messages (e.g. "offload_param").

    Opening removes stale directories under nvme_path ([Note: cleanup on exit]), claims this
    one ([Note: directory lock]), checks free space, then preallocates the files, all before
    the first byte of a shard is written.
    """

    _extents: dict[str, dict[Hashable, Extent]]  # kind -> key -> extent
    _lock: DirectoryLock
    _finalizer: weakref.finalize  # removes (or keeps) the directory once: close, GC, exit, signal

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        layout: Mapping[str, Mapping[Hashable, int]],
        *,
        job_id: str | None = None,
        rank: int = 0,
        keep: bool = False,
        handle: AsyncIOHandle | None = None,
        name: str = "offload_param",
    ) -> None:
        self._name = name
        root = _check_nvme_path(config_key(name, "nvme_path"), nvme_path)
        job_id = default_job_id() if job_id is None else job_id
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id: expected letters, digits, '.', '_' or '-', got {job_id!r}")
        if isinstance(rank, bool) or not isinstance(rank, Integral) or rank < 0:
            raise ValueError(f"rank: expected a non-negative int, got {rank!r}")
        if not isinstance(keep, bool):
            raise TypeError(f"keep: expected a bool, got {keep!r}")
        _plan("", layout)  # the layout's errors before anything is created
        self._handle = handle if handle is not None else AsyncIOHandle()

        for directory in remove_stale(root, "infinity-*/rank*"):
            logger.warning("removed %s, left by a process that no longer runs", directory)
        _install_signal_cleanup()  # [Note: a signal while a store opens]
        self._lock = _claim(os.path.join(root, f"infinity-{job_id}", f"rank{int(rank)}"), config_key(name, "nvme_path"))
        self._directory = self._lock.directory

        def make(opening: _Opening) -> None:
            self._files, self._extents = _plan(self._directory, layout)
            self._create_files(opening)

        self._finalizer = _open_claimed(self, self._lock, keep, make)

    # ---- what is where -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The config section it stores (e.g. "offload_param")."""
        return self._name

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def handle(self) -> AsyncIOHandle:
        return self._handle

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._extents)

    def keys(self, kind: str) -> KeysView[Hashable]:
        return self._kind(kind).keys()

    def extent(self, kind: str, key: Hashable) -> Extent:
        """(path, offset, nbytes, capacity) of one shard."""
        extents = self._kind(kind)
        try:
            return extents[key]
        except KeyError:
            raise KeyError(f"no shard {key!r} of kind {kind!r} in the store at {self._directory}") from None

    def file_path(self, kind: str) -> str:
        self._kind(kind)
        return self._files[kind][0]

    @property
    def bytes_total(self) -> int:
        """Bytes preallocated on NVMe, all files together."""
        return sum(size for _, size in self._files.values())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- life cycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Removes the directory (or keeps it, with a message, when `keep` was given). Idempotent.

        Transfers still in flight on these files must be waited for first (close the swapper).
        """
        self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{human_bytes(self.bytes_total)} in {len(self._files)} files"
        return f"NvmeStore({self._directory!r}, {state})"

    def _kind(self, kind: str) -> dict[Hashable, Extent]:
        try:
            return self._extents[kind]
        except KeyError:
            known = ", ".join(self._extents)
            raise KeyError(f"no kind {kind!r} in the store at {self._directory} (has {known})") from None

    def _create_files(self, opening: _Opening) -> None:
        """Creates the directory and preallocates every file, after checking there is room."""
        try:
            os.mkdir(self._directory, 0o700)
            opening.made = True
        except FileExistsError:
            raise OSError(
                errno.EEXIST,
                f"{config_key(self._name, 'nvme_path')}: {self._directory} was kept by an earlier run "
                f"(keep=True); remove it or use another job id",
                self._directory,
            ) from None
        try:
            os.chmod(self._directory, 0o700)
            self._check_free_space()
            for path, size in self._files.values():
                try:
                    _preallocate(path, size)
                except OSError as e:
                    raise OSError(
                        e.errno, f"{config_key(self._name, 'nvme_path')}: cannot preallocate {size} bytes "
                        f"for {path}: {e.strerror}", path,
                    ) from e
        except BaseException:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise

    def _check_free_space(self) -> None:
        st = os.statvfs(self._directory)
        free = st.f_bavail * st.f_frsize
        needed = self.bytes_total
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"{config_key(self._name, 'nvme_path')}: the offloaded shards need {human_bytes(needed)} "
                f"({needed} bytes) in {self._directory} but only {human_bytes(free)} ({free} bytes) is free; "
                "free space (`infinity clean DIR` lists and removes what runs killed outright left under "
                "DIR), or point nvme_path at a larger drive",
                self._directory,
            )


class NvmeDirectory:
    """A claimed, private directory `<nvme_path>/infinity-<job_id>/rank<rank>[.<n>]/` for files
    whose sizes are not known up front (checkpointed activations), under the rules of a store:
    stale ones removed first, the lock, removal on close, garbage collection, exit or a signal
    ([Note: cleanup on exit], [Note: stores of one process]). `key` names the setting in errors."""

    def __init__(self, nvme_path: str | os.PathLike, *, job_id: str, rank: int = 0, key: str) -> None:
        root = _check_nvme_path(key, nvme_path)
        if not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id: expected letters, digits, '.', '_' or '-', got {job_id!r}")
        for directory in remove_stale(root, "infinity-*/rank*"):
            logger.warning("removed %s, left by a process that no longer runs", directory)
        _install_signal_cleanup()  # [Note: a signal while a store opens]
        lock = _claim(os.path.join(root, f"infinity-{job_id}", f"rank{int(rank)}"), key)

        def make(opening: _Opening) -> None:
            os.mkdir(lock.directory, 0o700)
            opening.made = True

        self._finalizer = _open_claimed(self, lock, False, make)
        self.directory = lock.directory

    def close(self) -> None:
        """Removes the directory and what is in it (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def _check_nvme_path(key: str, nvme_path: Any) -> str:
    if not isinstance(nvme_path, (str, os.PathLike)):
        raise TypeError(f"{key}: expected a path, got {nvme_path!r}")
    root = os.path.abspath(os.fspath(nvme_path))
    if not os.path.isdir(root):
        raise ValueError(f"{key}: directory does not exist: {root}")
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{key}: cannot create files in {root}", root)
    return root


def _claim(directory: str, key: str) -> DirectoryLock:
    """The lock of `directory`, or of the first `<directory>.<n>` free when a store of this
    process holds it ([Note: stores of one process]); `key` names the setting in errors."""
    candidate = directory
    for n in range(1, 1 << 16):
        try:
            return DirectoryLock.take(candidate)
        except OSError as e:
            if e.errno == errno.EBUSY and owner(candidate + ".lock").get("pid") == os.getpid():
                candidate = f"{directory}.{n}"
                continue
            if e.errno == errno.EBUSY:
                hint = "another job uses it: give this one another nvme_path, or stop that job"
            else:
                hint = f"cannot create the store's directory under {os.path.dirname(os.path.dirname(directory))}: " \
                       "nvme_path must be a writable directory"
            raise OSError(e.errno, f"{key}: {e.strerror}; {hint}", e.filename) from None
    raise AssertionError("unreachable: 65535 stores of one process under one job and rank")


def _plan(
    directory: str, layout: Mapping[str, Mapping[Hashable, int]]
) -> tuple[dict[str, tuple[str, int]], dict[str, dict[Hashable, Extent]]]:
    """kind -> (file path, size) and kind -> key -> extent ([Note: extent alignment])."""
    if not isinstance(layout, Mapping) or not layout:
        raise ValueError(f"layout: expected a non-empty mapping kind -> {{key: nbytes}}, got {layout!r}")
    files: dict[str, tuple[str, int]] = {}
    extents: dict[str, dict[Hashable, Extent]] = {}
    for kind, shards in layout.items():
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise ValueError(f"layout: a kind names a file; expected letters, digits or '_', got {kind!r}")
        if not isinstance(shards, Mapping):
            raise TypeError(f"layout[{kind!r}]: expected a mapping key -> nbytes, got {type(shards).__name__}")
        path = os.path.join(directory, f"{kind}.bin")
        end = 0
        placed: dict[Hashable, Extent] = {}
        for key, nbytes in shards.items():
            if isinstance(nbytes, bool) or not isinstance(nbytes, Integral) or nbytes <= 0:
                raise ValueError(f"layout[{kind!r}][{key!r}]: expected a positive number of bytes, got {nbytes!r}")
            offset = round_up(end, MiB if nbytes >= MiB else PAGE_SIZE)
            placed[key] = Extent(path, offset, int(nbytes), round_up(int(nbytes), PAGE_SIZE))
            end = offset + placed[key].capacity
        files[kind] = (path, end)
        extents[kind] = placed
    return files, extents


def _preallocate(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


class _Opening:
    """How far a store got in opening ([Note: a signal while a store opens])."""

    __slots__ = ("made", "done")

    def __init__(self) -> None:
        self.made = False  # it made its directory
        self.done = False  # its files are all there: only then is it kept (keep=True)


def _open_claimed(owner: object, lock: DirectoryLock, keep: bool,
                  make: Callable[[_Opening], None]) -> weakref.finalize:
    """Makes a claimed directory and what is in it (`make`) for `owner`, cleaned up from the claim
    on ([Note: a signal while a store opens]); returns the finalizer that ends it (`_finish`). If
    `make` fails, the claim is given up, leaving a directory of that name that was there before."""
    opening = _Opening()
    finalizer = weakref.finalize(owner, _finish, lock, keep, opening)
    _track(finalizer)
    try:
        make(opening)
    except BaseException:
        finalizer.detach()
        rmdir_if_empty(lock.directory)  # made just before an interrupt marked it made
        lock.release()  # not remove(): a kept directory we refused to reuse must survive
        rmdir_if_empty(os.path.dirname(lock.directory))
        raise
    opening.done = True
    return finalizer


def _finish(lock: DirectoryLock, keep: bool, opening: _Opening) -> None:
    """The one way a store ends: remove its directory, or keep it and say where it is."""
    if not lock.held:
        return  # a forked child: the directory is its parent's
    if not opening.made:
        # Signalled while opening: a directory of that name is not ours (one an earlier run
        # kept), or it is empty (made just now), which rmdir alone removes.
        rmdir_if_empty(lock.directory)
        lock.release()
        rmdir_if_empty(os.path.dirname(lock.directory))
        return
    if keep and opening.done:
        lock.release()
        logger.warning("kept %s (keep=True); remove it when it is no longer needed", lock.directory)
    else:
        lock.remove()


# ---- signals ([Note: cleanup on exit]) ----------------------------------------------------------

_signals_lock = threading.Lock()
_signals_installed: set[int] = set()
_open_stores: set[weakref.finalize] = set()  # the finalizers of stores that may still be open


def _track(finalizer: weakref.finalize) -> None:
    """A store (from its claim on) that the signal handler cleans up."""
    with _signals_lock:
        _open_stores.difference_update([f for f in _open_stores if not f.alive])
        _open_stores.add(finalizer)


def _install_signal_cleanup() -> None:
    """The handlers of [Note: cleanup on exit], for signals whose disposition is the default.

    [Note: a signal while a store opens]
    A store claims its directory (the lock file), then makes it and its files, which can take a
    while for large preallocations. A SIGTERM in between used to find the default disposition (the
    process's first store) or a handler that did not know the new store yet: the process died
    leaving the claim and the files behind, as kill -9 does. So the handlers are installed before
    the claim, and a store is tracked from the claim on; its cleanup removes the directory only once
    the store made it (`_Opening`), never a directory of that name an earlier run kept (`keep=True`),
    and a store of keep=True signalled before its files were all there is removed, not kept: a
    half-made directory without its lock would block the job id and never be found stale.
    """
    with _signals_lock:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread; exit cleanup still runs
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum in _signals_installed:
                continue
            if signal.getsignal(signum) is not signal.SIG_DFL:
                continue  # the user's handler (it may still need the state), ignored, or KeyboardInterrupt
            signal.signal(signum, _clean_and_die)
            _signals_installed.add(signum)


def _clean_and_die(signum: int, frame: Any) -> None:
    """The default disposition was to die: nothing of the user's runs after this, so the open
    stores go first ([Note: cleanup on exit]), then the process dies of the signal as the parent
    process expects."""
    for finalizer in list(_open_stores):
        finalizer()  # a no-op for stores already closed
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_clean_and_die.infinity_immediate = True  # never held to a step boundary (infinity/engine/signals.py)
