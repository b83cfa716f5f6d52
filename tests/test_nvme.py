"""ZeRO-Infinity: parameters and optimizer state on NVMe train exactly like the in-memory run."""

from __future__ import annotations

import copy
import itertools
import os
import time

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config, engine_run, reference_run, run_placements
from infinity.offload.optimizer import accumulators
from infinity.offload.shard import FetchHandle

STEPS = 10


def nvme_config(path, param: str, optim: str, *, gas: int = 1, param_buffers: int = 4, **zero) -> dict:
    cfg = config(3, param, optim, gas)
    z = cfg["zero_optimization"]
    if param == "nvme":
        z["offload_param"].update(nvme_path=str(path), buffer_count=param_buffers, max_in_cpu=0)
    if optim == "nvme":
        z["offload_optimizer"].update(nvme_path=str(path), buffer_count=9)
    z.update(sub_group_size=4096, stage3_max_reuse_distance=0, **zero)
    return cfg


def assert_matches_pytorch(engine, losses, ref_losses, ref_model) -> None:
    """Per-step losses and final parameters within 1e-5 of plain PyTorch."""
    for x, y in zip(losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y)
    state = engine.consolidated_state_dict()
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyGPT()


@pytest.fixture(scope="module")
def cpu_run(model):
    data = batches(STEPS, 4)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu"))
    losses = engine_run(engine, data, gas=1)
    return losses, engine.consolidated_state_dict()


@pytest.mark.parametrize("param,optim", [("nvme", "cpu"), ("cpu", "nvme"), ("nvme", "nvme"), ("nvme", "none")])
def test_parity_and_bit_identical_to_cpu_offload(tmp_path, model, cpu_run, param, optim):
    data = batches(STEPS, 4)
    ref_losses, ref_model = reference_run(model, data, gas=1)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path, param, optim))
    losses = engine_run(engine, data, gas=1)
    state = engine.consolidated_state_dict()
    for x, y in zip(losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y)
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)
    # Same numbers as keeping everything in host memory, to the bit.
    assert losses == cpu_run[0]
    assert all(torch.equal(state[k], cpu_run[1][k]) for k in state)
    engine.close()


DEVICES = ("none", "cpu", "nvme")


@pytest.mark.parametrize("param", DEVICES)
@pytest.mark.parametrize("optim", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_offload_combination_matches_cpu_offload(tmp_path, model, param, optim, precision):
    """All nine placements train to the same bits as offload cpu/cpu, in every precision."""
    data = batches(3, 4)
    runs = []
    for p, o in (("cpu", "cpu"), (param, optim)):
        cfg = nvme_config(tmp_path, p, o)
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, data, gas=1), engine.consolidated_state_dict()))
        on_gpu = engine.device.type == "cuda"
        engine.close()
    if on_gpu and optim == "none":  # torch's Adam on the GPU, not our CPU kernel
        torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-3, atol=0)
        return
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_gradient_accumulation_and_bf16_on_nvme(tmp_path, model):
    data = batches(8, 4)
    cfg_cpu = config(3, "cpu", "cpu", gas=4)
    cfg_cpu["bf16"] = {"enabled": True}
    cfg_nvme = nvme_config(tmp_path, "nvme", "nvme", gas=4)
    cfg_nvme["bf16"] = {"enabled": True}
    runs = []
    for cfg in (cfg_cpu, cfg_nvme):
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, data, gas=4), engine.consolidated_state_dict()))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "nvme"), ("nvme", "none")])
@pytest.mark.parametrize("gas", [1, 2])
def test_update_during_backward_matches_pytorch(tmp_path, model, param, optim, gas):
    """Without clipping or fp16 a unit is updated the moment its gradient is final, inside
    backward; the numbers stay PyTorch's."""
    data = batches(2 * gas, 4)
    ref_losses, ref_model = reference_run(model, data, gas=gas, clip=0.0)
    cfg = nvme_config(tmp_path, param, optim, gas=gas)
    cfg["gradient_clipping"] = 0.0
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert engine.update_in_backward
    first = 0.0
    for m, (idx, tgt) in enumerate(data[:gas]):
        loss = engine(idx, tgt)
        first += loss.item() / gas
        engine.backward(loss)
        # Updated in the last micro-step's backward, before step() was called.
        assert engine.optimizer.step_count == (1 if m == gas - 1 else 0)
        engine.step()
    updatable = [u for u in engine.units if not u.persistent and any(s.group >= 0 for s in u.slots)]
    assert engine.report.last["units_updated_in_backward"] == len(updatable) > 0
    losses = [first] + engine_run(engine, data[gas:], gas=gas)
    assert_matches_pytorch(engine, losses, ref_losses, ref_model)
    engine.close()


