"""DeepSpeed's `aio_handle`, for code written against `deepspeed.ops.aio`: its positional
constructor `(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)`, its
verbs and its return values (a submitted asynchronous operation returns 0; a synchronous one, and
`wait()`, the number of operations completed), over `AsyncIOHandle`, whose own verbs stay as they
are. `AsyncIOBuilder().load().aio_handle` is the same class, for code that goes through the
builder.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity.io.handle import AsyncIOHandle
from infinity.io.memory import PAGE_SIZE, aligned_empty


class aio_handle:  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed 0.19.8's aio handle."""

    def __init__(self, block_size: int = 1024 * 1024, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1):
        self._handle = AsyncIOHandle(block_size=block_size, queue_depth=queue_depth,
                                     thread_count=intra_op_parallelism, single_submit=single_submit,
                                     overlap_events=overlap_events)
        self._submitted: list[int] = []
        self._locked: set[int] = set()  # data pointers of tensors from new_cpu_locked_tensor

    # ---- getters ------------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._handle.get_block_size()

    def get_queue_depth(self) -> int:
        return self._handle.get_queue_depth()

    def get_single_submit(self) -> bool:
        return self._handle.get_single_submit()

    def get_overlap_events(self) -> bool:
        return self._handle.get_overlap_events()

    def get_intra_op_parallelism(self) -> int:
        return self._handle.get_intra_op_parallelism()

    def get_alignment(self) -> int:
        return PAGE_SIZE

    # ---- synchronous --------------------------------------------------------------------------

    def read(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        self._handle.read(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return 1

    def write(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        self._handle.write(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return 1

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.read(buffer, filename, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.write(buffer, filename, False, file_offset)

    # ---- asynchronous -------------------------------------------------------------------------

    # DeepSpeed overloads async_pwrite on its second argument: a path, or an open descriptor
    # (an int, also taken as fd=). async_pread takes a descriptor the same way here.

    def async_pread(self, buffer: torch.Tensor, filename: str | int | None = None, file_offset: int = 0, *,
                    fd: int | None = None) -> int:
        self._submitted.append(self._handle.submit_read(buffer, _path(filename, fd, "async_pread"), file_offset))
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: str | int | None = None, file_offset: int = 0, *,
                     fd: int | None = None) -> int:
        self._submitted.append(self._handle.submit_write(buffer, _path(filename, fd, "async_pwrite"), file_offset))
        return 0

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
              file_offset: int = 0, **kwargs: Any) -> int:
        """`async` is a Python keyword: DeepSpeed's keyword argument arrives in `kwargs`."""
        if _is_async(async_op, kwargs, "pread"):
            return self.async_pread(buffer, filename, file_offset)
        return self.read(buffer, filename, validate, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
               file_offset: int = 0, **kwargs: Any) -> int:
        if _is_async(async_op, kwargs, "pwrite"):
            return self.async_pwrite(buffer, filename, file_offset)
        return self.write(buffer, filename, validate, file_offset)

    def wait(self) -> int:
        """Waits for every asynchronous operation submitted since the last wait; returns how many
        completed (raising the first failure once all have finished)."""
        submitted, self._submitted = self._submitted, []
        error = None
        for request in submitted:
            try:
                self._handle.wait(request)
            except OSError as e:
                error = error or e
        if error is not None:
            raise error
        return len(submitted)

    # ---- page-locked memory -------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor | None = None, *,
                              example_tenosr: torch.Tensor | None = None) -> torch.Tensor:
        """A page-aligned tensor of `num_elem` elements of the example's dtype. The example may be
        passed under DeepSpeed's keyword spelling, `example_tenosr`, too."""
        if (example_tensor is None) == (example_tenosr is None):
            raise TypeError("new_cpu_locked_tensor: give example_tensor (DeepSpeed: example_tenosr), once")
        example_tensor = example_tensor if example_tensor is not None else example_tenosr
        tensor = aligned_empty(int(num_elem), example_tensor.dtype)
        self._locked.add(tensor.data_ptr())
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forgets the tensor (its memory goes when the last reference does); False if it did not come
        from `new_cpu_locked_tensor`."""
        if tensor.data_ptr() not in self._locked:
            return False
        self._locked.discard(tensor.data_ptr())
        return True

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._locked or (tensor.device.type == "cpu" and tensor.is_pinned())


def _path(filename: str | int | None, fd: int | None, what: str) -> str:
    if isinstance(filename, int) and not isinstance(filename, bool) and fd is None:
        filename, fd = None, filename
    if (filename is None) == (fd is None):
        raise TypeError(f"{what}: give a filename or fd=, one of them")
    if fd is not None:
        if not isinstance(fd, int) or fd < 0:
            raise ValueError(f"fd: expected an open file descriptor, got {fd!r}")
        return f"/proc/self/fd/{fd}"  # the same open file, reopened for O_DIRECT
    return filename


def _is_async(async_op: bool, kwargs: dict, what: str) -> bool:
    unknown = set(kwargs) - {"async"}
    if unknown:
        raise TypeError(f"{what}: unexpected keyword arguments {', '.join(sorted(unknown))}")
    return bool(kwargs.get("async", async_op))


def _validate(buffer: torch.Tensor, filename: str, offset: int) -> None:
    """DeepSpeed's `validate`: the bytes in memory equal the file's, read back the ordinary way."""
    data = buffer.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    with open(filename, "rb") as f:
        f.seek(offset)
        on_disk = f.read(len(data))
    if on_disk != data:
        raise OSError(f"validate: {filename} at offset {offset} differs from the buffer ({len(data)} bytes)")


class AsyncIOBuilder:
    """`AsyncIOBuilder().load().aio_handle(...)`, as DeepSpeed's op builder; nothing is compiled
    at run time (the extension was built by pip install)."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True):
        return _Ops


class _Ops:
    aio_handle = aio_handle
