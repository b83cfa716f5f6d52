"""DeepSpeed's aio_handle surface (0.19.8): positional constructor, verbs, return values, fd=,
pinned tensors, and the builder path, checked against the bytes on disk."""

from __future__ import annotations

import os

import pytest
import torch

from infinity.io import AsyncIOBuilder, aio_handle


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_positional_constructor_and_getters():
    h = aio_handle(1 << 20, 32, False, True, 2)  # block_size, queue_depth, single_submit, overlap_events, intra_op
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (1 << 20, 32, False, True, 2)
    assert h.get_alignment() % 512 == 0
    assert AsyncIOBuilder().is_compatible() and AsyncIOBuilder().load().aio_handle is aio_handle


def test_return_values_are_deepspeeds(tmp_path):
    h = aio_handle()
    data = torch.arange(4096, dtype=torch.float32)
    path = str(tmp_path / "x.bin")
    assert h.sync_pwrite(data, path) == 1
    assert _bytes(path) == data.numpy().tobytes()
    back = torch.empty_like(data)
    assert h.sync_pread(back, path) == 1 and torch.equal(back, data)
    assert h.async_pwrite(data * 2, path) == 0 and h.async_pwrite(data * 3, path, 16384) == 0
    assert h.wait() == 2
    assert h.wait() == 0
    assert torch.equal(torch.frombuffer(bytearray(_bytes(path)), dtype=torch.float32)[4096:], data * 3)
    assert h.pread(back, path, False, True) == 0 and h.wait() == 1 and torch.equal(back, data * 2)
    assert h.pwrite(data, path, True, False) == 1  # validate: read back and compared
    assert h.pread(back, path, **{"validate": True, "async": False}) == 1 and torch.equal(back, data)
    assert h.read(back, path, True) == 1 and h.write(back, path, True) == 1


def test_fd_and_locked_tensors(tmp_path):
    h = aio_handle()
    locked = h.new_cpu_locked_tensor(1024, torch.empty(0, dtype=torch.bfloat16))
    assert locked.dtype == torch.bfloat16 and locked.numel() == 1024 and h.is_pinned(locked)
    locked.copy_(torch.arange(1024))
    fd = os.open(tmp_path / "y.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert h.async_pwrite(locked, fd=fd) == 0 and h.wait() == 1
    finally:
        os.close(fd)
    back = torch.empty(1024, dtype=torch.bfloat16)
    assert h.sync_pread(back, str(tmp_path / "y.bin")) == 1 and torch.equal(back, locked)
    assert h.free_cpu_locked_tensor(locked) and not h.free_cpu_locked_tensor(back)
    # DeepSpeed's positional descriptor and its keyword spelling for the example tensor.
    second = h.new_cpu_locked_tensor(num_elem=1024, example_tenosr=torch.empty(0, dtype=torch.bfloat16))
    second.copy_(torch.arange(1024).flip(0))
    fd = os.open(tmp_path / "z.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert h.async_pwrite(second, fd, 0) == 0 and h.wait() == 1
        assert h.async_pread(back, fd) == 0 and h.wait() == 1 and torch.equal(back, second)
    finally:
        os.close(fd)
    with pytest.raises(TypeError, match="filename or fd"):
        h.async_pread(back)
    with pytest.raises(FileNotFoundError):
        h.sync_pread(back, str(tmp_path / "missing.bin"))