def test_clipping_keeps_the_update_after_backward(tmp_path, model):
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path, "nvme", "nvme"))
    assert not engine.update_in_backward
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    assert engine.optimizer.step_count == 0  # the global norm is needed first
    engine.step()
    assert engine.optimizer.step_count == 1 and engine.report.last["units_updated_in_backward"] == 0
    engine.close()


@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("budget", ["none", "some"])
def test_gradients_beyond_max_grad_in_cpu_spill_to_nvme(tmp_path, model, gas, budget):
    """Accumulators that do not fit the host budget live in the store; the bits do not change."""
    data = batches(2 * gas, 4)
    cpu = config(3, "cpu", "cpu", gas=gas)
    spill = nvme_config(tmp_path, "nvme", "nvme", gas=gas)
    runs = []
    for cfg in (cpu, spill):
        if cfg is spill:
            largest = max(u.shard_numel for u in engine.units)
            cfg["zero_optimization"]["offload_optimizer"].update(
                max_grad_in_cpu=0 if budget == "none" else largest, buffer_count=12)  # 4 kinds a piece
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, data, gas=gas), engine.consolidated_state_dict()))
        if cfg is spill:
            in_memory = len(engine.units) - len(engine.optim_state.acc.spilled)
            assert in_memory == (0 if budget == "none" else 1) and engine.optim_state.acc.spilled
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("precision,optimizer", [("bf16", "AdamW"), ("fp16", "AdamW"), ("bf16", "Lamb")])
def test_one_pass_spills_gradients_in_their_own_dtype(tmp_path, model, precision, optimizer):
    """[Note: one pass spills its own dtype]: with one pass an accumulation, a spilled gradient is
    stored as it landed, 2 bytes a value on disk; the bits are those of gradients kept in memory."""
    data = batches(3, 4)
    runs = []
    for spill in (False, True):
        cfg = nvme_config(tmp_path, "nvme", "nvme")
        cfg[precision] = {"enabled": True}
        cfg["optimizer"]["type"] = optimizer  # LAMB reads the spilled gradient in its norms' pass too
        if spill:
            cfg["zero_optimization"]["offload_optimizer"].update(max_grad_in_cpu=0, buffer_count=12)
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, data, gas=1), engine.consolidated_state_dict()))
        if spill:
            acc, store = engine.optim_state.acc, engine.optim_state.store
            spilled = sum(u.train_shard_numel for u in engine.units if u.index in acc.spilled)
            assert spilled > 0
            size = os.path.getsize(store.file_path("grad"))  # the file on disk, as created
            assert 2 * spilled <= size < 4 * spilled
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def _accumulators(engine) -> list[torch.Tensor]:
    """The gradient accumulators a tier keeps in host memory."""
    tier = engine.optim_state
    return list(tier.acc.host.values()) if hasattr(tier, "acc") else list(tier._grads.values())


# The reference: CPU offload with fp32 accumulators (the tiers' before [Note: one pass keeps its own dtype]).
TIERS = [("fp32", "cpu"), ("half", "cpu"), ("half", "nvme")]


