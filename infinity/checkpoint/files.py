"""Durable, checked bytes: extents written and read through the aio handle with a CRC-32 of
each, files fsynced, names published by atomic rename.

[Note: publishing a checkpoint]
Every rank writes into `save_dir/.<tag>.partial-<host>-<pid>` (rank 0's name, which the others
are told); when all of them have fsynced their files (the manifest's gather is the barrier),
rank 0 writes the manifest, fsyncs the directory and renames it to `save_dir/<tag>`, fsyncs
`save_dir`, then replaces `latest` the same way (a temporary file, fsync, rename). A crash at
any point leaves either the old tag and `latest` or the new ones: a partial directory is never
named by `latest`, and the next save into `save_dir` removes it once its writer is gone (as
`infinity clean` does). Saving again under an existing tag moves the old directory to
`.<tag>.replaced` first; if the process dies between the two renames, loading that tag finds
the old one there. A failure (a full disk) before the tag is published removes the partial
directory and leaves `latest` as it was; one while writing `latest` leaves the new tag, whole,
and says that `latest` still names the previous one. Only after all that are the checkpoints
beyond `checkpoint.save_total_limit` removed (in save.py).

[Note: leftovers and their writers]
Whatever a writer leaves on disk before publishing carries the writer in its name, `<host>-<pid>`
(`.<tag>.partial-<host>-<pid>`, `latest.tmp-<host>-<pid>`, `.<out>.export-<host>-<pid>`), so
that a later save, export or `infinity clean` can tell leftovers of a process killed outright
(its host is this one and no process has its pid) from the work of a live one, which is never
touched. A name of another host is never judged: its pid means nothing here (a checkpoint
directory on a shared file system). A pid reused by an unrelated process keeps the leftover
until that process ends, which errs on the safe side.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import zlib
from collections.abc import Iterator

import torch

from infinity.checkpoint.layout import EXTENT_ALIGN, CheckpointError, round_up
from infinity.io import AsyncIOHandle, aligned_empty

CHUNK = 64 << 20  # bytes of a staging buffer: two of them keep a copy and a write going


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_file(path)  # a directory opened read-only can be fsynced on Linux


def writer_id() -> str:
    """`<host>-<pid>`: names what this process writes before publishing it ([Note: leftovers and
    their writers])."""
    return f"{socket.gethostname()}-{os.getpid()}"


STALE, IN_USE, FOREIGN = "stale", "in use", "another host's"


def writer_status(writer: str) -> str:
    """Whether the writer a name carries (`writer_id`, or a bare pid of this host as older
    versions wrote) may still be writing: STALE only for a process of this host that is gone,
    FOREIGN for another host's ([Note: leftovers and their writers])."""
    host, _, pid = writer.rpartition("-")
    if not host and writer.isdigit():
        host, pid = socket.gethostname(), writer
    if host != socket.gethostname() or not pid.isdigit():
        return FOREIGN
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return STALE
    except PermissionError:  # another user's process
        pass
    return IN_USE


def temporary_name(path: str) -> str:
    """Where this process writes `path` before publishing it by rename."""
    return f"{path}.tmp-{writer_id()}"


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """An OSError raised inside names `path` if it names no file: a write to a full disk
    through a file object says only "No space left on device"."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), path) from None


def write_durable(path: str, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs it; a failure names `path`."""
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str, data: bytes) -> None:
    """Replaces `path` with `data`: all of it or none of it, durable once this returns. A
    failure leaves `path` as it was and no temporary beside it."""
    tmp = temporary_name(path)
    try:
        write_durable(tmp, data)
        with naming(path):
            os.replace(tmp, path)
    except BaseException:
        remove_file(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def crc_of_file(path: str) -> tuple[int, int]:
    """(bytes, crc32) of a small file."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc, n = zlib.crc32(block, crc), n + len(block)
    return n, crc


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class ExtentWriter:
    """Writes extents (any contiguous CPU tensor's bytes, zero-padded to 4 KiB) through an aio
    handle: each 64 MiB chunk is copied into one of two aligned staging buffers, its CRC taken,
    and its write submitted while the next chunk is copied. `finish` waits for the last writes
    and raises the first failure."""

    def __init__(self, handle: AsyncIOHandle, chunk: int = CHUNK):
        self.handle = handle
        self.chunk = chunk
        self._buffers: list[torch.Tensor] = []
        self._writes: list[int | None] = [None, None]
        self._next = 0
        self.bytes = 0
        self.paths: set[str] = set()

    def _staging(self, nbytes: int) -> torch.Tensor:
        if len(self._buffers) < 2:
            self._buffers.append(aligned_empty(self.chunk, pin=False))
        i = self._next
        self._next = 1 - i
        if self._writes[i] is not None:
            request, self._writes[i] = self._writes[i], None
            self.handle.wait(request)
        return self._buffers[i][:nbytes], i

    def write(self, path: str, offset: int, src: torch.Tensor) -> tuple[int, int]:
        """Writes `src` at `offset` (a multiple of 4 KiB); returns (bytes written, crc32)."""
        assert offset % EXTENT_ALIGN == 0
        data = src.detach().reshape(-1).view(torch.uint8)
        n = data.numel()
        total = round_up(n)
        crc = 0
        for lo in range(0, total, self.chunk):
            hi = min(total, lo + self.chunk)
            buffer, i = self._staging(hi - lo)
            m = max(0, min(hi, n) - lo)
            buffer[:m].copy_(data[lo:lo + m])
            buffer[m:].zero_()
            crc = zlib.crc32(buffer.numpy(), crc)
            self._writes[i] = self.handle.submit_write(buffer, path, offset + lo)
        self.bytes += total
        self.paths.add(path)
        return total, crc

    def finish(self) -> None:
        """Waits for every write; raises the first that failed. Then fsyncs every file written."""
        error = None
        for i, request in enumerate(self._writes):
            if request is not None:
                self._writes[i] = None
                try:
                    self.handle.wait(request)
                except OSError as e:
                    error = error or e
        if error is not None:
            raise error
        for path in sorted(self.paths):
            fsync_file(path)

    def abort(self) -> None:
        """Waits for the writes in flight, ignoring their failures (the save is abandoned)."""
        for i, request in enumerate(self._writes):
            if request is not None:
                self._writes[i] = None
                try:
                    self.handle.wait(request)
                except OSError:
                    pass


def read_extent(handle: AsyncIOHandle, path: str, offset: int, nbytes: int, crc: int, what: str) -> torch.Tensor:
    """The `nbytes` bytes of `path` at `offset`, checked against `crc`; `what` names them in errors."""
    buffer = aligned_empty(nbytes, pin=False)
    try:
        handle.read(buffer, path, offset)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.ENOENT):  # the disk failed (EIO): not the checkpoint's fault
            raise OSError(e.errno, f"{path}: cannot read {what} ({nbytes} bytes at offset {offset}): {e.strerror}; "
                          "nothing was loaded from it", path) from None
        raise CheckpointError(f"{path}: cannot read {what} ({nbytes} bytes at offset {offset}): {e.strerror or e}; "
                              "the file is missing or shorter than the manifest says") from None
    if zlib.crc32(buffer.numpy()) != crc:
        raise CheckpointError(f"{path}: checksum mismatch in {what} (bytes {offset} to {offset + nbytes}); the "
                              "file is damaged, nothing was loaded from it")
    return buffer
