"""Optimizers other than fp32 Adam through `infinity.initialize`: a client torch optimizer run
with its own step over the shards, Adagrad and Lion from a DeepSpeed config, and moments kept in
bf16 ([Note: update rules] in infinity/optim/rules.py). Each against plain PyTorch on the same
seed: torch's own optimizer, or a reference written with torch ops in the kernel's order."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import TinyGPT, batches, config, engine_run, reference_run

import infinity

STEPS = 6


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


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)


def _no_optimizer_section(**kw) -> dict:
    cfg = config(3, **kw)
    del cfg["optimizer"]
    return cfg


@pytest.mark.parametrize("optim,gas", [("none", 1), ("cpu", 1), ("cpu", 2)])
def test_sgd_as_the_client_optimizer_trains_as_torch_does(model, optim, gas):
    """A client optimizer infinity has no kernel for used to be a TypeError ("runs Adam or AdamW");
    it now runs its own step() over the fp32 master shards."""
    data = batches(STEPS * gas, 4)
    ref_losses, ref = reference_run(model, data, gas=gas, optimizer=_sgd)
    m = copy.deepcopy(model)
    engine, opt, *_ = infinity.initialize(model=m, optimizer=_sgd(m.parameters()),
                                          config=_no_optimizer_section(optim=optim, gas=gas))
    assert opt.rule.client and opt.rule.name == "SGD"
    _close(engine_run(engine, data, gas=gas), ref_losses)
    _params_close(engine, ref)
    engine.close()


def test_a_client_optimizer_hears_its_scheduler(model):
    data = batches(STEPS, 4)

    def run(make_engine):
        m = copy.deepcopy(model)
        opt = _sgd(m.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        return make_engine(m, opt, sched)

    ref_model = copy.deepcopy(model)
    opt = _sgd(ref_model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_losses = []
    for idx, tgt in data:
        loss = ref_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        ref_losses.append(loss.item())

    def with_engine(m, opt, sched):
        engine, *_ = infinity.initialize(model=m, optimizer=opt, lr_scheduler=sched,
                                         config=_no_optimizer_section(optim="cpu"))
        losses = engine_run(engine, data, gas=1)
        return engine, losses

    engine, losses = run(with_engine)
    _close(losses, ref_losses)
    _params_close(engine, ref_model)
    engine.close()


def test_a_client_optimizer_with_state_on_nvme_is_a_clear_error(model, tmp_path):
    cfg = _no_optimizer_section(optim="nvme")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    m = copy.deepcopy(model)
    with pytest.raises(TypeError, match=r"SGD .*offload_optimizer.device.*Adam, AdamW, Adagrad, Lion, Lamb"):
        infinity.initialize(model=m, optimizer=_sgd(m.parameters()), config=cfg)
    assert not any(tmp_path.rglob("*.bin")), "nothing written for an engine that never started"


def test_a_client_optimizer_resumes_exactly(model, tmp_path):
    """Its momentum buffers are in the checkpoint: 3 steps, save, a new engine loads, 3 more steps
    equal 6 uninterrupted ones bit for bit."""
    data = batches(STEPS, 4)

    def engine_for(m):
        return infinity.initialize(model=m, optimizer=_sgd(m.parameters()),
                                   config=_no_optimizer_section(optim="cpu"))[0]

    whole = engine_for(copy.deepcopy(model))
    expected = engine_run(whole, data, gas=1)
    expected_state = whole.consolidated_state_dict()
    whole.close()
    first = engine_for(copy.deepcopy(model))
    engine_run(first, data[:3], gas=1)
    first.save_checkpoint(str(tmp_path))
    first.close()
    second = engine_for(copy.deepcopy(model))
    second.load_checkpoint(str(tmp_path))
    assert engine_run(second, data[3:], gas=1) == expected[3:]
    for name, value in second.consolidated_state_dict().items():
        assert torch.equal(value, expected_state[name]), name
    second.close()


def test_amsgrad_runs_as_torch_s_own_adam(model):
    """amsgrad has no kernel: torch's Adam runs it over the shards (it was a ValueError)."""
    data = batches(STEPS, 4)

    def adam(ps):
        return torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, amsgrad=True)

    ref_losses, ref = reference_run(model, data, gas=1, optimizer=adam)
    m = copy.deepcopy(model)
    engine, opt, *_ = infinity.initialize(model=m, optimizer=adam(m.parameters()),
                                          config=_no_optimizer_section(optim="cpu"))
    assert opt.rule.client
    _close(engine_run(engine, data, gas=1), ref_losses)
    _params_close(engine, ref)
    engine.close()


