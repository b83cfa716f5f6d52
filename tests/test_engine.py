"""The engine against plain PyTorch: same seed, same data, same losses and parameters."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from gpt import DIM, VOCAB, TinyGPT, batches, config, engine_run, reference_run
from torch import nn

import infinity

STEPS = 20


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rtol * abs(y), f"step {i}: {x} vs {y}"


def _params_close(engine, ref_model, atol: float = 1e-5) -> None:
    state = engine.consolidated_state_dict()
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=atol, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyGPT()


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage,param,optim", [(3, "none", "none"), (3, "none", "cpu"), (3, "cpu", "cpu"),
                                               (2, "none", "none"), (2, "none", "cpu")])
def test_parity_with_pytorch(model, stage, param, optim, gas):
    data = batches(STEPS * gas, 4)
    ref_losses, ref_model = reference_run(model, data, gas=gas)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(stage, param, optim, gas))
    losses = engine_run(engine, data, gas=gas)
    _close(losses, ref_losses)
    _params_close(engine, ref_model)
    assert engine.global_steps == STEPS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, model, cases, results, nvme_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for key, (stage, param, optim, gas, clip, spill) in cases.items():
            data = batches(STEPS * gas, 4)
            cfg = config(stage, param, optim, gas, micro=2, clip=clip)
            for section, device in (("offload_param", param), ("offload_optimizer", optim)):
                if device == "nvme":
                    cfg["zero_optimization"][section].update(nvme_path=nvme_path, buffer_count=12 if spill else 9)
            if spill:
                cfg["zero_optimization"]["offload_optimizer"]["max_grad_in_cpu"] = 0
            engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
            losses = engine_run(engine, data, gas=gas, rank=rank, world=2)
            state = engine.consolidated_state_dict()
            if stage == 3:
                with pytest.raises(RuntimeError, match="consolidated_state_dict"):
                    engine.module.state_dict()  # no rank holds the values whole: said, never a hang
            else:  # stages 1 and 2 keep every parameter whole on every rank
                assert all(torch.equal(v, state[k]) for k, v in engine.module.state_dict().items() if rank == 0)
            engine.close()
            if rank == 0:
                results[key] = (losses, state)
            else:
                assert state == {}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_one_rank_pytorch(model, tmp_path):
    # (stage, offload_param, offload_optimizer, gas, gradient_clipping, gradients spilled to NVMe)
    cases = {"s3-cpu-gas1": (3, "cpu", "cpu", 1, 1.0, False), "s3-none-gas4": (3, "none", "none", 4, 1.0, False),
             "s2-cpu-gas1": (2, "none", "cpu", 1, 1.0, False), "s3-nvme-gas2": (3, "nvme", "nvme", 2, 1.0, False),
             "s3-nvme-update-in-backward": (3, "nvme", "nvme", 1, 0.0, False),
             "s3-nvme-spilled-grads-gas2": (3, "nvme", "nvme", 2, 1.0, True)}
    _two_ranks_match_pytorch(model, cases, tmp_path)


def _two_ranks_match_pytorch(model, cases, tmp_path) -> dict:
    """Runs `cases` on two gloo ranks and checks each against one-process PyTorch; returns the
    final fp32 states."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_rank_worker, args=(_free_port(), model, cases, results, str(tmp_path)), nprocs=2)
        results = dict(results)
    for key, (stage, param, optim, gas, clip, spill) in cases.items():
        ref_losses, ref_model = reference_run(model, batches(STEPS * gas, 4), gas=gas, clip=clip, world=2)
        losses, state = results[key]
        _close(losses, ref_losses)
        for name, value in ref_model.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, where=f"{key}: {name}": f"{where}\n{m}")
    return {key: state for key, (_, state) in results.items()}


@pytest.mark.slow
def test_two_ranks_with_frozen_parameters_match_pytorch(model, tmp_path):
    """Frozen regions are sharded like trainable ones: two ranks with a frozen embedding (tied
    head: the root unit is mixed) and a frozen block train as plain PyTorch does."""
    frozen = copy.deepcopy(model)
    frozen.emb.weight.requires_grad_(False)
    frozen.blocks[1].requires_grad_(False)
    cases = {"s3-nvme": (3, "nvme", "nvme", 1, 1.0, False), "s3-cpu-update-in-backward": (3, "cpu", "cpu", 1, 0.0, False)}
    for state in _two_ranks_match_pytorch(frozen, cases, tmp_path).values():
        assert torch.equal(state["emb.weight"], frozen.emb.weight)
        assert torch.equal(state["blocks.1.fc1.weight"], frozen.blocks[1].fc1.weight)


