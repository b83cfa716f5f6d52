"""infinity.initialize(device=...): the engine computes on the device a framework chose (Lightning's
root device), checked against INFINITY_DEVICE, rather than on whatever make_device() would pick."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity

CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}


def _engine(**kwargs):
    engine, *_ = infinity.initialize(model=nn.Linear(4, 4), config=CONFIG, **kwargs)
    return engine


def test_the_cpu_asked_for_wins_over_cudas_presence(monkeypatch):
    monkeypatch.delenv("INFINITY_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # make_device() alone would pick CUDA
    engine = _engine(device=torch.device("cpu"))
    try:
        assert engine.accelerator.name == "cpu" and engine.device == torch.device("cpu")
        loss = engine(torch.randn(2, 4)).sum()
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


def test_the_test_device_computes_on_the_cpu(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "async-test")
    engine = _engine(device="cpu")
    assert engine.accelerator.name == "async-test"
    engine.close()


@pytest.mark.parametrize(("env", "device", "said"), [
    ("cuda", "cpu", "device: the CPU was asked for, but INFINITY_DEVICE=cuda; unset INFINITY_DEVICE or set it to cpu"),
    ("cpu", "cuda:0", "device: cuda:0 was asked for, but INFINITY_DEVICE=cpu; unset INFINITY_DEVICE or set it to "
                      "cuda"),
    ("async-test", "cuda", "device: cuda was asked for, but INFINITY_DEVICE=async-test"),
    ("cpu", "meta", "device: infinity computes on CUDA or the CPU, got meta"),
    ("cpu", "no-such-device", "device: expected a torch.device, 'cpu' or 'cuda\\[:index\\]', got 'no-such-device'"),
])
def test_a_device_that_contradicts_the_setting_is_one_clear_error(monkeypatch, env, device, said):
    monkeypatch.setenv("INFINITY_DEVICE", env)
    with pytest.raises(ValueError, match=said):
        _engine(device=device)