# ---- moment formats ([Note: moment formats] in infinity/optim/formats.py) --------------------------

from torch import nn  # noqa: E402

from infinity.optim.formats import BLOCK, FORMATS  # noqa: E402


def _mlp():
    torch.manual_seed(0)  # three units of one weight each: a unit's shard is its weight's flat values
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.Tanh(), nn.Linear(128, 64, bias=False), nn.Tanh(),
                         nn.Linear(64, 32, bias=False))


def _mlp_data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=g) for _ in range(steps)]


def _format_config(fmt: str, optim: str, tmp_path, **params) -> dict:
    offload = {"device": optim}
    if optim == "nvme":
        offload["nvme_path"] = str(tmp_path)
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "moment_format": fmt, **params}},
            # sub_group_size 1024: the NVMe tier cuts each 8192-element shard into eight pieces
            "zero_optimization": {"stage": 3, "offload_optimizer": offload, "sub_group_size": 1024,
                                  "stage3_param_persistence_threshold": 0}}


def _reference_with_rounded_moments(fmt: str, steps: int):
    """torch's fused AdamW (whose bits the CPU kernel gives) with clipping, each moment stored in
    `fmt` after every step: what the engine computes with its moments in that format."""
    model, data = _mlp(), _mlp_data(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    store = FORMATS[fmt]
    losses = []
    for x in data:
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        for state in opt.state.values():
            for kind in ("exp_avg", "exp_avg_sq"):
                flat = state[kind].view(-1)
                flat.copy_(store.decode(store.encode(flat, kind), flat.numel(), kind))
        losses.append(loss.item())
    return losses, model


def _engine_losses(engine, steps: int) -> list[float]:
    losses = []
    for x in _mlp_data(steps):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optim", ["none", "cpu", "nvme"])
def test_8bit_moments_equal_a_reference_that_rounds_the_same_way(optim, tmp_path):
    ref_losses, ref = _reference_with_rounded_moments("8bit", STEPS)
    engine, *_ = infinity.initialize(model=_mlp(), config=_format_config("8bit", optim, tmp_path))
    _close(_engine_losses(engine, STEPS), ref_losses)
    _params_close(engine, ref, atol=1e-6)
    if optim == "nvme":  # 1 byte a moment value and a scale a block: the files hold 8-bit moments
        sizes = {p.name.split(".")[0]: p.stat().st_size for p in tmp_path.rglob("*.bin")}
        assert sizes and any("exp_avg" in name for name in sizes), sizes
    engine.close()


def test_8bit_moments_move_a_quarter_of_fp32_bytes(tmp_path):
    """The optimizer store's files: fp32 moments take 4 bytes a value each, 8-bit ones about 1."""
    used = {}
    for fmt in ("fp32", "bf16", "8bit"):
        path = tmp_path / fmt
        path.mkdir()
        cfg = _format_config(fmt, "nvme", path)
        cfg["zero_optimization"]["sub_group_size"] = 10 ** 6  # a piece a shard: 4 KiB alignment is noise
        model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(3)))
        engine, *_ = infinity.initialize(model=model, config=cfg)
        engine.flush_shards()
        used[fmt] = sum(f.stat().st_size for f in path.rglob("*.bin"))
        engine.close()
    n = 3 * 512 * 512
    # master 4 bytes a value plus two moments: 12, 8 and about 6 bytes a value
    assert used["fp32"] >= 12 * n and used["bf16"] <= 8.5 * n and used["8bit"] <= 6.5 * n, used