def test_live_parameters_stay_within_budget(model):
    unit_numel = max(p.numel() for p in [torch.cat([q.reshape(-1) for q in b.parameters()]) for b in model.blocks])
    bound = unit_numel  # room for one block
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(
        3, "cpu", "cpu", stage3_max_live_parameters=bound, stage3_max_reuse_distance=0))
    largest = max(u.padded_numel for u in engine.units)
    seen = []
    real_gather = engine.fetcher._gather

    def spy(unit):
        real_gather(unit)
        seen.append(engine.fetcher.live_numel)

    engine.fetcher._gather = spy
    engine_run(engine, batches(3, 4), gas=1)
    assert seen, "no unit was ever gathered"
    assert max(seen) <= bound + largest
    assert engine.fetcher.peak_live_numel == max(seen)
    # Nothing stays gathered between steps.
    assert engine.fetcher.live_numel == 0


def test_eval_under_no_grad_and_changed_order(model):
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu"))
    data = batches(4, 4)
    engine_run(engine, data[:2], gas=1)
    schedule = list(engine.fetcher.schedule)
    with torch.no_grad():
        engine.eval()
        loss = engine(*data[2])
    assert torch.isfinite(loss)
    # A forward-only pass recorded another order: it became the schedule, and training
    # afterwards re-records instead of failing.
    assert engine.fetcher.schedule != schedule
    engine.train()
    engine_run(engine, data[2:], gas=1)
    assert engine.fetcher.schedule == schedule


def test_activation_checkpointing_matches_pytorch(model):
    ckpt_model = copy.deepcopy(model)
    ckpt_model.checkpointing = True
    data = batches(6, 4)
    ref_losses, ref_model = reference_run(model, data, gas=1)
    engine, *_ = infinity.initialize(ckpt_model, config=config(3, "cpu", "cpu", stage3_max_reuse_distance=0))
    _close(engine_run(engine, data, gas=1), ref_losses)
    _params_close(engine, ref_model)


class _UnlikeLayers(nn.Module):
    """No list of like blocks: an embedding and a ModuleList of unlike layers, which is never
    called itself (its children are)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, 2 * DIM), nn.LayerNorm(2 * DIM), nn.Linear(2 * DIM, VOCAB)])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(x.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("make", [lambda: TinyGPT(layers=1), _UnlikeLayers], ids=["one-block", "unlike-layers"])
@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu")])
def test_models_without_a_list_of_blocks_match_pytorch(make, param, optim):
    """A single-block model's block is still a unit, and no unit rests on a container that is
    never called (its parameters were never gathered)."""
    torch.manual_seed(0)
    model = make()
    data = batches(6, 4)
    ref_losses, ref_model = reference_run(model, data, gas=1)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, param, optim))
    _close(engine_run(engine, data, gas=1), ref_losses)
    _params_close(engine, ref_model)
    assert len(engine.units) >= 2  # not everything in the root


def test_a_unit_policy_naming_a_container_is_an_error(model):
    with pytest.raises(ValueError, match=r"units: blocks is a ModuleList, which is never called"):
        infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu"), units=[nn.ModuleList])


def _mlp(inplace: bool = False) -> nn.Module:
    """Three Linear units of 144, 272 and 68 elements, which all pad to the same size."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace), nn.Linear(16, 16), nn.ReLU(inplace), nn.Linear(16, 4))


