"""What saves and exports killed outright left in a directory, found by name ([Note: leftovers
and their writers] in files.py): the next save into a checkpoint directory, the next export into
a directory and `infinity clean DIR` find them with `find` and act on them with `remove`.

    .<tag>.partial-<writer>    a save that never published (removed)
    .<tag>.removed-<writer>    a checkpoint save_total_limit was removing (removed)
    .<tag>.replaced            a checkpoint replaced under its own tag, once the tag is there
                               again (removed; while the tag is missing, loading finds it here)
    latest.tmp-<writer>        a `latest` never renamed into place (removed)
    .<out>.export-<writer>     an export never swapped in, or the directory it replaced (removed)
    .<out>.old-<writer>        a directory an export moved aside: put back as <out> when no
                               directory has that name, else removed ([Note: publishing an
                               export] in publish.py)

Only entries whose writer is gone are acted on; those of live processes and of other hosts are
reported and left alone. Nothing else in the directory is looked at.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import NamedTuple

from infinity.checkpoint import files
from infinity.checkpoint.layout import LATEST
from infinity.offload.lock import disk_bytes

_ASIDE = re.compile(r"\.(?P<name>.+)\.old-(?P<writer>.+)")
_PATTERNS = (  # (pattern, what it is, whether it is a directory)
    (re.compile(r"\.(?P<name>.+)\.partial-(?P<writer>.+)"), "a save that did not finish", True),
    (re.compile(r"\.(?P<name>.+)\.removed-(?P<writer>.+)"), "a checkpoint being removed", True),
    (re.compile(r"\.(?P<name>.+)\.replaced"), "a checkpoint replaced under its tag", True),
    (re.compile(rf"(?P<name>{LATEST})\.tmp-(?P<writer>.+)"), "a `latest` not renamed into place", False),
    (re.compile(r"\.(?P<name>.+)\.export-(?P<writer>.+)"), "an export that did not finish", True),
    (_ASIDE, "a directory an export moved aside", True),
)


class Leftover(NamedTuple):
    path: str
    what: str
    status: str  # files.STALE (its writer is gone), files.IN_USE or files.FOREIGN
    writer: str  # `<host>-<pid>`, "" when the name carries none
    nbytes: int  # disk space it takes
    restore: str | None  # where it goes back instead of being removed


def find(directory: str, only: str | None = None) -> list[Leftover]:
    """The leftovers in `directory` (`only`: those about the entry of that name)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = []
    for entry in names:
        for pattern, what, is_dir in _PATTERNS:
            match = pattern.fullmatch(entry)
            if match is None or (only is not None and match["name"] != only):
                continue
            path = os.path.join(directory, entry)
            if is_dir != (os.path.isdir(path) and not os.path.islink(path)):
                continue
            target = os.path.join(directory, match["name"])
            writer = match.groupdict().get("writer") or ""
            if not writer:  # .<tag>.replaced: a leftover only once the tag is back
                if not os.path.isdir(target):
                    continue
                status = files.STALE
            else:
                status = files.writer_status(writer)
            restore = target if pattern is _ASIDE and not os.path.lexists(target) else None
            found.append(Leftover(path, what, status, writer, disk_bytes(path), restore))
            break
    return found


def find_for(path: str) -> list[Leftover]:
    """The leftovers in the directory `path` and those about it beside it (an export into it)."""
    path = os.path.abspath(path)
    return find(path) + find(os.path.dirname(path), only=os.path.basename(path))


def remove(found: list[Leftover]) -> list[Leftover]:
    """Removes (or puts back) the stale ones; returns them."""
    done = []
    for leftover in found:
        if leftover.status != files.STALE:
            continue
        if leftover.restore is not None and not os.path.lexists(leftover.restore):
            try:
                os.rename(leftover.path, leftover.restore)
            except FileNotFoundError:  # another cleaner was first
                continue
            files.fsync_dir(os.path.dirname(leftover.restore))
        elif os.path.isdir(leftover.path) and not os.path.islink(leftover.path):
            shutil.rmtree(leftover.path, ignore_errors=True)
        else:
            files.remove_file(leftover.path)
        done.append(leftover)
    return done


def describe_writer(writer: str) -> str:
    host, _, pid = writer.rpartition("-")
    return f"process {pid} on {host}" if host else f"process {writer}" if writer else "no process"