def _streamed(fmt: str, path, buffer_count: int):
    """(engine, fp32 master, bytes read from disk a step) after 5 steps of six 128 x 128 units
    cut into 24 pieces of 4096, with `buffer_count` x 4096 fp32 elements of pool."""
    path.mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(128, 128, bias=False) for _ in range(6)))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "moment_format": fmt}},
           "zero_optimization": {"stage": 3, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(path),
                                                       "buffer_count": buffer_count}},
           "aio": {"engine": "psync"}}  # pread from this process: /proc/self/io counts it
    engine, *_ = infinity.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:  # the first steps learn the order and fill the pool
            with open("/proc/self/io") as f:
                before = int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])
        loss = engine(torch.randn(8, 128, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    with open("/proc/self/io") as f:
        read = (int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"]) - before) / 3
    return engine, engine.consolidated_state_dict(), read


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_smaller_moments_take_smaller_buffers_so_the_same_budget_holds_more(fmt, tmp_path):
    """[Note: two sizes of buffer] in offload/pool.py: with the same knobs the pool's real bytes
    are no more than fp32's, but its moment buffers are their format's size, so it holds more
    pieces from step to step and the disk reads (/proc/self/io) fall by more than the format's
    bytes alone (2/3 of fp32's for bf16; one size for all held as many pieces as fp32's pool);
    what is computed is the same as with a pool that holds the whole state."""
    fp32, _, fp32_read = _streamed("fp32", tmp_path / "fp32", 36)
    fp32_bytes = sum(b.numel() for b in fp32.optim_state.pool._buffers)
    fp32.close()
    engine, state, read = _streamed(fmt, tmp_path / fmt, 36)
    buffers = engine.optim_state.pool._buffers  # the tensors the pool allocated
    assert sum(b.numel() for b in buffers) <= fp32_bytes
    assert sorted({b.numel() for b in buffers}) == [8192, 16384]  # the moments' pages, the master's
    engine.close()
    assert 0 < read <= 0.55 * fp32_read, (read, fp32_read)
    whole, whole_state, _ = _streamed(fmt, tmp_path / "whole", 400)  # the pool holds all 24 pieces
    whole.close()
    for name, value in whole_state.items():
        assert torch.equal(state[name], value), name


def test_the_8bit_format_keeps_each_value_within_its_code_s_step():
    """Every value comes back within a sixteenth of itself (e4m3's half step) unless it is below
    the block's range (then it is at most a 2^-9 of the block's scale away); a square's root
    never rounds to zero; what was decoded encodes to the same values (a checkpoint keeps values)."""
    g = torch.Generator().manual_seed(0)
    fmt = FORMATS["8bit"]
    x = torch.randn(10 * BLOCK + 37, generator=g) * torch.logspace(-8, 2, 10 * BLOCK + 37)
    for kind, values in (("exp_avg", x), ("exp_avg_sq", x * x)):
        stored = fmt.encode(values, kind)
        assert stored.numel() == fmt.nbytes(values.numel()) < 1.02 * values.numel()
        back = fmt.decode(stored, values.numel(), kind)
        root = values.abs().sqrt() if kind == "exp_avg_sq" else values.abs()
        got = back.abs().sqrt() if kind == "exp_avg_sq" else back.abs()
        top = torch.nn.functional.pad(root, (0, -root.numel() % BLOCK)).view(-1, BLOCK).amax(1)
        floor = top.repeat_interleave(BLOCK)[:root.numel()] / 448 * 2.0 ** -6  # e4m3's least normal
        err = (got - root).abs()
        assert bool((err <= root / 16 + floor * 2.0 ** -3).all())
        if kind == "exp_avg_sq":
            assert bool((back[values > 0] > 0).all())
        assert torch.equal(fmt.decode(fmt.encode(back, kind), values.numel(), kind), back)


def _resumes_exactly(make_engine, tmp_path) -> None:
    """3 steps, a checkpoint, a new engine that loads it and 3 more steps give the losses and
    values of 6 uninterrupted steps, bit for bit."""
    whole = make_engine()
    expected = _engine_losses(whole, STEPS)
    expected_state = whole.consolidated_state_dict()
    whole.close()
    data = _mlp_data(STEPS)
    first = make_engine()
    for x in data[:3]:
        first.backward(first(x).pow(2).mean())
        first.step()
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    second = make_engine()
    second.load_checkpoint(str(tmp_path / "ckpt"))
    losses = []
    for x in data[3:]:
        loss = second(x).pow(2).mean()
        second.backward(loss)
        second.step()
        losses.append(loss.item())
    assert losses == expected[3:]
    for name, value in second.consolidated_state_dict().items():
        assert torch.equal(value, expected_state[name]), name
    second.close()


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
def test_8bit_moments_resume_exactly(optim, tmp_path):
    (tmp_path / "nvme").mkdir()
    _resumes_exactly(lambda: infinity.initialize(model=_mlp(), config=_format_config("8bit", optim, tmp_path / "nvme"))[0],
                     tmp_path)


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
def test_8bit_moments_go_through_the_fused_kernel_with_the_bits_of_decode_kernel_encode(optim, tmp_path, monkeypatch):
    """The tiers hand 8-bit moments to the fused kernel ([Note: 8-bit updates of a piece] in
    infinity/optim/rules.py); the run (losses, master and moments) is, bit for bit, the one that
    decodes, runs the fp32 kernel and encodes, as the tiers did before. Layers of 6500 values: the
    block with a shard's last value is shared with its padding and goes the long way."""
    from infinity.optim.rules import AdamRule
    calls = []
    fused_call = AdamRule.kernel_packed
    monkeypatch.setattr(AdamRule, "kernel_packed",
                        lambda self, *a, **k: calls.append(k["count"]) or fused_call(self, *a, **k))
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(AdamRule, "packed_kernel", fused)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 100), nn.Tanh(), nn.Linear(100, 64), nn.Tanh(), nn.Linear(64, 32))
        (tmp_path / str(fused)).mkdir()
        engine, *_ = infinity.initialize(model=model, config=_format_config("8bit", optim, tmp_path / str(fused)))
        losses = _engine_losses(engine, STEPS)
        runs[fused] = losses, [engine.read_optimizer_shard(u, kind) for u in engine.units if u.trainable
                               for kind in ("master", "exp_avg", "exp_avg_sq")]
        engine.close()
    assert calls and min(calls) > 0
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(runs[True][1], runs[False][1]))


