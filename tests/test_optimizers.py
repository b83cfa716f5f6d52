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
    with pytest.raises(TypeError, match=r"SGD .*offload_optimizer.device.*Adam, AdamW, Adagrad, Lion"):
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