@pytest.mark.parametrize("gas", [1, 2])
def test_one_pass_keeps_gradients_in_host_memory_in_their_own_dtype(tmp_path, model, monkeypatch, gas):
    """[Note: one pass keeps its own dtype]: a clipped bf16 step of one pass keeps each unit's
    gradient in 2 bytes a value of host memory (the accumulators' own storages counted), 4 where
    passes accumulate, in the CPU and the NVMe tier; the bits are those of fp32 accumulators."""
    data = batches(2 * gas, 4)
    runs = []
    for kept, optim in TIERS:
        monkeypatch.setattr(accumulators, "ONE_PASS_KEEPS_ITS_DTYPE", kept == "half")
        cfg = nvme_config(tmp_path, "nvme", optim, gas=gas) if optim == "nvme" else config(3, "cpu", "cpu", gas)
        cfg["bf16"] = {"enabled": True}
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, data, gas=gas), engine.consolidated_state_dict()))
        accs = _accumulators(engine)
        values = sum(a.numel() for a in accs)
        assert values == sum(u.train_shard_numel for u in engine.units if u.trainable) > 0
        assert sum(a.untyped_storage().nbytes() for a in accs) == (2 if gas == 1 and kept == "half" else 4) * values
        engine.close()
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(state[k], runs[0][1][k]) for k in state)


@pytest.mark.parametrize("budget", ["none", "all"])
def test_a_half_gradient_accumulates_in_fp32_when_passes_accumulate_after_all(tmp_path, model, monkeypatch, caplog,
                                                                              budget):
    """gradient_accumulation_steps 1, but the caller holds the boundary back for a pass
    (`set_gradient_accumulation_boundary(False)`): the units whose gradients wait in bf16, in host
    memory or spilled (`none` in memory, NVMe tier), sum in fp32 in host memory instead, as fp32
    accumulators do, to the bit, and the log says why."""
    data = batches(4, 4)
    runs = []
    for kept, optim in TIERS:
        monkeypatch.setattr(accumulators, "ONE_PASS_KEEPS_ITS_DTYPE", kept == "half")
        cfg = nvme_config(tmp_path, "nvme", optim) if optim == "nvme" else config(3, "cpu", "cpu", 1)
        cfg["bf16"] = {"enabled": True}
        if optim == "nvme" and budget == "none":
            cfg["zero_optimization"]["offload_optimizer"].update(max_grad_in_cpu=0, buffer_count=12)
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        losses = []
        caplog.clear()
        with caplog.at_level("WARNING", logger="infinity"):
            for k, (idx, tgt) in enumerate(data):
                engine.set_gradient_accumulation_boundary(k % 2 == 1)
                loss = engine(idx, tgt)
                engine.backward(loss)
                if k % 2 == 1:
                    engine.step()
                losses.append(loss.item())
        runs.append((losses, engine.consolidated_state_dict()))
        assert all(a.dtype == torch.float32 for a in _accumulators(engine))
        assert ("gradient_accumulation_steps is 1" in caplog.text) == (kept == "half")
        engine.close()
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(state[k], runs[0][1][k]) for k in state)


def test_pieces_cut_a_shard_evenly_without_slivers():
    """Every piece takes a whole pool buffer per kind: a sliver left after cutting at
    sub_group_size wastes them ([Note: cutting pieces])."""
    from infinity.offload.optimizer.sizing import PIECE_ALIGN, cut_pieces

    for numel in (1, 1000, 4096, 4097, 50_343_936, 65_536_000, 3 * 2 ** 20 + 5, 10 ** 9 + 7):
        for target in (4096, 2.5e7, 1e9):
            pieces = cut_pieces(numel, target)
            assert [s for s, _ in pieces] == list(itertools.accumulate([0] + [n for _, n in pieces[:-1]]))
            assert sum(n for _, n in pieces) == numel and all(s % PIECE_ALIGN == 0 for s, _ in pieces)
            sizes = [n for _, n in pieces]
            assert max(sizes) <= 1.5 * target + PIECE_ALIGN
            assert len(pieces) == 1 or min(sizes) >= max(sizes) - len(pieces) * PIECE_ALIGN
    # A 2048-wide transformer block at sub_group_size 2.5e7: two pieces, not two and a sliver.
    assert [n for _, n in cut_pieces(50_343_936, 2.5e7)] == [25_171_968, 25_171_968]