# ---- LAMB ([Note: LAMB's two passes] in infinity/optim/rules.py) -----------------------------------


def _lamb_reference(steps: int, *, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, wd=0.01, max_coeff=10.0, min_coeff=0.01):
    """Plain PyTorch, one tensor at a time, as DeepSpeed's FusedLamb defines the step."""
    model, data = _mlp(), _mlp_data(steps)
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    losses = []
    for t, x in enumerate(data, start=1):
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                m, v = state[p]
                m.mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                u = m / (v.sqrt() + eps) + wd * p
                w_norm, u_norm = p.double().norm().item(), u.double().norm().item()
                ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm and u_norm else 1.0
                size = lr * (1 - betas[1] ** t) ** 0.5 / (1 - betas[0] ** t)
                p.sub_(size * ratio * u)
        model.zero_grad()
        losses.append(loss.item())
    return losses, model


def _lamb_config(optim: str, tmp_path, **zero) -> dict:
    cfg = _format_config("fp32", optim, tmp_path)
    cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}}
    cfg["zero_optimization"].update(zero)
    return cfg


@pytest.mark.parametrize("optim,tiled", [("none", False), ("cpu", False), ("nvme", False), ("cpu", True),
                                         ("nvme", True)])
def test_lamb_equals_deepspeed_s_fused_lamb_per_tensor(optim, tiled, tmp_path):
    """Each tensor's trust ratio from its whole norms, also where the weight is cut into tiles (in
    separate units) and its state into NVMe pieces of 1024 elements."""
    ref_losses, ref = _lamb_reference(STEPS)
    zero = {"tile_size": 2048} if tiled else {}
    engine, opt, *_ = infinity.initialize(model=_mlp(), config=_lamb_config(optim, tmp_path, **zero))
    assert opt.rule.name == "Lamb" and (len(engine.units) > 3) == tiled
    _close(_engine_losses(engine, STEPS), ref_losses)
    _params_close(engine, ref, atol=1e-6)
    engine.close()