def _mlp_against_pytorch(model: nn.Module, cfg: dict, *, clip: float, first=None, steps: int = 4) -> None:
    """Trains `model` with the engine and with plain PyTorch; `first(engine, model)` runs before."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    if first is not None:
        first(engine, ref)
    for x, y in data:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        engine_loss = F.cross_entropy(engine(x), y)
        engine.backward(engine_loss)
        engine.step()
        assert engine_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-5)
    _params_close(engine, ref)
    engine.close()


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu")])
def test_units_of_one_padded_size_clip_on_their_own_gradients(param, optim):
    """Units whose sizes pad to the same size share a reused gradient buffer: the 144-element
    unit, reduced after the 272-element one, must not count that one's tail in the norm."""
    torch.manual_seed(0)
    _mlp_against_pytorch(_mlp(), config(3, param, optim, clip=0.1), clip=0.1)


@pytest.mark.parametrize("model", [lambda: _mlp(inplace=True), lambda: _Residual()], ids=["relu-inplace", "add-inplace"])
def test_in_place_ops_on_a_units_output_match_pytorch(model):
    torch.manual_seed(0)
    _mlp_against_pytorch(model(), config(3, "cpu", "cpu"), clip=1.0)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            y = block(h)
            y += h  # in place, on a unit's output
            h = y
        return self.out(h)


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu")])
def test_inference_mode_before_the_first_step_leaves_training_intact(param, optim):
    """An evaluation under torch.inference_mode() first (a trainer's sanity check) gathered the
    units into inference tensors, which no later training forward could fill."""
    torch.manual_seed(0)

    def evaluate(engine, model):
        x = torch.randn(4, 8)
        with torch.inference_mode():
            torch.testing.assert_close(engine(x), model(x), rtol=0, atol=0)
        assert not any(p.is_inference() for p in engine.module.parameters())  # released ones too

    _mlp_against_pytorch(_mlp(), config(3, param, optim), clip=1.0, first=evaluate)


def test_gathered_parameters_read_and_modify(model):
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu"))
    block = engine.module.blocks[1]
    assert block.fc1.weight.numel() == 0  # partitioned
    with infinity.GatheredParameters(block.fc1.weight):
        assert torch.equal(block.fc1.weight, model.blocks[1].fc1.weight)
    assert block.fc1.weight.numel() == 0
    with infinity.GatheredParameters([block.fc1.weight, block.fc1.bias], modifier_rank=0), torch.no_grad():
        block.fc1.weight.fill_(0.5)
    assert torch.all(engine.consolidated_state_dict()["blocks.1.fc1.weight"] == 0.5)


def test_fp16_overflow_skips_the_step(model):
    cfg = config(3, "cpu", "cpu")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    before = engine.consolidated_state_dict()
    idx, tgt = batches(1, 4)[0]
    loss = engine(idx, tgt)
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.get_loss_scale() == 128
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine_run(engine, batches(3, 4), gas=1)
    assert engine.skipped_steps == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains_close_to_fp32(model, precision):
    data = batches(10, 4)
    ref_losses, _ = reference_run(model, data, gas=1)
    cfg = config(3, "cpu", "cpu")
    cfg[precision] = {"enabled": True}
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    losses = engine_run(engine, data, gas=1)
    assert engine.module.blocks[0].fc1.weight.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16)
    # Rounding (and fp16's skipped first steps while the loss scale settles) moves the
    # trajectory; the average over the last steps stays within a few percent of fp32.
    tail, ref_tail = sum(losses[5:]) / 5, sum(ref_losses[5:]) / 5
    assert abs(tail - ref_tail) < 0.05 * ref_tail, (losses, ref_losses)
    assert tail < losses[0]


@pytest.mark.parametrize("room", [True, False])
def test_the_next_unit_is_gathered_before_the_current_one_computes(model, room):
    """[Note: gathering one unit ahead]: on the recorded schedule, when the budget has room."""
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    budget = 10 ** 9 if room else 2 * block  # the root (whole forward) and one block: no room for another
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(
        3, "cpu", "cpu", stage3_max_live_parameters=budget, stage3_max_reuse_distance=0))
    seen = []
    for i, b in enumerate(engine.module.blocks):
        unit = next(u for u in engine.units if u.name.endswith(f"blocks.{i}"))
        b.register_forward_pre_hook(lambda m, a, unit=unit: seen.append((unit.index, unit.state.value)), prepend=True)
    data = batches(2, 4)
    engine_run(engine, data[:1], gas=1)  # records the schedule
    seen.clear()
    engine_run(engine, data[1:], gas=1)
    # The first block follows the root, gathered for the whole forward; a block called twice in a
    # row stays gathered for its second call ([Note: recorded order]), which is not gathering ahead.
    firsts = [state for i, (unit, state) in enumerate(seen) if i == 0 or seen[i - 1][0] != unit]
    ahead = firsts[1:].count("gathered")
    assert (ahead > 0) == room, seen
    engine.close()


