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
The total is checked against the RAM available before anything is allocated.

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

    Thread-safe: one lock guards it, so any thread may acquire and release.
    """

    _buffers: list[torch.Tensor]  # buffer_count x 1-D uint8, page-aligned, buffer_size bytes each
    _free: list[int]  # indices into _buffers, most recently released last (reused first: warm)
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
        self._buffer_count = buffer_count
        self._pinned = bool(driver if pin is None else pin)
        self._check_ram()
        # Page-locked even without CUDA (mlock): O_DIRECT into locked pages is ~1.4x faster here
        # ([Note: page-locked even without a GPU] in infinity/io/memory.py); only an explicit
        # pin=False leaves them pageable.
        self._buffers = [aligned_empty(self._buffer_size, pin=None if pin is not False else False)
                         for _ in range(self._buffer_count)]
        self._free = list(range(self._buffer_count - 1, -1, -1))
        self._in_use = {}
        self._peak = 0
        self._cond = threading.Condition()

    def _check_ram(self) -> None:
        total = self._buffer_count * self._buffer_size
        available = psutil.virtual_memory().available
        if total <= available:
            return
        hint = " or set pin_memory: false" if self._pinned else ""
        raise ValueError(
            f"zero_optimization.{self._name}: buffer_count x buffer_size = {self._buffer_count} x "
            f"{self._buffer_size} bytes = {human_bytes(total)} of {'pinned ' if self._pinned else ''}host memory, "
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
        with self._cond:
            return len(self._free)

    @property
    def stats(self) -> PoolStats:
        with self._cond:
            in_use = len(self._in_use) * self._buffer_size
            return PoolStats(
                self._buffer_count, self._buffer_size, self._buffer_count * self._buffer_size,
                in_use, self._peak, self._pinned,
            )

    # ---- handing out and taking back ---------------------------------------------------------

    def acquire(self, nbytes: int, timeout: float | None = 60.0) -> torch.Tensor:
        """A 1-D uint8 view of the first `nbytes` bytes of a free buffer.

        Waits up to `timeout` seconds (None: forever) for a release ([Note: waiting for a
        buffer]); raises TimeoutError naming `buffer_count` and `buffer_size` if none comes.
        """
        self._check_nbytes(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self.exhausted(timeout)
                self._cond.wait(remaining)
            return self._take(nbytes)

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
        with self._cond:
            return self._take(nbytes) if self._free else None

    def release(self, buf: torch.Tensor) -> None:
        """Gives back a buffer from `acquire` (any view that starts where the buffer starts)."""
        with self._cond:
            index = self._in_use.pop(self._ptr(buf), None)
            if index is None:
                raise ValueError(f"release: the tensor is not a buffer handed out by the {self._name} pool")
            if self._on_release is not None:
                self._on_release(self._buffers[index])
            self._free.append(index)
            self._cond.notify()

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

    def _take(self, nbytes: int) -> torch.Tensor:
        index = self._free.pop()
        buf = self._buffers[index]
        self._in_use[buf.data_ptr()] = index
        self._peak = max(self._peak, len(self._in_use) * self._buffer_size)
        return buf[:nbytes]

    def _check_nbytes(self, nbytes: int) -> None:
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
