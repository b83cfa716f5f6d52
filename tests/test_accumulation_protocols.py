"""The two ways frameworks drive an accumulation give the same numbers, and PyTorch's.

DeepSpeed's protocol: forward, `backward`, `step()` after every micro-batch; the boundary
follows from gradient_accumulation_steps. accelerate's (1.15, `DeepSpeedEngineWrapper.backward`):
forward, then `set_gradient_accumulation_boundary(sync_gradients)`, `backward`, and `step()`
only at the boundary; so the boundary is known only after the forward has run."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config, engine_run, reference_run

STEPS = 3
GAS = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyGPT()


def accelerate_run(engine, data, *, gas: int) -> list[float]:
    """What accelerate's `accelerator.backward` does with a DeepSpeed engine, micro-batch by
    micro-batch: the boundary is set after the forward, `step()` runs only at the boundary."""
    losses = []
    for i in range(0, len(data), gas):
        total = torch.zeros(())
        for j, (idx, tgt) in enumerate(data[i:i + gas]):
            loss = engine(idx, tgt)
            sync = j == gas - 1
            engine.set_gradient_accumulation_boundary(is_boundary=sync)
            engine.backward(loss)
            if sync:
                engine.step()
            total += loss.detach().float().cpu() / gas
        losses.append(total.item())
    return losses


def _config(tmp_path, placement: str, clip: float) -> dict:
    device = "cpu" if placement == "cpu" else "nvme"
    cfg = config(3, device, device, GAS, clip=clip, sub_group_size=4096, stage3_max_reuse_distance=0)
    if placement == "nvme":
        z = cfg["zero_optimization"]
        z["offload_param"].update(nvme_path=str(tmp_path), buffer_count=4, max_in_cpu=0)
        z["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    return cfg


def _train(model, cfg, data, run) -> tuple[list[float], dict[str, torch.Tensor], int]:
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    try:
        losses = run(engine, data, gas=GAS)
        return losses, engine.consolidated_state_dict(), engine.global_steps
    finally:
        engine.close()


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_accelerates_protocol_matches_deepspeeds_and_pytorch(tmp_path, model, placement, clip):
    """The same bits as DeepSpeed's protocol (the arithmetic is the same), and plain PyTorch
    within 1e-5; with clipping (updates after the norm) and without (updates during backward)."""
    data = batches(STEPS * GAS, 4)
    cfg = _config(tmp_path, placement, clip)
    ds_losses, ds_state, _ = _train(model, cfg, data, engine_run)
    acc_losses, acc_state, steps = _train(model, cfg, data, accelerate_run)
    assert steps == STEPS
    assert acc_losses == ds_losses
    for name, value in ds_state.items():
        assert torch.equal(acc_state[name], value), name
    ref_losses, ref_model = reference_run(model, data, gas=GAS, clip=clip)
    for x, y in zip(acc_losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-6 * abs(y)
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(acc_state[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_a_boundary_set_before_the_forward_still_counts(tmp_path, model, placement):
    """DeepSpeed's own use: the boundary decided before the forward (every micro-batch one
    here), `step()` after each: each micro-batch is a step of its own."""
    data = batches(STEPS, 4)
    cfg = _config(tmp_path, placement, 1.0)

    def every_micro_batch_a_step(engine, data, *, gas):
        losses = []
        for idx, tgt in data:
            engine.set_gradient_accumulation_boundary(True)
            loss = engine(idx, tgt)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            losses.append(loss.item())
        return losses

    losses, state, steps = _train(model, cfg, data, every_micro_batch_a_step)
    assert steps == STEPS
    ref_losses, ref_model = reference_run(model, data, gas=1, clip=1.0)
    for x, y in zip(losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-6 * abs(y)
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)


def _reference_groups(model, data, groups: list[int], *, gas: int, clip: float):
    """Plain PyTorch over accumulations of `groups` micro-batches each, every loss scaled by
    1/gas as DeepSpeed's backward scales it (an accumulation cut short included)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, at = [], 0
    for n in groups:
        for idx, tgt in data[at:at + n]:
            loss = model(idx, tgt)
            (loss / gas).backward()
            losses.append(loss.item())
        at += n
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, model


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_boundary_other_than_the_forward_expected(tmp_path, model, placement, clip):
    """accelerate's accumulations of 3, 1 and 2 micro-batches with gradient_accumulation_steps 2
    (its sync_gradients is True early at the end of a dataloader, and a user may set it): the
    forward expects the boundary after two passes, the backward finds another, and the plan
    changes then; the numbers are PyTorch's and the state read ahead for a boundary that did
    not come goes back to the pool, but for the pieces the pool holds from step to step
    ([Note: the pool is a budget] in offload/optimizer/sizing.py)."""
    groups = [3, 1, 2]
    data = batches(sum(groups), 4)
    cfg = _config(tmp_path, placement, clip)
    if placement == "nvme":  # room to read state ahead beside the update's own pipeline
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 24
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    losses = []
    for n in groups:
        for j in range(n):
            idx, tgt = data[len(losses)]
            loss = engine(idx, tgt)
            engine.set_gradient_accumulation_boundary(j == n - 1)
            engine.backward(loss)
            losses.append(loss.item())
            if j == n - 1:
                engine.step()
            elif placement == "nvme" and engine.global_steps == 0:  # no update is pending yet
                tier = engine.optim_state  # what stays read is only pieces the pool holds anyway
                in_memory = tier.pieces.in_memory()
                kept = [p for p in in_memory if p.held]
                assert len(kept) == len(in_memory) and len(kept) <= engine.chosen["offload_optimizer"]["pieces_held"]
                assert tier.swapper.buffers_available == tier.pool.buffer_count - 3 * len(kept)
    assert engine.global_steps == len(groups)
    state = engine.consolidated_state_dict()
    engine.close()
    ref_losses, ref_model = _reference_groups(model, data, groups, gas=GAS, clip=clip)
    for x, y in zip(losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-6 * abs(y)
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)