def test_deferred_updates_keep_the_first_updated_gradients_in_memory(tmp_path, model):
    """With clipping the updates run in the next forward's order, so the gradient read back
    from the store should be the last one needed, not the embedding's, needed first."""
    cfg = nvme_config(tmp_path, "nvme", "nvme")
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    sizes = sorted(u.shard_numel for u in engine.units)  # blocks, then the root (embedding and head)
    engine.close()
    # Room for two accumulators: the root's and one block's.
    cfg["zero_optimization"]["offload_optimizer"].update(max_grad_in_cpu=sizes[-1] + sizes[-2], buffer_count=12)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    state = engine.optim_state
    updated, real_update = [], state.update
    state.update = lambda unit, *a, **k: (updated.append(unit.index), real_update(unit, *a, **k))
    grad_reads, real_fetch = [], state.swapper.fetch
    state.swapper.fetch = lambda kind, key: (grad_reads.append(key[0]) if kind == "grad" else None,
                                             real_fetch(kind, key))[1]
    data = batches(3, 4)
    engine_run(engine, data[:2], gas=1)
    updated.clear()
    grad_reads.clear()
    engine.backward(engine(*data[2]))  # runs the second step's updates, deferred to this forward
    engine.step()
    # The first two updates (the root's, then the first block's) read no spilled gradient.
    assert len(updated) == len(engine.units) and grad_reads
    assert not set(updated[:2]) & set(grad_reads) and updated[-1] in grad_reads
    engine.close()


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_the_first_step_reads_state_ahead_in_the_order_of_its_updates(tmp_path, model, clip):
    """No order is recorded before the first step, yet its reads of optimizer state should start
    with its forward, in the order the updates will run: the next forward's with clipping
    (before, they began in backward, in backward's order, and the next forward waited for the
    root's state), backward's without."""
    cfg = nvme_config(tmp_path, "nvme", "nvme")
    cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 30  # room to read ahead
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    state = engine.optim_state
    reads, real_fetch = [], state.swapper.fetch
    state.swapper.fetch = lambda kind, key: (reads.append(key[0]) if kind == "master" else None,
                                             real_fetch(kind, key))[1]
    updated, real_update = [], state.update
    state.update = lambda unit, *a, **k: (updated.append(unit.index), real_update(unit, *a, **k))
    data = batches(2, 4)
    loss = engine(*data[0])
    read_in_forward = list(dict.fromkeys(reads))
    engine.backward(loss)
    engine.step()
    engine.backward(engine(*data[1]))  # with clipping, this forward runs the first step's updates
    engine.step()
    first_updates = updated[:len(state.pieces.of)]
    assert sorted(first_updates) == sorted(state.pieces.of)
    assert read_in_forward and read_in_forward == first_updates[:len(read_in_forward)]
    engine.close()