def test_deepspeed_getters(model):
    cfg = config(3, "cpu", "cpu", gas=2, micro=2, clip=0.5)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 4 and engine.gradient_clipping() == 0.5
    assert engine.zero_optimization_stage() == 3
    assert engine.global_rank == 0 and engine.local_rank == 0 and engine.world_size == 1
    assert not engine.was_step_applied()
    # DeepSpeed's boundary: True from the last micro-batch's forward until its step().
    seen = []
    for idx, tgt in batches(4, 2):
        seen.append(engine.is_gradient_accumulation_boundary())
        loss = engine(idx, tgt)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert seen == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert engine.was_step_applied() and not engine.is_gradient_accumulation_boundary()
    assert engine.global_steps == 2 and engine.micro_steps == 4 and engine.global_samples == 8
    # Accelerate's override: every micro-step a boundary, decided before its forward.
    engine.set_gradient_accumulation_boundary(True)
    idx, tgt = batches(1, 2)[0]
    engine.backward(engine(idx, tgt))
    engine.step()
    assert engine.global_steps == 3 and engine.global_samples == 12
    assert engine.get_mom() == [(0.9, 0.999)] and not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.dp_world_size == 1 and engine.steps_per_print() == 1000 and engine.training_dataloader is None
    loss = engine(idx, tgt)
    assert engine.backward(loss).item() == loss.item() / 2  # scaled for accumulation, as DeepSpeed returns it
    engine.step()
    steps = engine.global_steps
    loss = engine(idx, tgt)  # expected by the count: not a boundary
    assert not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)  # accelerate's: after the forward, before the backward
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="set_gradient_accumulation_boundary: the backward of this micro-batch"):
        engine.set_gradient_accumulation_boundary(False)
    engine.step()
    assert engine.global_steps == steps + 1 and engine.was_step_applied()
    engine.close()


def test_initialize_takes_deepspeeds_arguments(model, tmp_path):
    import argparse
    cfg = config(3, "cpu", "cpu", micro=2)
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(cfg))
    data = [(torch.randint(0, 64, (8,)), torch.randint(0, 64, (8,))) for _ in range(6)]
    engine, opt, loader, sched = infinity.initialize(
        args=argparse.Namespace(deepscale_config=str(path)), model=copy.deepcopy(model), training_data=data,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5), dist_init_required=False)
    idx, tgt = next(iter(loader))
    assert idx.shape == (2, 8)  # train_micro_batch_size_per_gpu
    assert sched.optimizer is opt and opt.param_groups[0]["lr"] == pytest.approx(1.5e-3)
    engine.backward(engine(idx, tgt))
    engine.step()
    engine.close()
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr_scheduler: it steps an optimizer that is not the one"):
        infinity.initialize(model=copy.deepcopy(model), optimizer=user, config=cfg,
                            lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TypeError, match="mpu: expected DeepSpeed's model-parallel unit"):
        infinity.initialize(model=copy.deepcopy(model), config=cfg, mpu=object())


def test_a_scheduler_of_the_users_optimizer_sets_the_engines_lr(model):
    m = copy.deepcopy(model)
    user = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.5)
    cfg = config(3, "cpu", "cpu")
    del cfg["optimizer"]
    engine, opt, _, got = infinity.initialize(model=m, optimizer=user, lr_scheduler=sched, config=cfg)
    assert got is sched
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    engine.step()
    assert engine.get_lr() == [pytest.approx(5e-4)]  # the engine's groups are the user optimizer's
    engine.close()


_DESTROY_JOB = """
import gc, os, sys
import torch.distributed as dist
import infinity
from gpt import TinyGPT, config

def threads():
    return len(os.listdir("/proc/self/task"))

start = threads()
dist.init_process_group("gloo")
gloo = threads() - start
engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
engine.close()
before = threads()
dist.destroy_process_group()
gc.collect()
print(gloo, before - threads())
"""


