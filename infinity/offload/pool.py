"""`BufferPool`: a fixed set of exact-size, page-aligned host buffers for NVMe transfers.

[Note: pool sizing]
The pool is allocated once, at start-up, from `buffer_count` x `buffer_size` of the config and
never grows: pinned memory is a budget, and allocating it (cudaHostRegister) in the middle of a
step would stall. Two adjustments are made before allocating, both so that a config that used
to crash DeepSpeed ("More elements ... than buffer size") just works:
  * `buffer_size` is raised to the largest shard the caller will ever put in a buffer (the real
    shard sizes are known at start-up), with one warning that says so;
  * `buffer_size` is rounded up to a whole page, so that a shard's padded extent (see the store)
    can be moved as whole pages, straight through O_DIRECT with no bounce buffer.
The total is checked against the RAM available before anything is allocated. The buffers of a
class are cut from one mapping, so that they lie on huge pages whatever their size ([Note: one
mapping a class]).

[Note: one mapping a class]
A buffer is a view into one page-aligned mapping of its class's `count` x `size` bytes, not a
mapping of its own. The kernel backs huge pages only where a whole 2 MiB of a mapping is
aligned inside it ([Note: huge pages for I/O buffers] in csrc/aio/aligned_buffer.cpp), so a
mapping of its own of 4,096,000 bytes (a 1M-element fp32 piece) had one huge page and 488
ordinary pages, and one of 2,048,000 bytes (0.5M) none: an O_DIRECT request then took one
scatter-gather entry a 4 KiB page, past this disk's 254 a request, and the block layer cut every
4 MB piece in two (2.08 MB a request at the device in /proc/diskstats, against 4.19 MB for the
disk measurement's buffers) and 2 MB ones in more. Inside the streaming step the disk then moved
the optimizer's bytes at half its speed (busy 1.9-2.2 s for a 1.0-1.2 s floor: bench/results/
streaming.md). Cut from one mapping, all but its last 2 MiB are huge pages.

[Note: two sizes of buffer]
A pool may have a second, smaller class of buffers (`small`): a request is served from the
smallest class that holds it, and waits for that class alone. The NVMe optimizer tier keeps a
piece's fp32 master in a buffer of the piece's fp32 size and its moments, when their format is
smaller (bf16, 8 bits), in buffers of the moments' size: with one size for all, a bf16 moment
left half of its buffer unused and an 8-bit one three quarters, and the budget held a third
fewer pieces than its bytes allow ([Note: the pool is a budget] in
infinity/offload/optimizer/sizing.py). Classes are never mixed: the tier counts each piece's
buffers in each class, so a moment never takes the buffer a master is waiting for.

[Note: waiting for a buffer]
A request that cannot be served now waits for a release rather than failing: with prefetching,
running out of buffers for a moment is normal. It waits at most `timeout` seconds; a pool that
never frees a buffer is a deadlock in the caller (every buffer held by work that waits for
another buffer), and the error names the two settings that size the pool.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable
from numbers import Integral
from typing import NamedTuple

import psutil
import torch

from infinity.io import PAGE_SIZE, aligned_empty
from infinity.io.memory import host_registration
from infinity.offload._messages import config_key, human_bytes


class PoolStats(NamedTuple):
    """Accounting of one pool, in bytes of whole buffers."""

    buffer_count: int
    buffer_size: int  # bytes per buffer, after the adjustments of [Note: pool sizing]
    bytes_total: int  # host memory held by the pool (pinned when `pinned`)
    bytes_in_use: int  # in buffers handed out now
    peak_in_use: int  # the most ever handed out at once
    pinned: bool
    buffers_in_use: int  # how many are handed out now


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BufferPool:
    """`buffer_count` host buffers of `buffer_size` bytes, handed out and given back explicitly.

    Args:
        buffer_count: number of buffers (config: `zero_optimization.<name>.buffer_count`).
        buffer_size: bytes per buffer; raised to the largest of `shard_sizes` with a warning and
            rounded up to a page ([Note: pool sizing]).
        shard_sizes: the bytes of every shard that will pass through the pool.
        pin: pin through the device driver (CUDA); None pins when a GPU is present
            (`pin_memory` in the config).
        name: the config section, for messages (e.g. "offload_param").
        on_release: called with every buffer handed back (the asynchronous test device
            scribbles over it, so that a copy still reading it fails loudly).
        small: (count, bytes) of a second class of smaller buffers, which serve the requests
            they hold ([Note: two sizes of buffer]); None for one size.

    Thread-safe: one lock guards it, so any thread may acquire and release.
    """

    _buffers: list[torch.Tensor]  # 1-D uint8, page-aligned: buffer_count of buffer_size bytes, then the small ones
    _sizes: list[int]  # the classes' bytes a buffer, smallest first
    _free: dict[int, list[int]]  # class size -> indices into _buffers, most recently released last (reused first: warm)
    _in_use: dict[int, int]  # data_ptr of a handed-out buffer -> its index

    def __init__(
        self,
        buffer_count: int,
        buffer_size: int,
        *,
        shard_sizes: Iterable[int] = (),
        pin: bool | None = None,
        name: str = "offload_param",
        on_release: Callable[[torch.Tensor], None] | None = None,
        small: tuple[int, int] | None = None,
    ) -> None:
        self._name = name
        self._on_release = on_release
        buffer_count = _check_count(config_key(name, "buffer_count"), buffer_count, 1)
        buffer_size = _check_count(config_key(name, "buffer_size"), buffer_size, 1)
        if pin is not None and not isinstance(pin, bool):
            raise TypeError(f"{config_key(name, 'pin_memory')}: expected a bool, got {pin!r}")
        driver = host_registration() is not None  # a GPU's ([Note: page-locking is the device layer's])
        if pin and not driver:
            raise ValueError(f"{config_key(name, 'pin_memory')}: true needs a CUDA device and there is none")
        largest = max((int(s) for s in shard_sizes), default=0)
        if largest > buffer_size:
            warnings.warn(
                f"{config_key(name, 'buffer_size')}: raised from {buffer_size} to {largest} bytes to hold "
                f"the largest shard; set it to at least {largest} to silence this warning",
                UserWarning,
                stacklevel=2,
            )
            buffer_size = largest
        self._buffer_size = round_up(buffer_size, PAGE_SIZE)
        classes = [(buffer_count, self._buffer_size)]
        if small is not None and small[0] > 0:
            count = _check_count(f"{name} pool's small buffers", small[0], 1)
            size = round_up(_check_count(f"{name} pool's small buffer size", small[1], 1), PAGE_SIZE)
            if size < self._buffer_size:
                classes.append((count, size))
            else:  # no smaller than the others: one class
                classes[0] = (buffer_count + count, self._buffer_size)
        self._buffer_count = sum(count for count, _ in classes)
        self._pinned = bool(driver if pin is None else pin)
        self._check_ram(classes)
        # Page-locked even without CUDA (mlock): O_DIRECT into locked pages is ~1.4x faster here
        # ([Note: page-locked even without a GPU] in infinity/io/memory.py); only an explicit
        # pin=False leaves them pageable.
        self._buffers, self._free = [], {}
        for count, size in classes:  # [Note: one mapping a class]
            first = len(self._buffers)
            self._buffers += list(aligned_empty(count * size, pin=None if pin is not False else False).split(size))
            self._free[size] = list(range(first + count - 1, first - 1, -1))
        self._sizes = sorted(self._free)
        self._class_by_nbytes: dict[int, int] = {}  # a request's size -> its class (`_class_of`)
        self._in_use = {}
        self._bytes_in_use = 0
        self._peak = 0
        self._cond = threading.Condition()

    def _check_ram(self, classes: list[tuple[int, int]]) -> None:
        total = sum(count * size for count, size in classes)
        available = psutil.virtual_memory().available
        if total <= available:
            return
        hint = " or set pin_memory: false" if self._pinned else ""
        raise ValueError(
            f"zero_optimization.{self._name}: buffer_count x buffer_size = "
            f"{' + '.join(f'{count} x {size}' for count, size in classes)} bytes = {human_bytes(total)} of {'pinned ' if self._pinned else ''}host memory, "
            f"but only {human_bytes(available)} is available; lower buffer_count or buffer_size{hint}"
        )

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The config section, for messages."""
        return self._name

    @property
    def buffer_count(self) -> int:
        return self._buffer_count

    @property
    def buffer_size(self) -> int:
        """Bytes per buffer (after [Note: pool sizing])."""
        return self._buffer_size

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def num_free(self) -> int:
        """Free buffers of every class."""
        with self._cond:
            return sum(len(free) for free in self._free.values())

    def free_for(self, nbytes: int) -> int:
        """Free buffers of the class a request of `nbytes` is served from ([Note: two sizes of buffer])."""
        with self._cond:
            return len(self._free[self._class_of(nbytes)])

    @property
    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                self._buffer_count, self._buffer_size, sum(b.numel() for b in self._buffers),
                self._bytes_in_use, self._peak, self._pinned, len(self._in_use),
            )

    # ---- handing out and taking back ---------------------------------------------------------

    def acquire(self, nbytes: int, timeout: float | None = 60.0) -> torch.Tensor:
        """A 1-D uint8 view of the first `nbytes` bytes of a free buffer.

        Waits up to `timeout` seconds (None: forever) for a release ([Note: waiting for a
        buffer]); raises TimeoutError naming `buffer_count` and `buffer_size` if none comes.
        """
        self._check_nbytes(nbytes)
        free = self._free[self._class_of(nbytes)]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self.exhausted(timeout)
                self._cond.wait(remaining)
            return self._take(free, nbytes)

    def exhausted(self, timeout: float | None) -> TimeoutError:
        """The error for a request that waited `timeout` seconds for a buffer in vain."""
        return TimeoutError(
            f"{config_key(self._name, 'buffer_count')}: no host buffer was released within {timeout} s "
            f"(all {self._buffer_count} buffers of {self._buffer_size} bytes ({config_key(self._name, 'buffer_size')}) "
            f"in use); raise {config_key(self._name, 'buffer_count')}, or make sure every buffer taken is given back"
        )

    def try_acquire(self, nbytes: int) -> torch.Tensor | None:
        """Like `acquire`, but None at once when no buffer is free."""
        self._check_nbytes(nbytes)
        free = self._free[self._class_of(nbytes)]
        with self._cond:
            return self._take(free, nbytes) if free else None

    def release(self, buf: torch.Tensor) -> None:
        """Gives back a buffer from `acquire` (any view that starts where the buffer starts)."""
        with self._cond:
            index = self._in_use.pop(self._ptr(buf), None)
            if index is None:
                raise ValueError(f"release: the tensor is not a buffer handed out by the {self._name} pool")
            if self._on_release is not None:
                self._on_release(self._buffers[index])
            self._bytes_in_use -= self._buffers[index].numel()
            self._free[self._buffers[index].numel()].append(index)
            self._cond.notify_all()  # the waiters may wait on different classes

    def owns(self, buf: torch.Tensor) -> bool:
        """Whether `buf` starts a buffer of this pool that is handed out now."""
        with self._cond:
            return self._ptr(buf) in self._in_use

    def base(self, buf: torch.Tensor) -> torch.Tensor:
        """The whole `buffer_size`-byte buffer that `buf` (handed out now) starts."""
        with self._cond:
            index = self._in_use.get(self._ptr(buf))
            if index is None:
                raise ValueError(f"buffer: the tensor is not a buffer handed out by the {self._name} pool")
            return self._buffers[index]

    def _take(self, free: list[int], nbytes: int) -> torch.Tensor:
        index = free.pop()
        buf = self._buffers[index]
        self._in_use[buf.data_ptr()] = index
        self._bytes_in_use += buf.numel()
        self._peak = max(self._peak, self._bytes_in_use)
        return buf[:nbytes]

    def _class_of(self, nbytes: int) -> int:
        """The size of the smallest class that holds `nbytes`."""
        size = self._class_by_nbytes.get(nbytes)
        if size is None:
            size = self._class_by_nbytes[nbytes] = next(size for size in self._sizes if size >= nbytes)
        return size

    def _check_nbytes(self, nbytes: int) -> None:
        if type(nbytes) is int and 0 <= nbytes <= self._buffer_size:  # the common case, checked fast
            return
        if isinstance(nbytes, bool) or not isinstance(nbytes, Integral) or nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        if nbytes > self._buffer_size:
            raise ValueError(
                f"{config_key(self._name, 'buffer_size')}: a request for {nbytes} bytes does not fit in a "
                f"{self._buffer_size}-byte buffer; pass the shard sizes to the pool (shard_sizes) so it is "
                f"sized for the largest"
            )

    @staticmethod
    def _ptr(buf: torch.Tensor) -> int:
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffer: expected a torch.Tensor, got {type(buf).__name__}")
        return buf.data_ptr()


def _check_count(key: str, value: object, low: int) -> int:
    """`value` as an int; integral floats pass, since DeepSpeed configs write sizes as 1e8."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{key}: expected an int, got {value!r}")
    if value < low:
        raise ValueError(f"{key}: expected at least {low}, got {value}")
    return int(value)


__all__ = ["BufferPool", "PoolStats", "round_up"]
