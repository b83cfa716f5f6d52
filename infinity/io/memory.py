"""Exact-size, page-aligned host memory, pinned through CUDA when a GPU is present.

[Note: pinned buffer lifetime]
torch's pinned allocator rounds every request up to a power of two and caches blocks, so a
pool of 5 x 100 MB buffers can pin 5 x 128 MiB and never give it back. We allocate exactly
(page-aligned, which O_DIRECT needs) in the extension and register the pages with
cudaHostRegister. The tensor returned holds the only reference to the owning buffer object;
when the tensor dies the buffer's release hook unregisters the pages and then frees them, in
that order, so the driver never holds a registration on freed memory.
"""

from __future__ import annotations

import torch

from infinity import _aio

PAGE_SIZE = 4096


def _cuda_host_register(buf: _aio.AlignedBuffer) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.ptr, buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.nbytes} bytes failed with CUDA error {int(err)}")
    ptr = buf.ptr
    buf.set_release_hook(lambda: cudart.cudaHostUnregister(ptr))


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: bool | None = None) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements on page-aligned memory of exactly that size.

    `pin=None` pins when CUDA is available; `pin=True` without CUDA is an error.
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel: expected a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    cuda = torch.cuda.is_available()
    if pin and not cuda:
        raise ValueError("pin=True: no CUDA device, so host memory cannot be pinned")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buf = _aio.AlignedBuffer(nbytes, PAGE_SIZE)
    if cuda and pin is not False:
        _cuda_host_register(buf)
    # frombuffer keeps `buf` alive for as long as the tensor's storage lives.
    return torch.frombuffer(buf, dtype=dtype, count=numel)