def test_destroy_process_group_stops_gloo_after_an_engine_ran(tmp_path):
    """A process group that outlives `destroy_process_group` keeps gloo's threads running into
    interpreter shutdown, where one of them can abort the process ("terminate called without
    an active exception"). The engine builds a torch optimizer, and torch's first optimizer
    imports modules whose default arguments capture the live group ([Note: importing
    torch.distributed.nn early] in infinity/zero/dist.py). Counted in /proc: every thread gloo
    started is gone after destroy_process_group."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "PYTHONPATH": os.path.dirname(__file__), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _DESTROY_JOB], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, check=False)  # not the checkout's root: it would shadow the installed package
    assert out.returncode == 0, out.stderr[-3000:]
    started, stopped = map(int, out.stdout.split())
    assert started > 0 and stopped == started, f"gloo started {started} threads; {stopped} stopped"


def _two_groups(params) -> list[dict]:
    """Weight matrices decayed at one lr, everything else (biases, norms, positions) at another."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "lr": 3e-3, "weight_decay": 0.1}, {"params": rest, "lr": 1e-2, "weight_decay": 0.0}]


@pytest.mark.parametrize("given", ["optimizer", "factory"])
def test_a_user_optimizers_param_groups_are_the_engines(model, given):
    """DeepSpeed takes the groups of a client optimizer (or of the one a factory builds from
    `model_parameters`, a generator as DeepSpeed's examples pass): each parameter trains with
    its own group's lr and weight decay, as plain PyTorch with that optimizer. The engine used to
    put every parameter in group 0 (a client optimizer), or to see an exhausted generator and
    train nothing (a factory)."""
    data = batches(6, 4)
    ref_losses, ref = reference_run(model, data, gas=1, optimizer=lambda ps: torch.optim.AdamW(_two_groups(ps)))
    cfg = config(3, "cpu", "cpu")
    del cfg["optimizer"]
    m = copy.deepcopy(model)
    if given == "optimizer":
        engine, *_ = infinity.initialize(model=m, optimizer=torch.optim.AdamW(_two_groups(m.parameters())),
                                         model_parameters=m.parameters(), config=cfg)
    else:
        engine, *_ = infinity.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                         optimizer=lambda params: torch.optim.AdamW(_two_groups(params)))
    assert engine.frozen_numel == 0
    _close(engine_run(engine, data, gas=1), ref_losses)
    _params_close(engine, ref)
    engine.close()


def test_a_config_in_args_and_in_the_call_is_an_error(model, tmp_path):
    import argparse
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(config(3, "cpu", "cpu")))
    with pytest.raises(ValueError, match="args.deepspeed_config and config"):
        infinity.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=copy.deepcopy(model),
                            config=config(3, "cpu", "cpu"))


@pytest.mark.parametrize("clip,threshold", [(1.0, 0), (0.0, 0), (1.0, 100_000)])
def test_loss_backward_outside_the_engine_is_an_error_and_changes_nothing(model, clip, threshold):
    """`loss.backward()` instead of `engine.backward(loss)` skipped the update silently (global_steps
    stayed 0), updated units inside backward without counting a step (clipping 0), or broke the
    next iteration ("size of tensor a (0)"). It is an error at the first gradient, the micro-batch
    is discarded, and the engine then trains as one that never saw it."""
    data = batches(4, 4)
    cfg = config(3, "cpu", "cpu", clip=clip, stage3_param_persistence_threshold=threshold)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"engine.backward\(loss\)"):
            engine(*data[0]).backward()
    engine.step()  # nothing to apply: the micro-batch was discarded
    assert engine.global_steps == 0
    losses = engine_run(engine, data, gas=1)
    state = engine.consolidated_state_dict()
    engine.close()
    fresh, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert engine_run(fresh, data, gas=1) == losses
    assert all(torch.equal(v, state[k]) for k, v in fresh.consolidated_state_dict().items())
    fresh.close()