@pytest.mark.parametrize("spill,pool", [(False, "roomy"), (True, "roomy"), (False, "tight")])
def test_every_step_moves_the_bytes_the_layout_predicts(tmp_path, spill, pool):
    """roomy: DeepSpeed's buffer_size (1e8) gives the parameter pool a buffer for each of the 33
    shards, where a released shard stays cached (no read again); tight: 8 buffers."""
    torch.manual_seed(0)
    deep = TinyGPT(layers=32, d=16)
    cfg = nvme_config(tmp_path, "nvme", "nvme", param_buffers=4)
    if pool == "tight":
        cfg["zero_optimization"]["offload_param"]["buffer_size"] = 8192
    if spill:
        cfg["zero_optimization"]["offload_optimizer"].update(max_grad_in_cpu=0, buffer_count=12)
    engine, *_ = infinity.initialize(deep, config=cfg)
    assert len(engine.units) >= 33
    gathers, shared = [], []
    real_gather = engine.fetcher._gather
    engine.fetcher._gather = lambda unit: (gathers.append(unit.index), real_gather(unit))
    swapper = engine.params.swapper
    real_fetch = swapper.fetch

    def fetch(kind, key):  # a fetch of a shard still in host memory (its buffer not back yet) reads nothing
        hits = swapper.stats.hits
        handle = real_fetch(kind, key)
        if swapper.stats.hits > hits:
            shared.append(key)
        return handle

    swapper.fetch = fetch
    data = batches(3, 4)
    engine_run(engine, data[:1], gas=1)  # first step records the order
    for idx, tgt in data[1:]:
        gathers.clear()
        shared.clear()
        engine.backward(engine(idx, tgt))
        engine.step()
        report = engine.report.last
        shard_bytes = {u.index: u.shard_numel * 4 for u in engine.units}
        # max_in_cpu 0 and no reuse window: a backward gather reads the unit's shard unless it is
        # still in a pool buffer (its last read's buffer not back yet, or the shard cached in an
        # idle buffer: [Note: cache memory] in offload/cache.py); and the update writes each shard
        # once. Optimizer state: 12 bytes per
        # element read and written, and 4 more for a gradient spilled in backward and read
        # back for the update.
        # A unit whose next use is the very next one stays gathered for it ([Note: recorded order]).
        uses = engine.fetcher.schedule
        repeats = sum(a == b for a, b in zip(uses, uses[1:]))
        assert sorted(set(gathers)) == [u.index for u in engine.units]
        assert len(uses) >= 2 * len(engine.units) and len(gathers) >= 2 * len(engine.units) - repeats
        # The forward may find a unit's new values still in the buffer its update (run just
        # before, [Note: updates after the norm]) is writing them from; the backward reads every
        # unit it gathers that the pool's buffers could not keep.
        buffers = engine.params.pool.buffer_count
        assert (buffers >= len(engine.units)) == (pool == "roomy")
        if pool == "roomy":
            assert report["nvme_read_bytes"] == 0 and not set(gathers) - set(shared)
        else:
            assert len(gathers) - len(shared) >= len(engine.units) - repeats - buffers
        assert report["nvme_read_bytes"] == sum(shard_bytes[i] for i in gathers) - sum(shard_bytes[i] for i in shared)
        assert report["nvme_write_bytes"] == sum(shard_bytes.values())
        state = sum((16 if spill else 12) * u.shard_numel for u in engine.units)
        # Pieces the optimizer's pool holds from step to step are written, never read again
        # ([Note: the pool is a budget] in offload/optimizer/sizing.py).
        tier = engine.optim_state
        held = sum(p.numel for ps in tier.pieces.of.values() for p in ps if p.held)
        # A piece fetched again for the next step while its write is in flight reads nothing
        # either, as far as the pool's buffers go.
        unread = state - 12 * held - report["optimizer_nvme_read_bytes"]
        assert 0 <= unread <= tier.pool.stats.bytes_total
        assert report["optimizer_nvme_write_bytes"] == state
    # The pool never held more than it has.
    assert engine.params.pool.stats.peak_in_use <= engine.params.pool.stats.bytes_total
    engine.close()


def test_prefetch_hides_slow_reads(tmp_path):
    """With every read delayed, prefetching ahead in the recorded order beats reading on demand
    (33 units, a pool of 8 buffers: most shards are read again each step). Timed where the step
    blocks on the parameters' reads (its waits, clocked here around the swapper's `wait`), not
    the whole step, whose compute a busy host stretches in both runs alike."""
    blocked = {}
    torch.manual_seed(0)
    model = TinyGPT(layers=32, d=16)
    for prefetch in (0, 10 ** 9):
        cfg = nvme_config(tmp_path, "nvme", "cpu", param_buffers=8, stage3_prefetch_bucket_size=prefetch)
        cfg["zero_optimization"]["offload_param"]["buffer_size"] = 8192  # the largest shard: no more buffers
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        swapper = engine.params.swapper
        swapper.read_delay_s = 0.03  # each read takes at least this long
        engine_run(engine, batches(1, 4), gas=1)  # records the order
        wait, spent = swapper.wait, []

        def timed_wait(handle, *args, **kwargs):
            start = time.perf_counter()
            try:
                return wait(handle, *args, **kwargs)
            finally:
                if isinstance(handle, FetchHandle):
                    spent.append(time.perf_counter() - start)

        swapper.wait = timed_wait
        engine_run(engine, batches(1, 4, seed=5), gas=1)
        del swapper.wait
        blocked[prefetch] = (sum(spent), len(spent))
        engine.close()
    assert blocked[10 ** 9][0] < 0.5 * blocked[0][0], blocked


