"""DeepSpeed's runtime names that integrations and DeepSpeed's own tests read, over infinity:
`DeepSpeedConfig` and `get_gradient_clipping`, the ZeRO section's parser, the op builders'
compatibility table, `engine.optimizer.optimizer`, `required_torch_version`, the accelerator's
tensor constructors. (DeepSpeed's own tests of them: tests/test_vendored_suites.py, slow.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import infinity
from infinity.deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
from infinity.deepspeed.ops import __compatible_ops__
from infinity.deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
from infinity.deepspeed.runtime.config import DeepSpeedConfig, get_gradient_clipping
from infinity.deepspeed.runtime.precision_config import get_bfloat16_config
from infinity.deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from infinity.deepspeed.utils.torch import required_torch_version


def test_deepspeed_config_derives_the_batch_and_names_what_it_refuses(tmp_path):
    config = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (8, 4, 2)
    assert config.zero_optimization_stage == 3 and config.zero_enabled and config.bfloat16_enabled
    assert config.gradient_clipping == 1.0 and config.optimizer_name == "adamw"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert DeepSpeedConfig(str(path)).train_batch_size == 2
    with pytest.raises(ValueError, match="gradient_allreduce_op"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum"})
    with pytest.raises(ValueError, match="train_batch_size: 6 is not a multiple"):
        DeepSpeedConfig({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4})


def test_config_helpers_read_what_deepspeed_reads():
    assert get_gradient_clipping({}) == 1.0 and get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled
    zero = DeepSpeedZeroConfig(stage=3, offload_param={"device": "cpu"})
    assert zero.stage == 3 and zero.offload_param.device == "cpu"
    with pytest.raises(ValueError, match="offload_param.device"):
        DeepSpeedZeroConfig(stage=2, offload_param={"device": "cpu"})


def test_builders_and_versions():
    assert __compatible_ops__[CPUAdamBuilder.NAME] and __compatible_ops__[AsyncIOBuilder.NAME]
    assert CPUAdamBuilder().load().DeepSpeedCPUAdam is infinity.optim.DeepSpeedCPUAdam
    assert required_torch_version(min_version=1.8) and not required_torch_version(max_version=1.13)
    assert is_current_accelerator_supported()
    t = get_accelerator().ByteTensor([1, 2, 255])
    assert t.dtype == torch.uint8 and t.tolist() == [1, 2, 255]


def test_engine_optimizer_optimizer_is_the_client_optimizer():
    model = nn.Linear(4, 4)
    client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = infinity.initialize(model=model, optimizer=client,
                                                  config={"train_batch_size": 1})
    assert optimizer.optimizer is client
    engine.close()
    model = nn.Linear(4, 4)
    engine, optimizer, _, _ = infinity.initialize(model=model, config={
        "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with pytest.raises(AttributeError, match="wraps no torch optimizer"):
        optimizer.optimizer
    assert getattr(optimizer, "optimizer", None) is None  # unwrapping loops stop here
    engine.close()