def test_a_resumed_run_traces_from_its_first_step_and_a_short_one_says_it_traced_nothing(model, tmp_path, caplog):
    """trace.start_step 2 after resuming at step 2 (a run that never has a step 2 of its own)
    recorded nothing and wrote no file, silently; so did a run that closed before start_step."""
    import json
    data = batches(4, 4)
    first, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu"))
    engine_run(first, data[:2], gas=1)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    cfg = config(3, "cpu", "cpu")
    cfg["trace"] = {"path": str(tmp_path / "trace.json"), "start_step": 2, "steps": 2}
    resumed, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    engine_run(resumed, data[2:], gas=1)  # steps 3 and 4
    resumed.close()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e.get("cat") == "phase"].count("step") == 2
    cfg["trace"] = {"path": str(tmp_path / "short.json"), "start_step": 2}
    short, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    engine_run(short, data[:1], gas=1)
    with caplog.at_level("WARNING", logger="infinity"):
        short.close()
    assert not (tmp_path / "short.json").exists()
    assert "nothing recorded" in caplog.text and "trace.start_step 2" in caplog.text


def test_an_engine_without_an_optimizer_is_for_inference(model, tmp_path):
    """DeepSpeed builds a ZeRO-3 engine without an optimizer (no config section, none passed)
    for evaluation or a frozen reference model (TRL, Hugging Face's inference init); it was
    refused. It computes what the plain model computes, holds no optimizer state, and its
    backward says why it cannot train."""
    cfg = config(3, "nvme", "nvme")
    del cfg["optimizer"]
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = str(tmp_path)
    engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
    assert engine.trainable_numel == 0 and engine.frozen_numel == sum(p.numel() for p in model.parameters())
    assert [p.name for p in tmp_path.iterdir() if "optimizer" in p.name] == []  # no optimizer files
    idx, tgt = batches(1, 4)[0]
    with torch.no_grad():
        assert torch.equal(engine(idx, tgt), model(idx, tgt))
    state = engine.consolidated_state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match=r"engine.backward: this engine has no optimizer"):
        engine.backward(engine(idx, tgt))
    with torch.no_grad():
        assert torch.equal(engine(idx, tgt), model(idx, tgt))  # and it goes on
    engine.close()


class _TwoScalars(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2))
        for layer in self.layers:
            torch.nn.init.constant_(layer.weight, 1.0)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().sum()


_FP16 = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
         "fp16": {"enabled": True, "initial_scale_power": 15},  # scale 32768: a gradient of 1.5 is 49152 < 65504
         "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
         "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                               "stage3_param_persistence_threshold": 0}}


def _fp16_steps() -> tuple[list[float], int, dict, dict]:
    engine, *_ = infinity.initialize(model=_TwoScalars(), config=_FP16)
    norms = []
    for _ in range(3):
        engine.backward(engine(torch.tensor([[1.5]]).half()))  # every rank the same gradient
        engine.step()
        norms.append(engine.get_global_grad_norm())
    if engine.world_size > 1:
        with pytest.raises(RuntimeError, match="GatheredParameters"):
            engine.module.state_dict()  # released: no rank holds them
    with infinity.GatheredParameters(list(engine.module.parameters())):
        gathered = {k: v.clone() for k, v in engine.module.state_dict().items()}
    full = engine.consolidated_state_dict()
    skipped = engine.skipped_steps
    engine.close()
    return norms, skipped, gathered, full


def _fp16_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = _fp16_steps()
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_average_fp16_gradients_without_overflow_and_state_dict_works_gathered():
    """Two gloo ranks with the same fp16 gradient (49152 scaled) summed it in fp16 (98304: inf)
    before dividing: every step was skipped as an overflow and the loss scale halved, where one
    rank applies them all. And state_dict() inside GatheredParameters, which its own error
    message recommends (the DeepSpeed idiom before save_pretrained), raised on two ranks."""
    one_norms, one_skipped, _, one_full = _fp16_steps()
    assert one_skipped == 0
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fp16_worker, args=(_free_port(), results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        norms, skipped, gathered, _ = results[rank]
        assert skipped == 0 and norms == one_norms, (rank, norms, one_norms)
        assert all(torch.equal(gathered[k], one_full[k].half()) for k in one_full), rank
    assert all(torch.equal(results[0][3][k], v) for k, v in one_full.items())
