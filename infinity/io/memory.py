"""Exact-size, page-aligned, page-locked host memory: pinned through CUDA when a GPU is
present, mlock'ed otherwise.

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

import torch

from infinity._native import _aio

PAGE_SIZE = 4096
_warned_mlock = False


def _cuda_host_register(buf: _aio.AlignedBuffer) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.ptr, buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.nbytes} bytes failed with CUDA error {int(err)}")
    ptr = buf.ptr

    def unregister() -> None:  # runs in the buffer's destructor, possibly while Python shuts down
        try:
            cudart.cudaHostUnregister(ptr)
        except Exception:  # the process is ending: its memory goes with it
            pass

    buf.set_release_hook(unregister)


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

    pin=None or True: page-locked (cudaHostRegister with CUDA, mlock without);
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
    cuda = torch.cuda.is_available()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    try:
        buf = _aio.AlignedBuffer(nbytes, PAGE_SIZE, huge_pages)
    except MemoryError:
        raise OSError(errno.ENOMEM, f"numel: cannot allocate {numel} elements of {dtype} ({nbytes} bytes) of "
                      "page-aligned host memory") from None
    if pin is not False and cuda:
        try:
            _cuda_host_register(buf)
        except RuntimeError as e:  # e.g. more than the host can page-lock: the mapping itself succeeded
            raise OSError(errno.ENOMEM, f"numel: cannot allocate {numel} elements of {dtype} ({nbytes} bytes) of "
                          f"pinned host memory ({e})") from None
    elif pin is not False:
        _mlock(buf)
    # frombuffer keeps `buf` alive for as long as the tensor's storage lives.
    return torch.frombuffer(buf, dtype=dtype, count=numel)
