"""Publishing an export: a directory of several files that must appear whole or not at all.

[Note: publishing an export]
An export goes into `out`, a directory that may hold an earlier export and files of the user's
(a tokenizer, a training run's checkpoints). Every file of the new export is written into a
*staging* directory beside it, `.<out>.export-<host>-<pid>`, and fsynced. Then, if `out` does
not exist, the staging directory is renamed to `out`. If it does, the user's files (everything
but the earlier export's layout, its config.json when the new export brings one, and
temporaries of dead writers) are hard-linked into the staging directory (copied where a link is
refused, links kept as links), and the two directories are swapped in one step (renameat2
RENAME_EXCHANGE), after which the staging name holds the old directory and is removed. A
reader therefore finds at `out` the earlier export or the new one, whole: **a directory named
`out` is always a finished export**; names starting with `.` and holding `.export-` or `.old-`
never are.

A crash leaves, at each point:
  * before the swap: `out` as it was, and the staging directory;
  * after it: the new `out`, and the old directory under the staging name.
Either way the hidden directory belongs to a process that is gone; the next export into `out`,
the next save into the directory that holds it, and `infinity clean` remove it ([Note: leftovers
and their writers] in files.py).

Where the file system cannot swap two directories (RENAME_EXCHANGE refused), `out` is renamed
aside to `.<out>.old-<host>-<pid>` and the staging directory to `out`: between the two renames
no `out` exists, and a crash there leaves the old directory aside, which the next export or
`infinity clean` of the parent puts back (the new one, in staging, is removed).

In a swap, entries that appeared in `out` while the export was being written are moved into
the new directory before the old one is removed, and this process's working directory, if it
was `out`, follows to the new one (another process, a shell, keeps the removed one).

Where `out` is not to be replaced (it holds subdirectories, such as a training run's output or
a home directory; it is a mount point or another user's; its parent is not ours to write), the
staging directory goes inside `out` and the files are renamed into place one by one, after the
earlier export's entry points (its index and its single file) are removed: a reader finds the
old export, then nothing it can load, then the new one, never a mix; a crash in between leaves
no loadable export (`infinity clean out`, or the next export, removes what is left). There a
finished export is one whose entry point exists.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Callable

from infinity.checkpoint import files, leftovers

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> None:
    """Swaps the directories `a` and `b` in one step (Linux renameat2, RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", a)
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a, None, b)


def _can_replace(out_dir: str) -> bool:
    """`out_dir` can be replaced by another directory without anyone but a reader of the export
    noticing: ours (its owner is this process's user), not a mount point, in a parent we may
    write, holding only files and links. A directory with subdirectories (a training run's
    output, a home directory) is published into in place rather than rebuilt."""
    parent = os.path.dirname(out_dir)
    if (os.stat(out_dir).st_uid != os.geteuid() or os.path.ismount(out_dir)
            or not os.access(parent, os.W_OK | os.X_OK)):
        return False
    with os.scandir(out_dir) as entries:
        return all(e.is_symlink() or e.is_file(follow_symlinks=False) for e in entries)


def _make_dirs(directory: str) -> list[str]:
    """Creates `directory` and its missing parents; returns those it created, deepest first."""
    created = []
    path = directory
    while not os.path.exists(path):
        created.append(path)
        path = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    return created


def _link(src: str, dst: str) -> None:
    """`dst` becomes `src`: a file hard-linked (copied where a link is refused), a link kept as a
    link."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links, or a file we may not link
        shutil.copy2(src, dst)


class Publisher:
    """The staging directory an export is written into, and how it then replaces `out_dir`
    ([Note: publishing an export]). `out_dir` need not exist."""

    def __init__(self, out_dir: str):
        self.out_dir = os.path.realpath(out_dir)  # a link to a directory stays a link to the new one
        name = os.path.basename(self.out_dir)
        parent = os.path.dirname(self.out_dir)
        leftovers.remove(leftovers.find_for(self.out_dir))  # what exports into it that were killed left
        self.in_place = os.path.isdir(self.out_dir) and not _can_replace(self.out_dir)
        self._created = [] if self.in_place else _make_dirs(parent)
        where = self.out_dir if self.in_place else parent
        self.staging = os.path.join(where, f".{name}.export-{files.writer_id()}")
        try:
            os.mkdir(self.staging)
        except BaseException:
            self._remove_created()
            raise
        self.done = False

    def path(self, name: str) -> str:
        """Where the file `name` of the export is written."""
        return os.path.join(self.staging, name)

    def commit(self, names: list[str], replaced: Callable[[str], bool], entry_points: list[str]) -> None:
        """Publishes the files `names` (written in the staging directory, entry points last);
        `replaced(name)`: an entry of `out_dir` that belongs to the earlier export (dropped);
        `entry_points`: the names a reader starts from (index, single file)."""
        files.fsync_dir(self.staging)
        if self.in_place:
            self._commit_in_place(names, replaced, entry_points)
        elif not os.path.exists(self.out_dir):
            os.rename(self.staging, self.out_dir)
            files.fsync_dir(os.path.dirname(self.out_dir))
        else:
            self._swap(set(names), replaced)
        self.done = True

    def _swap(self, names: set[str], replaced: Callable[[str], bool]) -> None:
        listed = set(os.listdir(self.out_dir))
        for name in sorted(listed):
            if name not in names and not replaced(name):
                _link(os.path.join(self.out_dir, name), os.path.join(self.staging, name))
        os.chmod(self.staging, stat.S_IMODE(os.stat(self.out_dir).st_mode))
        files.fsync_dir(self.staging)
        parent = os.path.dirname(self.out_dir)
        try:
            _exchange(self.staging, self.out_dir)
            old = self.staging
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            old = os.path.join(parent, f".{os.path.basename(self.out_dir)}.old-{files.writer_id()}")
            os.rename(self.out_dir, old)
            os.rename(self.staging, self.out_dir)
        files.fsync_dir(parent)
        for name in set(os.listdir(old)) - listed:  # written into the old directory meanwhile
            if not os.path.lexists(os.path.join(self.out_dir, name)):
                os.rename(os.path.join(old, name), os.path.join(self.out_dir, name))
        self._follow(old)
        files.remove_tree(old)

    def _follow(self, old: str) -> None:
        """This process's working directory, if it was in the old directory, moves to the new."""
        try:
            cwd = os.getcwd()
        except FileNotFoundError:
            return
        if cwd == old or cwd.startswith(old + os.sep):
            moved = self.out_dir + cwd[len(old):]
            os.chdir(moved if os.path.isdir(moved) else self.out_dir)

    def _commit_in_place(self, names: list[str], replaced: Callable[[str], bool], entry_points: list[str]) -> None:
        for name in entry_points:  # a reader finds no export from here until the new one is whole
            files.remove_file(os.path.join(self.out_dir, name))
        files.fsync_dir(self.out_dir)
        for name in names:
            os.replace(self.path(name), os.path.join(self.out_dir, name))
        files.fsync_dir(self.out_dir)
        for name in os.listdir(self.out_dir):
            if name not in names and replaced(name):
                files.remove_file(os.path.join(self.out_dir, name))
        files.remove_tree(self.staging)

    def abort(self) -> None:
        """Removes the staging directory and the directories this created (when empty): `out_dir`
        is as it was."""
        if self.done:
            return
        files.remove_tree(self.staging)
        self._remove_created()
        self.done = True

    def _remove_created(self) -> None:
        for path in self._created:
            try:
                os.rmdir(path)
            except OSError:
                break