def test_report_and_overlap(tmp_path, model):
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path, "nvme", "nvme"))
    engine_run(engine, batches(2, 4), gas=1)
    r = engine.report.last
    for key in ("nvme_read_bytes", "nvme_write_bytes", "nvme_read_gbps", "nvme_wait_seconds", "overlap_fraction",
                "optimizer_nvme_read_bytes", "optimizer_overlap_fraction"):
        assert key in r, key
    assert 0.0 <= r["overlap_fraction"] <= 1.0
    engine.close()


MEMORY_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import infinity
from gpt import TinyGPT, batches, config, engine_run
from test_nvme import nvme_config
torch.manual_seed(0)
model = TinyGPT(layers=24, d=384)
params = sum(p.numel() for p in model.parameters())
if sys.argv[3] == "memory":
    cfg = config(3, "cpu", "cpu")
else:
    cfg = nvme_config(sys.argv[1], "nvme", "nvme", param_buffers=4)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 200_000
    cfg["zero_optimization"]["offload_optimizer"].update(max_grad_in_cpu=0, buffer_count=12)
    # 12 sub-groups of 1e6 elements: a budget well under the model ([Note: the pool is a budget];
    # the default sub_group_size, 1e9, makes each a sub-group as large as the whole state)
    cfg["zero_optimization"]["sub_group_size"] = 1_000_000
    # and a prefetch of two layers: DeepSpeed's default (5e7 elements) reads this whole model
    # ahead, and the parameter pool grows to as many buffers as the prefetch reads into
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 4_000_000
engine, *_ = infinity.initialize(model, config=cfg)
engine_run(engine, batches(3, 4), gas=1)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of a large
# pytest process would report the parent's peak (the same number for both placements).
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
out = {"params": params, "peak": peak}
if sys.argv[3] == "nvme":
    out.update(pools=engine.params.pool.stats.bytes_total + engine.optim_state.pool.stats.bytes_total,
               param_pool_peak=engine.params.pool.stats.peak_in_use,
               param_pool_total=engine.params.pool.stats.bytes_total,
               optim_pool_peak=engine.optim_state.pool.stats.peak_in_use,
               optim_pool_total=engine.optim_state.pool.stats.bytes_total,
               cache_peak=engine.params.cache.peak_bytes, cache_max=engine.params.cache.max_bytes,
               grads_in_memory=len(engine.units) - len(engine.optim_state.acc.spilled))
print(json.dumps(out))
engine.close()
"""


@pytest.mark.slow
def test_host_memory_stays_within_budgets(tmp_path):
    """The all-NVMe run holds no per-parameter state in host memory: its peak RSS is the
    in-memory run's minus what that one keeps per parameter, plus the configured pools."""
    runs = run_placements(MEMORY_SCRIPT, tmp_path)
    m = runs["nvme"]
    # Engine accounting: the pools and the cache never held more than configured.
    assert m["param_pool_peak"] <= m["param_pool_total"]
    assert m["optim_pool_peak"] <= m["optim_pool_total"]
    assert m["cache_peak"] <= m["cache_max"]
    assert m["grads_in_memory"] == 0  # max_grad_in_cpu 0: every accumulator spilled
    # The in-memory run keeps 20 bytes a parameter (fp32 shard, master, two moments, gradient
    # accumulator), 4 of which can reuse what the allocator kept of the model's freed weights
    # (measured here: the NVMe run peaks about 14 bytes a parameter lower). Both runs share
    # model, data, activations and allocator, so the rest cancels out. Require 12 bytes a
    # parameter beyond the pools (the cache keeps its shards in pool buffers: [Note: cache memory]
    # in infinity/offload/cache.py): holding the optimizer state, or the gradients on top of the
    # freed weights, in memory would fail it.
    bound = runs["memory"]["peak"] - 12 * m["params"] + m["pools"]
    assert m["peak"] <= bound, runs
    assert 12 * m["params"] > 4 * m["pools"], "the model is too small for the bound to mean anything"


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_units_left_for_step_keep_their_own_gradients(tmp_path, model, param):
    """Without clipping, the persistent unit (the small parameters) is updated in step(), after
    other units' gradients went through the same reused buffer: it must have kept its own."""
    data = batches(3, 4)
    ref_losses, ref_model = reference_run(model, data, gas=1, clip=0.0)
    cfg = nvme_config(tmp_path, param, "nvme", stage3_param_persistence_threshold=10 ** 4)
    cfg["gradient_clipping"] = 0.0
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert any(u.persistent for u in engine.units)
    losses = engine_run(engine, data, gas=1)
    assert_matches_pytorch(engine, losses, ref_losses, ref_model)
    engine.close()


