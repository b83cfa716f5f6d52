"""The parameter tier's writes held for the backward ([Note: parameter writes held for the
backward] in infinity/offload/held_writes.py): the bytes on disk are read back with plain file
reads, not taken from the engine's account of them."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config
from infinity.io import AsyncIOHandle, aligned_empty
from infinity.offload.held_writes import HeldWrites

PAGE = 4096


def _on_disk(path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), nbytes, offset)


def _page(value: int) -> torch.Tensor:
    buf = aligned_empty(PAGE)
    buf.fill_(value)
    return buf


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(2)]
    for p in paths:
        p.write_bytes(bytes(PAGE))
    return paths


def test_held_writes_reach_the_disk_when_released(files):
    writes = HeldWrites(AsyncIOHandle())
    writes.hold()
    first, second = writes.submit_write(_page(1), str(files[0])), writes.submit_write(_page(2), str(files[1]))
    assert not writes.done(first) and not writes.done(second)
    assert _on_disk(files[0], 0, PAGE) == bytes(PAGE) and _on_disk(files[1], 0, PAGE) == bytes(PAGE)
    writes.release()
    assert not writes.holding
    writes.wait(first)
    writes.wait(second)
    assert _on_disk(files[0], 0, PAGE) == bytes([1]) * PAGE and _on_disk(files[1], 0, PAGE) == bytes([2]) * PAGE
    assert writes.issued_at(first) is not None and writes.issued_at(first) is None  # asked once
    plain = writes.submit_write(_page(3), str(files[0]))  # not holding: straight to the handle
    writes.wait(plain)
    assert writes.issued_at(plain) is None and _on_disk(files[0], 0, PAGE) == bytes([3]) * PAGE


def test_a_wait_for_a_held_write_submits_what_is_held(files):
    writes = HeldWrites(AsyncIOHandle())
    writes.hold()
    first, second = writes.submit_write(_page(4), str(files[0])), writes.submit_write(_page(5), str(files[1]))
    waiter = threading.Thread(target=writes.wait, args=(second,), daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "a wait for a held write never returned"
    writes.wait(first)  # submitted with it, in its order
    assert _on_disk(files[0], 0, PAGE) == bytes([4]) * PAGE and _on_disk(files[1], 0, PAGE) == bytes([5]) * PAGE
    assert writes.holding  # still holding what comes next
    third = writes.submit_write(_page(6), str(files[0]))
    assert not writes.done(third)
    writes.release()
    writes.wait(third)
    assert _on_disk(files[0], 0, PAGE) == bytes([6]) * PAGE


def test_the_oldest_held_write_goes_first_when_its_buffer_is_needed(files):
    writes = HeldWrites(AsyncIOHandle())
    writes.hold()
    first, second = writes.submit_write(_page(9), str(files[0])), writes.submit_write(_page(10), str(files[1]))
    writes.submit_oldest()
    writes.wait(first)
    assert _on_disk(files[0], 0, PAGE) == bytes([9]) * PAGE
    assert not writes.done(second) and _on_disk(files[1], 0, PAGE) == bytes(PAGE)  # still held
    writes.release()
    writes.wait(second)
    assert _on_disk(files[1], 0, PAGE) == bytes([10]) * PAGE


def test_a_held_write_that_cannot_be_submitted_fails_at_its_wait(tmp_path, files):
    writes = HeldWrites(AsyncIOHandle())
    writes.hold()
    lost = writes.submit_write(_page(7), str(tmp_path / "no such directory" / "f"))
    kept = writes.submit_write(_page(8), str(files[0]))
    writes.release()  # the submission fails here; nobody waits yet
    assert writes.done(lost)
    with pytest.raises(OSError):
        writes.wait(lost)
    writes.wait(kept)  # the writes after it are not lost with it
    assert _on_disk(files[0], 0, PAGE) == bytes([8]) * PAGE


def _param_extents(engine) -> dict[int, tuple]:
    store = engine.params.store
    return {u.index: store.extent("param", u.index) for u in engine.units if u.train_shard_numel}


def test_a_clipped_steps_new_parameters_reach_the_disk_in_the_backward(tmp_path):
    """Clipping with the optimizer state on NVMe: the next forward runs the updates, and the
    parameter files keep the old values until the backward starts; then they hold the new ones,
    the values the engine computes with."""
    cfg = config(3, "nvme", "nvme", clip=1.0)
    for tier in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][tier].update(nvme_path=str(tmp_path), max_in_cpu=0)
    # A buffer for each unit's new values and the fetches beside them: a pool that cannot spare
    # them sends the oldest held writes on in the forward (test_the_oldest_held_write_goes_first...).
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 16
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=cfg)
    try:
        data = batches(2, 4)
        engine.backward(engine(*data[0]))
        engine.step()  # every update waits for the next forward
        extents = _param_extents(engine)
        engine.params.flush()
        before = {i: _on_disk(e.path, e.offset, e.nbytes) for i, e in extents.items()}
        loss = engine(*data[1])  # runs the updates: the new values are used, not yet written
        during = {i: _on_disk(e.path, e.offset, e.nbytes) for i, e in extents.items()}
        assert during == before
        engine.backward(loss)
        engine.params.flush()
        after = {i: _on_disk(e.path, e.offset, e.nbytes) for i, e in extents.items()}
        assert all(after[i] != before[i] for i in extents)
        units = {u.index: u for u in engine.units}
        for i, e in extents.items():
            values = engine.params.host_copy(units[i])[:units[i].train_shard_numel]
            assert after[i] == values.view(torch.uint8).numpy().tobytes()[:e.nbytes]
        engine.step()
    finally:
        engine.close()
