"""On a CUDA GPU: the device layer's copies against the compute stream, and the engine on the
GPU against plain PyTorch on the same GPU. Skipped without CUDA (conftest); what a lent GPU
machine showed is in bench/results/gpu.md."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before it starts

import infinity  # noqa: E402
from gpt import TinyGPT, batches, config, engine_run  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, GAS = 8, 2


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyGPT()


def _long_compute(n: int = 4096, rounds: int = 20) -> torch.Tensor:
    """Enough queued work on the compute stream that a copy not ordered after it sees old data."""
    a = torch.randn(n, n, device="cuda") / n ** 0.5
    for _ in range(rounds):
        a = torch.tanh(a @ a)  # bounded: the result is finite, so `result * 0` is 0
    return a


def test_a_copy_to_the_host_waits_for_the_compute_that_produced_it():
    from infinity.device.cuda import CudaDevice
    from infinity.io import aligned_empty

    dev = CudaDevice()
    n = 16 << 20
    host = aligned_empty(n, torch.float32)
    for trial in range(1, 6):
        host.fill_(-1)
        y = _long_compute().sum() * 0 + torch.full((n,), float(trial), device="cuda")
        dev.wait_host(dev.to_host(y, host))
        assert bool((host == trial).all()), f"trial {trial}: the copy read the values before the compute wrote them"


def test_a_copy_to_the_device_waits_for_compute_still_reading_its_destination():
    from infinity.device.cuda import CudaDevice
    from infinity.io import aligned_empty

    dev = CudaDevice()
    n = 16 << 20
    src = aligned_empty(n, torch.float32)
    src.fill_(0)
    for _ in range(5):
        dst = torch.ones(n, device="cuda")
        late_sum = (_long_compute().sum() * 0 + dst).sum()  # reads dst after the long compute
        x = dev.to_device(src, dst)
        dev.wait_compute(x)
        assert float(late_sum) == n, "the host -> device copy overwrote values the compute had still to read"
        assert float(dst.sum()) == 0


def test_a_copy_to_the_device_is_complete_for_the_compute_after_wait_compute():
    from infinity.device.cuda import CudaDevice
    from infinity.io import aligned_empty

    dev = CudaDevice()
    n = 64 << 20
    src = aligned_empty(n, torch.float32)
    for trial in range(1, 4):
        src.fill_(trial)
        t = dev.wait_compute(dev.to_device(src))
        assert float(t.sum()) == trial * n  # computed on the compute stream, after the copy's event


def _reference(model, data, *, dtype=torch.float32, lr=3e-3, wd=0.01, clip=1.0):
    """Plain PyTorch on the GPU: AdamW on fp32 values (masters when the model computes in
    bf16), clip_grad_norm_, GAS micro-batches a step."""
    model = copy.deepcopy(model).cuda()
    masters = [p.detach().clone().float() for p in model.parameters()]
    model.to(dtype)
    for p, m in zip(model.parameters(), masters):
        m.requires_grad_(True)
        p.data = m.detach().to(dtype)
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=wd)
    losses = []
    for i in range(0, len(data), GAS):
        total = 0.0
        for idx, tgt in data[i:i + GAS]:
            loss = model(idx.cuda(), tgt.cuda())
            (loss.float() / GAS).backward()
            total += loss.item() / GAS
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        opt.zero_grad()
        for p, m in zip(model.parameters(), masters):
            p.data.copy_(m.detach())
        losses.append(total)
    return losses, dict(zip([n for n, _ in model.named_parameters()], [m.detach().cpu() for m in masters]))


PLACEMENTS = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]


def _engine(model, param, optim, tmp_path, precision=None):
    cfg = config(3, param, optim, GAS)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if param == "nvme":
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    if optim == "nvme":
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    if precision:
        cfg[precision] = {"enabled": True}
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert engine.device.type == "cuda"
    return engine


def test_engine_on_the_gpu_matches_plain_pytorch_on_the_gpu(model, tmp_path):
    data = batches(STEPS * GAS, 4)
    ref_losses, ref_values = _reference(model, data)
    runs = {}
    for param, optim in PLACEMENTS:
        engine = _engine(model, param, optim, tmp_path / f"{param}-{optim}")
        losses = engine_run(engine, data, gas=GAS)
        values = engine.consolidated_state_dict()
        engine.close()
        for i, (x, y) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(x - y) <= 1e-5 * abs(y), f"{param}/{optim} step {i}: {x} vs {y}"
        for name, value in ref_values.items():
            torch.testing.assert_close(values[name], value, atol=1e-5, rtol=1e-5, msg=f"{param}/{optim} {name}")
        runs[(param, optim)] = (losses, values)
    # CPU Adam in all three: the same arithmetic wherever the state lives, so the same bits.
    base_losses, base_values = runs[("none", "cpu")]
    for placement in [("cpu", "cpu"), ("nvme", "nvme")]:
        losses, values = runs[placement]
        assert losses == base_losses, placement
        for name in base_values:
            assert torch.equal(values[name], base_values[name]), (placement, name)


def test_bf16_on_the_gpu_tracks_plain_pytorch_and_placements_agree(model, tmp_path):
    data = batches(STEPS * GAS, 4)
    ref_losses, _ = _reference(model, data, dtype=torch.bfloat16)
    runs = {}
    for param, optim in [("cpu", "cpu"), ("nvme", "nvme")]:
        engine = _engine(model, param, optim, tmp_path / f"{param}-{optim}", precision="bf16")
        assert engine.module.blocks[0].fc1.weight.dtype == torch.bfloat16
        losses = engine_run(engine, data, gas=GAS)
        runs[param] = (losses, engine.consolidated_state_dict())
        engine.close()
        # bf16 compute: both round the same products, but in different unit groupings.
        for i, (x, y) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(x - y) <= 2e-2 * abs(y), f"{param}/{optim} step {i}: {x} vs {y}"
    assert runs["cpu"][0] == runs["nvme"][0]
    for name, value in runs["cpu"][1].items():
        assert torch.equal(runs["nvme"][1][name], value), name


def test_resume_on_the_gpu_is_bit_identical(model, tmp_path):
    data = batches(10, 4)
    engine = _engine(model, "nvme", "nvme", tmp_path / "a")
    engine_run(engine, data[:6], gas=GAS)
    engine.save_checkpoint(tmp_path / "ckpt")
    after = engine_run(engine, data[6:], gas=GAS)
    engine.close()
    resumed = _engine(model, "nvme", "nvme", tmp_path / "b")
    path, _ = resumed.load_checkpoint(tmp_path / "ckpt")
    assert path is not None
    assert engine_run(resumed, data[6:], gas=GAS) == after
    resumed.close()


def test_gpu_memory_holds_units_not_the_model(tmp_path):
    """Parameters and optimizer on NVMe: the GPU holds activations and a few units, not the
    model's parameters, gradients and Adam state as plain PyTorch does."""
    from infinity.apps.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, seq_len=64, dim=512, layers=16, heads=8)
    torch.manual_seed(0)
    net = GPT(cfg)
    idx = torch.randint(0, 512, (2, 65))
    block = sum(p.numel() for p in net.blocks[0].parameters())

    plain = copy.deepcopy(net).cuda()
    opt = torch.optim.AdamW(plain.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    plain(idx[:, :-1].cuda(), idx[:, 1:].cuda()).backward()
    activations_and_grads = torch.cuda.max_memory_allocated() - base
    opt.step()
    torch.cuda.synchronize()
    plain_peak = torch.cuda.max_memory_allocated()
    del plain, opt
    torch.cuda.empty_cache()

    cfg_ = config(3, "nvme", "nvme", 1, micro=2, stage3_max_live_parameters=3 * block)
    cfg_["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    cfg_["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine, *_ = infinity.initialize(net, config=cfg_)
    for _ in range(2):
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
    torch.cuda.synchronize()
    engine_peak = torch.cuda.max_memory_allocated() - base
    engine.close()
    # Activations and gradients as plain PyTorch has them, plus the units the budget allows
    # (3 blocks) and the one the tied embedding makes, in fp32 with their gradients, doubled
    # for the copy in flight beside the one in use.
    embedding = cfg.vocab_size * cfg.dim + cfg.seq_len * cfg.dim
    bound = activations_and_grads + 2 * 8 * (3 * block + embedding)
    assert engine_peak <= bound, (engine_peak, bound, plain_peak)
    assert engine_peak < plain_peak / 2, (engine_peak, plain_peak)