def test_cpu_lamb_is_fused_lamb_and_runs_as_the_engine_s_lamb(tmp_path):
    """CPULamb in a plain loop equals the per-tensor reference; given to initialize, it is the
    engine's LAMB over the shards (its state on NVMe)."""
    from infinity.optim.cpu_lamb import CPULamb
    ref_losses, ref = _lamb_reference(STEPS)
    model, losses = _mlp(), []
    opt = CPULamb(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    for x in _mlp_data(STEPS):
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _close(losses, ref_losses)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    m = _mlp()
    cfg = _lamb_config("nvme", tmp_path)
    del cfg["optimizer"]
    engine, zopt, *_ = infinity.initialize(model=m, optimizer=CPULamb(m.parameters(), lr=1e-2, eps=1e-6,
                                                                       weight_decay=0.01), config=cfg)
    assert zopt.rule.name == "Lamb"
    _close(_engine_losses(engine, STEPS), ref_losses)
    _params_close(engine, ref, atol=1e-6)
    engine.close()


# ---- Adagrad, Lion and bf16 moments through a DeepSpeed config ---------------------------------------


class _LionReference(torch.optim.Optimizer):
    """Lion with torch ops: c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m.lerp(p.grad, 1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(c.sign(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


def _run_reference(make_opt, steps: int, rounded: str | None = None, world: int = 1):
    """Plain PyTorch on the three-unit MLP with clipping 1.0; `rounded`: the moments are stored in
    that format after each step; `world`: each batch's gradient is the mean of `world` slices'."""
    model, data = _mlp(), _mlp_data(steps)
    opt = make_opt(model.parameters())
    losses = []
    for x in data:
        total = 0.0
        for part in x.chunk(world):
            loss = model(part).pow(2).mean() / world
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if rounded is not None:
            store = FORMATS[rounded]
            for state in opt.state.values():
                for kind in ("exp_avg", "exp_avg_sq", "sum"):
                    if kind in state:
                        flat = state[kind].view(-1)
                        name = "exp_avg_sq" if kind == "sum" else kind
                        flat.copy_(store.decode(store.encode(flat, name), flat.numel(), name))
        losses.append(total)
    return losses, model


_OPTIMIZERS = {  # DeepSpeed config section -> its reference in plain PyTorch
    "Adagrad": ({"lr": 1e-2, "weight_decay": 0.01},
                lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=0.01, fused=True)),
    "Lion": ({"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
             lambda ps: _LionReference(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
    "AdamW": ({"lr": 1e-2, "weight_decay": 0.01},
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True)),
}


def _optimizer_config(name: str, fmt: str, optim: str, tmp_path, **zero) -> dict:
    cfg = _format_config(fmt, optim, tmp_path)
    cfg["optimizer"] = {"type": name, "params": {**_OPTIMIZERS[name][0], "moment_format": fmt}}
    cfg["zero_optimization"].update(zero)
    return cfg


@pytest.mark.parametrize("optim", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("name,fmt", [("Adagrad", "fp32"), ("Lion", "fp32"), ("AdamW", "bf16"), ("Adagrad", "bf16"),
                                      ("Lion", "bf16"), ("Adagrad", "8bit"), ("Lion", "8bit")])
def test_each_optimizer_and_format_equals_its_reference(name, fmt, optim, tmp_path):
    """Adagrad is torch's (fused, whose bits the kernel gives), Lion the formula; bf16 and 8-bit
    moments equal the reference whose moments are stored in that format after every step."""
    ref_losses, ref = _run_reference(_OPTIMIZERS[name][1], STEPS, rounded=None if fmt == "fp32" else fmt)
    engine, opt, *_ = infinity.initialize(model=_mlp(), config=_optimizer_config(name, fmt, optim, tmp_path))
    assert opt.rule.format.name == fmt and opt.rule.name == ("Adam" if name == "AdamW" else name)
    _close(_engine_losses(engine, STEPS), ref_losses)
    _params_close(engine, ref, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("name,fmt", [("Adagrad", "fp32"), ("Lion", "bf16"), ("AdamW", "bf16")])
def test_resume_is_exact_in_each_format(name, fmt, tmp_path):
    (tmp_path / "nvme").mkdir()
    _resumes_exactly(lambda: infinity.initialize(model=_mlp(), config=_optimizer_config(name, fmt, "nvme",
                                                                                        tmp_path / "nvme"))[0], tmp_path)


@pytest.mark.parametrize("name,kept,absent", [("Lion", "exp_avg", "exp_avg_sq"), ("Adagrad", "exp_avg_sq", "exp_avg")])
def test_a_checkpoint_holds_only_the_moments_its_optimizer_keeps(name, kept, absent, tmp_path):
    """Lion keeps one moment and Adagrad another: the checkpoint's files hold the master and that
    moment (no file of zeros for the other), resume is exact, and a checkpoint whose manifest
    predates `optim_kinds` (three kinds listed by default) is refused only if a file is missing."""
    import json
    import os

    from infinity.checkpoint.layout import MANIFEST, MANIFEST_CRC, manifest_crc

    (tmp_path / "nvme").mkdir()
    _resumes_exactly(lambda: infinity.initialize(model=_mlp(), config=_optimizer_config(name, "fp32", "nvme",
                                                                                        tmp_path / "nvme"))[0], tmp_path)
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    tag_dir = tmp_path / "ckpt" / latest
    names = os.listdir(tag_dir)
    assert any(n.endswith(f".{kept}.bin") for n in names) and any(n.endswith(".master.bin") for n in names)
    assert not any(n.endswith(f".{absent}.bin") for n in names), names
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    assert manifest["optim_kinds"] == ["master", kept]
    # the same manifest without the key reads as an older checkpoint's: all three kinds expected
    del manifest["optim_kinds"]
    manifest[MANIFEST_CRC] = manifest_crc({k: v for k, v in manifest.items() if k != MANIFEST_CRC})
    (tag_dir / MANIFEST).write_text(json.dumps(manifest))
    engine = infinity.initialize(model=_mlp(), config=_optimizer_config(name, "fp32", "nvme", tmp_path / "nvme"))[0]
    with pytest.raises(Exception, match=f"lists no extent of unit 0 in rank00000.{absent}.bin"):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    engine.close()


# ---- two ranks ---------------------------------------------------------------------------------------

_TWO_RANK_CASES = {  # name -> (config optimizer type, moment format, offload_optimizer, zero extras)
    "adagrad-cpu": ("Adagrad", "fp32", "cpu", {}),
    "lion-nvme-bf16": ("Lion", "bf16", "nvme", {}),
    "adamw-nvme-8bit": ("AdamW", "8bit", "nvme", {}),
    "lamb-nvme-tiled": ("Lamb", "fp32", "nvme", {"tile_size": 2048}),
}


def _two_rank_worker(rank: int, port: int, results, nvme_path: str) -> None:
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for key, (name, fmt, optim, zero) in _TWO_RANK_CASES.items():
            path = f"{nvme_path}/{key}"
            os.makedirs(path, exist_ok=True)
            if name == "Lamb":
                cfg = _lamb_config(optim, path, **zero)
            else:
                cfg = _optimizer_config(name, fmt, optim, path, **zero)
            cfg["train_micro_batch_size_per_gpu"] = 4
            engine, *_ = infinity.initialize(model=_mlp(), config=cfg)
            losses = []
            for x in _mlp_data(STEPS):
                loss = engine(x.chunk(2)[rank]).pow(2).mean()
                engine.backward(loss)
                engine.step()
                total = loss.detach().clone()
                torch.distributed.all_reduce(total)
                losses.append(total.item() / 2)
            state = engine.consolidated_state_dict()
            engine.close()
            if rank == 0:
                results[key] = (losses, state)
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_equal_one_process_references(tmp_path):
    """Each shard holds half of every tensor: Adagrad, Lion (bf16 moments), 8-bit Adam and LAMB (its
    norms summed over ranks and tiles) on two gloo ranks equal plain PyTorch on the whole batch."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_rank_worker, args=(port, results, str(tmp_path)), nprocs=2)
        results = dict(results)
    for key, (name, fmt, _, _) in _TWO_RANK_CASES.items():
        if name == "Lamb":
            ref_losses, ref = _lamb_reference(STEPS)
        else:
            ref_losses, ref = _run_reference(_OPTIMIZERS[name][1], STEPS, rounded=None if fmt == "fp32" else fmt,
                                             world=2)
        losses, state = results[key]
        _close(losses, ref_losses)
        for n, value in ref.state_dict().items():
            torch.testing.assert_close(state[n], value, atol=1e-5, rtol=1e-5, msg=lambda m, where=f"{key}: {n}": f"{where}\n{m}")
