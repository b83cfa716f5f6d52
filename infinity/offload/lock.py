"""`DirectoryLock`: an exclusive claim on a store directory that dies with its process.

[Note: directory lock]
A store directory `<job dir>/rank<r>/` is claimed through the file `<job dir>/rank<r>.lock`,
which its owner holds open with an exclusive `flock` for as long as the store is open. The
kernel drops a flock when its process dies, however it dies (SIGKILL included), so "can I take
the flock?" is the whole liveness test: no pids that may have been reused, no heartbeats. The
file also records pid, host and time, but only for messages.

Races the protocol closes, and how:
  * The lock file must never be visible unlocked (else a scanner would take it for stale): it
    is created and flocked under a private name, then published with link(), which, unlike
    rename(), fails when the name exists.
  * A scanner may open the name just before its stale owner is removed and a new owner links a
    fresh file there; after taking the flock it checks that the name still points at the inode
    it locked, and otherwise leaves it alone.
  * A stale directory is removed before its lock name is unlinked, so the directory can never
    be removed from under a new owner (who can only publish once the name is free).
  * A directory with no lock file beside it was kept on purpose (`keep=True`); scans leave it.
The flock is taken on a file that lives on the NVMe drive's own file system, which is local;
on a network file system flocks of other hosts cannot be trusted, so a lock written by another
host is never judged stale.

Forked children (DataLoader workers) inherit the open lock file and with it the flock; they
never release or remove anything, because every action checks that it runs in the owner's pid.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import time
from typing import Any, NamedTuple


class DirectoryLock:
    """A held flock on `<directory>.lock`, which claims `<directory>`."""

    directory: str  # the claimed directory (created by the owner after `take`)
    lock_path: str  # `<directory>.lock`
    _fd: int | None  # the open lock file; the flock lives as long as this descriptor
    _pid: int  # the owner: forked children inherit `_fd` but must not act on it

    def __init__(self, directory: str, lock_path: str, fd: int) -> None:
        self.directory = directory
        self.lock_path = lock_path
        self._fd = fd
        self._pid = os.getpid()

    @classmethod
    def take(cls, directory: str) -> DirectoryLock:
        """Claims `directory` (which need not exist), removing it first if its owner died.

        Raises OSError (EBUSY) naming the directory and its owner when a live process holds it.
        """
        directory = os.path.abspath(directory)
        lock_path = directory + ".lock"
        for _ in range(100):  # each retry is a race with another process; a few suffice
            make_private_dir(os.path.dirname(directory))
            try:
                fd = _create_locked(lock_path)
            except FileNotFoundError:
                continue  # another rank removed the (then empty) job directory just now
            try:
                os.link(_private_name(lock_path), lock_path)
            except FileExistsError:
                os.close(fd)
            else:
                return cls(directory, lock_path, fd)
            finally:
                _unlink_quietly(_private_name(lock_path))
            stale, status = _take_existing(lock_path)
            if stale is not None:
                stale.remove()
            elif status != _GONE:
                raise OSError(
                    errno.EBUSY,
                    f"{directory} is in use by {describe_owner(lock_path)}"
                    + ("" if status == _HELD else "; if that job is gone, remove the directory and its lock"),
                    directory,
                )
        raise OSError(errno.EAGAIN, f"could not claim {directory}: its lock keeps changing hands", lock_path)

    @property
    def held(self) -> bool:
        return self._fd is not None and os.getpid() == self._pid

    def release(self) -> None:
        """Gives the claim up, leaving the directory in place (it is then a kept directory)."""
        if not self.held:
            return
        _unlink_if_same(self.lock_path, self._fd)
        os.close(self._fd)
        self._fd = None

    def remove(self) -> None:
        """Removes the directory, then gives the claim up ([Note: directory lock]: in this order)."""
        if not self.held:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        self.release()
        rmdir_if_empty(os.path.dirname(self.directory))


def owner(lock_path: str) -> dict[str, Any]:
    """What a lock file says about its owner (pid, host, since); {} when unreadable."""
    try:
        with open(lock_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def describe_owner(lock_path: str) -> str:
    info = owner(lock_path)
    if not info:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"process {info.get('pid', '?')} on {info.get('host', '?')} (since {since})"


def remove_stale(root: str, pattern: str) -> list[str]:
    """Removes every directory `<root>/<pattern>` whose lock is not held, and the private lock
    names of processes killed while taking a lock; returns the directories removed.

    Directories of live processes, of other hosts and kept ones are left alone.
    """
    for path in _private_leftovers(root, pattern):
        _unlink_quietly(path)
        rmdir_if_empty(os.path.dirname(path))
    removed = []
    for lock_path in sorted(glob.glob(os.path.join(glob.escape(root), pattern + ".lock"))):
        stale, _ = _take_existing(lock_path)
        if stale is not None:
            removed.append(stale.directory)
            stale.remove()
    return removed


def _private_leftovers(root: str, pattern: str) -> list[str]:
    """The private lock names (`_private_name`) under `<root>/<pattern>` that a process of this
    host left when it died between creating one and removing it: its pid is gone and nobody holds
    the file's flock. A live owner is never judged stale: it holds the flock from the moment it
    can publish the name, and its pid lives before that."""
    found = []
    host = socket.gethostname()
    for path in sorted(glob.glob(os.path.join(glob.escape(root), pattern + ".lock.*.tmp"))):
        owner_host, _, pid = path[: -len(".tmp")].rpartition(".")
        if not owner_host.endswith(f".lock.{host}") or not pid.isdigit() or _pid_lives(int(pid)):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
        found.append(path)
    return found


def _pid_lives(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class Leftover(NamedTuple):
    """A store directory found under an nvme_path (`survey`)."""

    directory: str
    status: str  # "stale" (its process is gone), "in use", or "another host's"
    owner: str  # the process the lock file names
    nbytes: int  # disk space its files take


def survey(root: str, pattern: str = "infinity-*/rank*") -> list[Leftover]:
    """Every store directory `<root>/<pattern>` with a lock file, and whether its owner lives;
    looks only (a stale lock is taken and given back, its file left in place)."""
    found = []
    for lock_path in sorted(glob.glob(os.path.join(glob.escape(root), pattern + ".lock"))):
        stale, status = _take_existing(lock_path)
        if stale is not None:
            os.close(stale._fd)  # noqa: SLF001 (ours: give the flock back, keep the lock file)
            status = "stale"
        elif status == _GONE:
            continue
        directory = lock_path[: -len(".lock")]
        found.append(Leftover(directory, {"held": "in use", "foreign": "another host's"}.get(status, status),
                              describe_owner(lock_path), disk_bytes(directory)))
    for path in _private_leftovers(root, pattern):
        pid = path[: -len(".tmp")].rpartition(".")[2]
        found.append(Leftover(path, "stale", f"process {pid} on {socket.gethostname()}", disk_bytes(path)))
    return found


def disk_bytes(path: str) -> int:
    """The disk space `path` takes: a file's or link's own blocks, a directory's files' (what a
    removal gives back; links are not followed); 0 for what is not there (any more)."""
    paths = [path] if not os.path.isdir(path) or os.path.islink(path) else \
        (os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    total = 0
    for p in paths:
        try:
            total += os.lstat(p).st_blocks * 512
        except FileNotFoundError:  # removed meanwhile (its owner cleaning up)
            pass
    return total


def make_private_dir(path: str) -> None:
    """Creates `path` with mode 0700 (shards are the user's model) unless it exists."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask, which may be odd


def _private_name(lock_path: str) -> str:
    return f"{lock_path}.{socket.gethostname()}.{os.getpid()}.tmp"


def _create_locked(lock_path: str) -> int:
    """A new lock file under a private name, flocked and filled in; returns its descriptor."""
    path = _private_name(lock_path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.write(fd, json.dumps(info).encode())
    return fd


_GONE, _HELD, _FOREIGN = "gone", "held", "foreign"


def _take_existing(lock_path: str) -> tuple[DirectoryLock | None, str]:
    """The claim of a published lock file whose owner is dead, else None and why not:
    _GONE (it changed while we looked: try again), _HELD (its owner lives), _FOREIGN (another host's)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, _GONE
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, _HELD
    try:
        same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None, _GONE
    if owner(lock_path).get("host", socket.gethostname()) != socket.gethostname():
        os.close(fd)
        return None, _FOREIGN
    return DirectoryLock(lock_path[: -len(".lock")], lock_path, fd), ""


def _unlink_if_same(path: str, fd: int) -> None:
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # other ranks' directories or locks are still there, or it is gone already
