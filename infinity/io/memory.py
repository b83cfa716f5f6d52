"""Exact-size, page-aligned, page-locked host memory: registered with the device driver when
the device layer installed a registration (CUDA's cudaHostRegister with a GPU), mlock'ed
otherwise.

[Note: page-locking is the device layer's]
Registering memory with a driver is a device call, and every device call is in infinity.device,
which is above this package: so io/ does not call CUDA. It holds the registration the device
layer installs (`use_host_registration`, at the import of infinity.device) and calls it through
the `HostRegistration` protocol; without one, or without a driver present, buffers are mlock'ed.

[Note: pinned buffer lifetime]
torch's pinned allocator rounds every request up to a power of two and caches blocks, so a
pool of 5 x 100 MB buffers can pin 5 x 128 MiB and never give it back. We allocate exactly
(page-aligned, which O_DIRECT needs) in the extension and register the pages with
cudaHostRegister. The tensor returned holds the only reference to the owning buffer object;
when the tensor dies the buffer's release hook unregisters the pages and then frees them, in
that order, so the driver never holds a registration on freed memory.

[Note: page-locked even without a GPU]
Host buffers are locked whether or not CUDA is there, so that they behave the same with and
without a GPU and no page of a buffer is ever reclaimed while the engine owns it. Locking is not
a speed-up: on this machine's disk O_DIRECT into locked and into ordinary, already touched pages
ran the same (`bench/bench_aio.py --buffers-ab`, bench/results/aio.md); what counts there is
how many physically contiguous runs the pages form, which huge pages see to. A process
whose RLIMIT_MEMLOCK is too small gets one warning and unlocked memory, never an error.
Buffers of 2 MiB and more are also backed by transparent huge pages where the kernel allows it
([Note: huge pages for I/O buffers] in csrc/aio/aligned_buffer.cpp).
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from infinity._native import _aio

PAGE_SIZE = 4096
_warned_mlock = False


class HostRegistration(Protocol):
    """Page-locking through a device driver ([Note: page-locking is the device layer's])."""

    def present(self) -> bool:
        """Whether there is a driver to register with (a GPU)."""

    def register(self, ptr: int, nbytes: int) -> Callable[[], None]:
        """Registers `nbytes` at `ptr`; returns the undo, which runs before the memory is freed
        (possibly while Python shuts down). Raises RuntimeError if the driver refuses."""


_registration: HostRegistration | None = None


def use_host_registration(registration: HostRegistration | None) -> None:
    """Installs the device layer's registration ([Note: page-locking is the device layer's])."""
    global _registration
    _registration = registration


def host_registration() -> HostRegistration | None:
    """The registration installed, if its driver is present: host buffers are registered with it."""
    return _registration if _registration is not None and _registration.present() else None


def _mlock(buf: _aio.AlignedBuffer) -> None:
    global _warned_mlock
    err = buf.lock()
    if err and not _warned_mlock:
        _warned_mlock = True
        warnings.warn(f"could not page-lock {buf.nbytes} bytes of host memory ({os.strerror(err)}); "
                      "it stays pageable: raise `ulimit -l` to lock it", RuntimeWarning,
                      stacklevel=3)


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: bool | None = None, *,
                  huge_pages: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements on page-aligned memory of exactly that size.

    pin=None or True: page-locked (registered with the device driver where one is present:
    cudaHostRegister with CUDA; mlock without);
    pin=False: plain pageable memory.
    huge_pages=True: 2 MiB and more are backed by transparent huge pages where the kernel allows;
    False: ordinary 4 KiB pages (the control of `bench/bench_aio.py --buffers-ab`).
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel: expected a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    if not isinstance(huge_pages, bool):
        raise TypeError(f"huge_pages: expected a bool, got {huge_pages!r}")
    registration = host_registration() if pin is not False else None
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    try:
        buf = _aio.AlignedBuffer(nbytes, PAGE_SIZE, huge_pages)
    except MemoryError:
        raise OSError(errno.ENOMEM, f"numel: cannot allocate {numel} elements of {dtype} ({nbytes} bytes) of "
                      "page-aligned host memory") from None
    if registration is not None:
        try:
            buf.set_release_hook(registration.register(buf.ptr, buf.nbytes))
        except RuntimeError as e:  # e.g. more than the host can page-lock: the mapping itself succeeded
            raise OSError(errno.ENOMEM, f"numel: cannot allocate {numel} elements of {dtype} ({nbytes} bytes) of "
                          f"pinned host memory ({e})") from None
    elif pin is not False:
        _mlock(buf)
    # frombuffer keeps `buf` alive for as long as the tensor's storage lives.
    return torch.frombuffer(buf, dtype=dtype, count=numel)
