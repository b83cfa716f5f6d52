"""`offload_optimizer.max_in_cpu` and "auto" ([Note: host memory before the disk] in
infinity/offload/placement.py): the state of the units kept in host memory never touches the disk,
the numbers are those of everything on NVMe to the bit, and "auto" budgets from free memory."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config, engine_run
from infinity.config import load_config
from infinity.offload.placement import resolve_max_in_cpu, units_in_memory
from infinity.offload.optimizer.memory import ResidentOptimizerState

STEPS = 4


def _config(nvme, budget, *, clip: float = 1.0, param: str = "cpu") -> dict:
    cfg = config(3, param, "nvme", clip=clip)
    z = cfg["zero_optimization"]
    z["offload_optimizer"].update(nvme_path=str(nvme), buffer_count=9, max_in_cpu=budget)
    if param == "nvme":
        z["offload_param"].update(nvme_path=str(nvme), buffer_count=4, max_in_cpu=0)
    z.update(sub_group_size=4096, stage3_max_reuse_distance=0)
    cfg["aio"] = {"engine": "psync"}  # pread/pwrite from this process: /proc/self/io counts them
    return cfg


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyGPT()


def _trainable(engine):
    return [u for u in engine.units if u.trainable]


def _half(model, tmp_path) -> int:
    """Half the trainable elements, as a budget."""
    (tmp_path / "probe").mkdir()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(tmp_path / "probe", 0))
    total = sum(u.train_shard_numel for u in _trainable(engine))
    engine.close()
    return total // 2


def _disk_bytes() -> int:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def _train(model, nvme, budget, clip: float = 1.0, param: str = "cpu"):
    """(engine after STEPS steps, losses, bytes the process moved to and from the disk in them)."""
    nvme.mkdir(exist_ok=True)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(nvme, budget, clip=clip, param=param))
    data = batches(STEPS, 4)
    engine_run(engine, data[:1], gas=1)  # the first step records the order
    before = _disk_bytes()
    losses = engine_run(engine, data[1:], gas=1)
    engine.optim_state.flush()
    return engine, losses, _disk_bytes() - before


def _state(engine, unit) -> dict[str, torch.Tensor]:
    return {kind: engine.optim_state.read(unit, kind) for kind in ("master", "exp_avg", "exp_avg_sq")}


def _optimizer_file_bytes(nvme) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(nvme) for f in files
               if "optimizer" in d)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_half_the_budget_moves_half_the_bytes_with_the_same_numbers(tmp_path, model, clip):
    half = _half(model, tmp_path)
    whole, losses, moved = _train(model, tmp_path / "all", 0, clip)
    split, split_losses, split_moved = _train(model, tmp_path / "split", half, clip)
    kept = split.optim_state.kept
    units = _trainable(split)
    on_disk = sum(u.train_shard_numel for u in units if u.index not in kept)
    total = sum(u.train_shard_numel for u in units)
    assert 0 < len(kept) < len(units) and sum(u.train_shard_numel for u in units if u.index in kept) <= half
    # The disk holds, and the process moves, the state of the units not kept: about half.
    assert _optimizer_file_bytes(tmp_path / "split") / _optimizer_file_bytes(tmp_path / "all") == \
        pytest.approx(on_disk / total, rel=0.05)
    assert moved > 0 and split_moved / moved == pytest.approx(on_disk / total, rel=0.15)
    assert 0.3 < on_disk / total < 0.7
    # Bit for bit the numbers of everything on NVMe.
    assert split_losses == losses
    for a, b in zip(_trainable(whole), units, strict=True):
        for kind, value in _state(whole, a).items():
            assert torch.equal(_state(split, b)[kind], value), (a.index, kind)
    for name, value in whole.consolidated_state_dict().items():
        assert torch.equal(split.consolidated_state_dict()[name], value), name
    whole.close()
    split.close()


def test_a_budget_that_holds_everything_writes_no_optimizer_file(tmp_path, model):
    engine, _, moved = _train(model, tmp_path / "nvme", 10 ** 9)
    assert isinstance(engine.optim_state, ResidentOptimizerState) and _optimizer_file_bytes(tmp_path / "nvme") == 0
    engine.close()


def test_the_units_kept_fill_the_budget_first_fit_in_update_order(tmp_path, model):
    (tmp_path / "nvme").mkdir()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(tmp_path / "nvme", 0))
    units = _trainable(engine)
    order = [u.index for u in reversed(units)]
    sizes = {u.index: u.train_shard_numel for u in units}
    budget = sizes[order[0]] + sizes[order[2]]
    kept = [u.index for u in units_in_memory(units, budget, order)]
    assert kept[:2] == [order[0], order[2]] or sizes[order[1]] <= budget - sizes[order[0]]
    assert sum(sizes[i] for i in kept) <= budget and kept[0] == order[0]
    assert units_in_memory(units, 0, order) == []
    engine.close()


def test_auto_budgets_from_free_memory_and_says_so(tmp_path, model, caplog):
    caplog.set_level(logging.INFO, logger="infinity")
    cfg = _config(tmp_path / "nvme", "auto", param="nvme")
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = "auto"
    (tmp_path / "nvme").mkdir()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    units = _trainable(engine)
    assert engine.config.zero.offload_optimizer.max_in_cpu == sum(u.train_shard_numel for u in units)
    assert engine.config.zero.offload_param.max_in_cpu == sum(u.shard_numel for u in engine.units)
    assert isinstance(engine.optim_state, ResidentOptimizerState) and _optimizer_file_bytes(tmp_path / "nvme") == 0
    assert 'max_in_cpu "auto"' in caplog.text and "GiB of host memory available" in caplog.text
    engine.close()

    # Little memory free: the budget is what is left after the margin, and the rest goes to NVMe.
    config_ = load_config(cfg)
    total = sum(u.train_shard_numel for u in units)
    margin_only = resolve_max_in_cpu(config_, engine.units, available=0, total_memory=64 << 30)
    assert margin_only.zero.offload_optimizer.max_in_cpu == 0 and margin_only.zero.offload_param.max_in_cpu == 0
    generous = resolve_max_in_cpu(config_, engine.units, available=256 << 30, total_memory=64 << 30)
    assert generous.zero.offload_optimizer.max_in_cpu == total


def test_auto_is_accepted_only_where_infinity_resolves_it():
    minimal = {"train_micro_batch_size_per_gpu": 1}
    cfg = load_config({**minimal, "zero_optimization": {"offload_optimizer": {"max_in_cpu": "auto"},
                                                        "offload_param": {"max_in_cpu": "auto"}}})
    assert cfg.zero.offload_optimizer.max_in_cpu == cfg.zero.offload_param.max_in_cpu == "auto"
    assert load_config(minimal).zero.offload_optimizer.max_in_cpu == 0
    with pytest.raises(ValueError, match='zero_optimization.sub_group_size: "auto" must be resolved'):
        load_config({**minimal, "zero_optimization": {"sub_group_size": "auto"}})
    with pytest.raises(ValueError, match="offload_optimizer.max_in_cpu: expected a whole number"):
        load_config({**minimal, "zero_optimization": {"offload_optimizer": {"max_in_cpu": "lots"}}})


def test_auto_keeps_the_whole_state_where_it_fits_else_uses_the_room_one_way(tmp_path, model):
    """A state that fits in what is free (with every gradient accumulator, and no optimizer pool)
    is kept whole: no NVMe tier, so no pool, is made then. A byte less, and the room goes either to
    whole units beside the knobs' pool or to the pool, never to both ([Note: host memory before
    the disk]); here, small units in pieces of one sub-group, to the pool."""
    from infinity.offload.placement import OPTIMIZER_BYTES, _margin
    (tmp_path / "nvme").mkdir()
    cfg = _config(tmp_path / "nvme", "auto")
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 48
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    config_, units, total = engine.config, engine.units, 64 << 30
    state = sum(u.train_shard_numel for u in _trainable(engine))
    engine.close()
    config_ = load_config(cfg)
    lean = _margin(config_, units, total, 0, all_kept=True)
    just = lean + state * OPTIMIZER_BYTES
    kept = resolve_max_in_cpu(config_, units, available=just, total_memory=total).zero.offload_optimizer
    assert (kept.max_in_cpu, kept.pool_elements) == (state, None)
    short = resolve_max_in_cpu(config_, units, available=just - 1, total_memory=total).zero.offload_optimizer
    room = just - 1 - _margin(config_, units, total, just - 1)
    assert (short.max_in_cpu, short.pool_elements) == (0, room // 4) and short.pool_elements > 2 * state
    tight = resolve_max_in_cpu(config_, units, available=lean + state, total_memory=total).zero.offload_optimizer
    assert tight.max_in_cpu < state and (tight.max_in_cpu == 0) == (tight.pool_elements is not None)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_auto_never_moves_more_bytes_than_max_in_cpu_0(tmp_path, model, monkeypatch):
    """With host memory for a part of the state only, "auto" uses it for whole units or for the
    NVMe tier's pool, whichever streams less: a step moves no more bytes (/proc/self/io) than with
    max_in_cpu 0 and its knobs' pool, and the numbers are the same."""
    from infinity.offload import placement
    from infinity.offload.optimizer import sizing
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):  # pieces of this model's size
        monkeypatch.setattr(sizing, name, 1024)
    zero, zero_losses, zero_moved = _train(model, tmp_path / "zero", 0)
    state = sum(u.train_shard_numel for u in _trainable(zero))
    config_ = load_config(_config(tmp_path / "zero", "auto"))
    margin = placement._margin(config_, zero.units, 64 << 30, 0)
    zero_state = {u.index: _state(zero, u) for u in _trainable(zero)}
    zero.close()
    free = margin + state * placement.OPTIMIZER_BYTES // 2  # half the state's bytes beyond the margin
    memory = placement.psutil.virtual_memory()
    monkeypatch.setattr(placement.psutil, "virtual_memory", lambda: memory._replace(available=free, total=64 << 30))
    auto, auto_losses, auto_moved = _train(model, tmp_path / "auto", "auto")
    chosen = auto.config.zero.offload_optimizer
    assert 0 < chosen.max_in_cpu < state or chosen.pool_elements is not None  # the room is used, one way
    assert 0 < auto_moved <= zero_moved, (auto_moved, zero_moved)
    assert auto_losses == zero_losses
    for u in _trainable(auto):
        for kind, value in _state(auto, u).items():
            assert torch.equal(value, zero_state[u.index][kind]), (u.index, kind)
    auto.close()
