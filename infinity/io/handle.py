"""`AsyncIOHandle`: the typed Python face of the C++ I/O engine (infinity._aio).

One verb per step, like liburing's prepare -> submit -> wait: `submit_read` / `submit_write`
queue a transfer and return its id, `wait(id)` blocks on that transfer (or on all of them) and
raises `OSError` carrying the errno, the path and the file offset of the first failure.
DeepSpeed's aio handle names are thin aliases so that code moving over keeps working.

[Note: waiting again]
A wait returns in the caller's thread, and Ctrl-C (Python's KeyboardInterrupt, raised between
two bytecodes) can land after it returned and before the caller recorded the outcome: the
tiers' swapper then still holds the transfer as in flight, and its cleanup waits for it again.
So a handle remembers the outcome of its last `ENDED_KEPT` ended requests (errno, offset, time;
not their memory, which is let go) and a wait for one of them gives that outcome again instead
of failing. Landing earlier, between the engine's return and this bookkeeping, the outcome is
lost: that wait raises OSError(EINTR), never a success. Before, the second wait raised
ValueError ("not outstanding"), and `infinity finetune` stopped by Ctrl-C could exit with it
from its cleanup instead of saying "interrupted".
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import warnings
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from infinity._native import _aio
from infinity.io.memory import aligned_empty

ENGINES = ("auto", "io_uring", "aio", "psync")

_warned_buffered: set[str] = set()
_warned_lock = threading.Lock()


class _InFlight(NamedTuple):
    """A queued transfer and the memory it uses: held until waited for, so it cannot be freed."""

    buffer: Any
    path: str
    offset: int
    write: bool


class _Ended(NamedTuple):
    """The outcome of a transfer that was waited for ([Note: waiting again]); not its memory."""

    err: int
    err_offset: int
    finished: float
    path: str
    offset: int
    write: bool


ENDED_KEPT = 4096  # outcomes of ended requests a handle remembers ([Note: waiting again])


_MAX_OFFSET = 2**63 - 1  # off_t


def _warn_buffered_once(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with _warned_lock:
        if directory in _warned_buffered:
            return
        _warned_buffered.add(directory)
    warnings.warn(
        f"O_DIRECT is not supported for {path} (its file system refuses it, as tmpfs does); using buffered "
        f"I/O for files in {directory}: bandwidth will include page-cache copies",
        RuntimeWarning,
        stacklevel=4,
    )


def _pointer(buffer: Any, write: bool) -> tuple[int, int, Any]:
    """(address, nbytes, object to keep alive) of a contiguous CPU tensor or a buffer-protocol object."""
    if isinstance(buffer, torch.Tensor):
        if not buffer.is_cpu:
            raise TypeError(f"buffer: expected a CPU tensor, got one on {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("buffer: expected a contiguous tensor")
        return buffer.data_ptr(), buffer.nbytes, buffer
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"buffer: expected a CPU torch.Tensor or an object with the buffer protocol, got {type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("buffer: expected a C-contiguous buffer")
    if not write and view.readonly:
        raise ValueError("buffer: a read needs a writable buffer")
    if view.nbytes == 0:
        return 0, 0, buffer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are fine for writes to a file
        tensor = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    return tensor.data_ptr(), view.nbytes, (buffer, tensor)


class AsyncIOHandle:
    """Asynchronous reads and writes between host memory and files.

    Args:
        block_size: bytes per I/O piece; a request is cut into pieces of this size.
        queue_depth: pieces each worker keeps in flight.
        thread_count: workers; a request is split into this many contiguous chunks
            (DeepSpeed's newer name `intra_op_parallelism` is accepted too).
        single_submit: submit one piece per syscall instead of batching.
        overlap_events: reap completions while submitting (keeps the queue full) instead of
            submitting a batch and waiting for all of it.
        engine: "auto" (best the kernel offers), "io_uring", "aio" (kernel AIO), or "psync"
            (thread pool of pread/pwrite).
        use_direct: O_DIRECT where the file system allows it (the default; without it the page
            cache copies every byte and competes for RAM). Files whose file system refuses
            O_DIRECT are served buffered either way, with a one-time warning.
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 32,
        thread_count: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        engine: str = "auto",
        *,
        intra_op_parallelism: int | None = None,
        use_direct: bool = True,
    ) -> None:
        if intra_op_parallelism is not None:
            if thread_count not in (1, intra_op_parallelism):
                raise ValueError(
                    f"thread_count={thread_count} and intra_op_parallelism={intra_op_parallelism} disagree; give one"
                )
            thread_count = intra_op_parallelism
        _check_int("block_size", block_size, 512, 1 << 30)
        _check_int("queue_depth", queue_depth, 1, 1024)
        _check_int("thread_count", thread_count, 1, 256)
        for name, value in (("single_submit", single_submit), ("overlap_events", overlap_events),
                            ("use_direct", use_direct)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
        self._engine = _aio.Engine(block_size, queue_depth, thread_count, single_submit, overlap_events, engine,
                                   use_direct)
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._thread_count = thread_count
        self._single_submit = single_submit
        self._overlap_events = overlap_events
        self._inflight: dict[int, _InFlight] = {}
        self._ended: OrderedDict[int, _Ended] = OrderedDict()  # [Note: waiting again]
        self._lock = threading.Lock()

    # ---- the engine's verbs ------------------------------------------------------------------

    @property
    def engine(self) -> str:
        """The backend in use: "io_uring", "aio" or "psync"."""
        return self._engine.engine

    def submit_read(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Queues a read of len(buffer) bytes of `path` at `offset` into `buffer`; returns its id."""
        return self._submit(False, buffer, path, offset)

    def submit_write(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Queues a write of `buffer` to `path` at `offset` (created if missing); returns its id."""
        return self._submit(True, buffer, path, offset)

    def wait(self, request: int | None = None) -> int:
        """Blocks until `request` (or every outstanding request) completes; returns how many did.

        Raises OSError for the first failed request; all requests waited for are finished
        (their buffers are free to reuse) even then.
        """
        if request is not None:
            self._wait_one(request)
            return 1
        with self._lock:
            ids = sorted(self._inflight)
        first_error: OSError | None = None
        for rid in ids:
            try:
                self._wait_one(rid)
            except OSError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return len(ids)

    def done(self, request: int) -> bool:
        """Whether `request` has completed, so that `wait(request)` returns at once; never blocks.
        Its outcome (and any error) is still reported by `wait`."""
        with self._lock:
            if request in self._ended:
                return True
            if request not in self._inflight:
                raise ValueError(f"request: {request} is not outstanding on this handle (never submitted, or "
                                 f"ended more than {ENDED_KEPT} requests ago)")
        return self._engine.done(request)

    def finished_count(self) -> int:
        """How many requests have completed so far. One that completes after a call shows in
        the next call's count, so a poll of `done` over requests may be skipped while the count
        stays the same; never blocks."""
        return self._engine.finished_count()

    def read(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Synchronous read; returns bytes read. Reading past the end of the file raises."""
        self.wait(self.submit_read(buffer, path, offset))
        return _pointer(buffer, False)[1]

    def write(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Synchronous write; returns bytes written."""
        self.wait(self.submit_write(buffer, path, offset))
        return _pointer(buffer, True)[1]

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Waits for everything in flight (ignoring failures); the handle stays usable."""
        try:
            self.wait()
        except OSError:
            pass

    def __del__(self) -> None:
        # The engine must finish with every buffer before the buffers can be freed.
        if getattr(self, "_inflight", None):
            self.close()

    def _submit(self, write: bool, buffer: Any, path: str | os.PathLike, offset: int) -> int:
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset: expected a non-negative int, got {offset!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file path, got {path!r}")
        path = os.fspath(path)
        if "\0" in path:
            raise ValueError(f"path: contains a NUL byte, which no file name can: {path!r}")
        ptr, nbytes, keep = _pointer(buffer, write)
        if offset + nbytes > _MAX_OFFSET:
            raise ValueError(f"offset: {offset} + {nbytes} bytes is past the largest file offset ({_MAX_OFFSET})")
        rid, direct = self._engine.submit(write, ptr, nbytes, path, offset)
        if rid < 0:
            code = -rid
            if code == errno_mod.EISDIR:  # the engine checks the descriptor it opens, not a stat per request
                raise IsADirectoryError(code, "path: expected a file, got a directory", path)
            raise OSError(code, f"{os.strerror(code)}: cannot open for {'writing' if write else 'reading'}", path)
        if not direct:
            _warn_buffered_once(path)
        with self._lock:
            self._inflight[rid] = _InFlight(keep, path, offset, write)
        return rid

    def wait_timed(self, request: int) -> float:
        """`wait(request)`, returning the `time.monotonic()` at which the request completed (for
        busy-time accounting: it may be well before this call)."""
        return self._wait_one(request)

    def _wait_one(self, rid: int) -> float:
        with self._lock:
            entry = self._inflight.get(rid)
            ended = self._ended.get(rid) if entry is None else None
        if entry is None and ended is None:
            raise ValueError(f"request: {rid} is not outstanding on this handle (never submitted, or ended "
                             f"more than {ENDED_KEPT} requests ago)")
        if ended is None:
            try:
                err, err_offset, finished = self._engine.wait(rid)
            except KeyError:  # the engine finished it, and an interrupt (Ctrl-C) cut off our bookkeeping
                with self._lock:
                    self._inflight.pop(rid, None)
                kind = "write" if entry.write else "read"
                raise OSError(errno_mod.EINTR, f"{kind} of {entry.path}: its wait was interrupted after the "
                              "request ended, so whether it succeeded is unknown", entry.path) from None
            with self._lock:  # the outcome is kept before the request's buffer is let go
                ended = self._ended[rid] = _Ended(err, err_offset, finished, entry.path, entry.offset, entry.write)
                del self._inflight[rid]
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
        if ended.err:
            err, kind = ended.err, "write" if ended.write else "read"
            what = "read past end of file" if err == errno_mod.ENODATA and not ended.write else os.strerror(err)
            raise OSError(
                err, f"{what}: {kind} of {ended.path} failed at offset {ended.err_offset} (request at offset "
                f"{ended.offset})", ended.path,
            )
        return ended.finished

    # ---- DeepSpeed's names -------------------------------------------------------------------

    def async_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        return self.submit_read(buffer, filename, file_offset)

    def async_pwrite(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        return self.submit_write(buffer, filename, file_offset)

    def sync_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        return self.read(buffer, filename, file_offset)

    def sync_pwrite(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        return self.write(buffer, filename, file_offset)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_empty(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return True  # memory is released when the tensor dies

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_thread_count(self) -> int:
        return self._thread_count

    def get_intra_op_parallelism(self) -> int:
        return self._thread_count

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected {low} <= {name} <= {high}, got {value}")


def available_engines() -> list[str]:
    """Engines this kernel accepts, best first."""
    return list(_aio.available_engines())