def _locked_bytes() -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def test_pin_memory_false_leaves_the_nvme_pools_pageable(model, tmp_path):
    """offload_param/offload_optimizer.pin_memory (default true, as DeepSpeed 0.19.8): the pools'
    bytes are page-locked, as the kernel counts them (VmLck), or left pageable when false."""
    locked = {}
    for pin in (True, False):
        cfg = nvme_config(tmp_path, "nvme", "nvme")
        for section in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][section]["pin_memory"] = pin
        before = _locked_bytes()
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        locked[pin] = _locked_bytes() - before
        pools = engine.params.pool.stats.bytes_total + engine.optim_state.pool.stats.bytes_total
        engine.close()
        del engine
    if locked[True] < pools:
        pytest.skip(f"mlock is limited here (RLIMIT_MEMLOCK): {locked[True]} bytes locked of {pools}")
    assert locked[False] <= locked[True] - pools


def test_updates_after_the_norm_are_seen_by_every_read_before_the_next_forward(tmp_path):
    """[Note: updates after the norm]: with clipping the NVMe engine leaves each unit's update until
    its next use. Whatever reads the weights first (consolidated_state_dict, GatheredParameters,
    an eval forward) must see the step's result: compared with plain PyTorch after the same steps."""
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    data = batches(2, 4)
    _, ref = reference_run(model, data, gas=1)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path, "nvme", "nvme"))
    engine_run(engine, data, gas=1)
    assert len(engine.updates) > 0  # the case under test: updates still pending
    with infinity.zero.GatheredParameters([engine.module.blocks[1].fc1.weight]):
        torch.testing.assert_close(engine.module.blocks[1].fc1.weight.detach(), ref.blocks[1].fc1.weight.detach(),
                                   rtol=1e-5, atol=1e-5)
    engine.eval()
    idx, tgt = batches(1, 4, seed=7)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine(idx, tgt), ref(idx, tgt), rtol=1e-5, atol=1e-5)
    state = engine.consolidated_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5)
    engine.close()


def test_a_checkpoint_loaded_between_steps_is_what_the_next_forward_reads(tmp_path, model):
    """[Note: reading across the step boundary] in fetcher.py: the next step's first shards are
    read as soon as a step ends; a load before that forward must drop those reads."""
    for sub in ("nvme", "nvme2"):
        (tmp_path / sub).mkdir()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path / "nvme", "nvme", "cpu"))
    data = batches(3, 4)
    engine_run(engine, data[:1], gas=1)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="one")
    engine_run(engine, data[1:2], gas=1)  # on the recorded order: ends by reading the next step's first shards
    root = next(u.index for u in engine.units if u.name == "<root>")
    assert root in engine.params._prefetched
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="one")
    idx, tgt = data[2]
    with torch.no_grad():
        loss = engine(idx, tgt).item()
    engine.close()
    fresh, *_ = infinity.initialize(copy.deepcopy(model), config=nvme_config(tmp_path / "nvme2", "nvme", "cpu"))
    fresh.load_checkpoint(str(tmp_path / "ckpt"), tag="one")
    with torch.no_grad():
        expected = fresh(idx, tgt).item()
    fresh.close()
    assert loss == expected
    # And both are plain PyTorch's numbers after that one step.
    _, ref_model = reference_run(model, data[:1], gas=1)
    with torch.no_grad():
        plain = ref_model(idx, tgt).item()
    assert abs(loss - plain) <= 1e-5 * abs(plain), (loss, plain)
