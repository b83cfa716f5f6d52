"""DeepSpeed's engine getters (infinity/engine/getters.py): each answers what the config in
force says, under DeepSpeed's method name, on a real engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity


def _engine(cfg: dict) -> infinity.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    engine, *_ = infinity.initialize(model=model, config=cfg)
    return engine


@pytest.fixture
def stage3_bf16_nvme(tmp_path):
    engine = _engine({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
        "steps_per_print": 7, "wall_clock_breakdown": True, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 3,
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 9},
                              "stage3_max_live_parameters": 12345, "stage3_max_reuse_distance": 678,
                              "stage3_prefetch_bucket_size": 910, "stage3_param_persistence_threshold": 11,
                              "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 4096,
                              "reduce_bucket_size": 2048},
    })
    yield engine
    engine.close()


@pytest.fixture
def stage2_fp16_cpu():
    engine = _engine({
        "train_batch_size": 4, "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": False,
                              "contiguous_gradients": False},
    })
    yield engine
    engine.close()


def test_getters_of_a_stage3_bf16_nvme_engine(stage3_bf16_nvme) -> None:
    e = stage3_bf16_nvme
    assert (e.train_batch_size(), e.train_micro_batch_size_per_gpu(), e.gradient_accumulation_steps()) == (6, 2, 3)
    assert e.gradient_clipping() == 0.5 and e.steps_per_print() == 7 and e.wall_clock_breakdown() is True
    assert e.bfloat16_enabled() is True and e.fp16_enabled() is False
    assert e.get_data_types() == (torch.bfloat16, torch.float32)
    assert e.zero_optimization() is True and e.zero_optimization_stage() == 3
    assert e.zero_optimization_partition_gradients() is True and e.zero_optimization_partition_weights() is True
    assert e.zero_use_cpu_optimizer() is True and e.zero_nvme_offload_optimizer() is True
    assert e.zero_cpu_offload() is False
    assert e.zero_offload_optimizer().device == "nvme" and e.zero_offload_param().device == "none"
    assert (e.zero_max_live_parameters(), e.zero_max_reuse_distance(), e.zero_prefetch_bucket_size(),
            e.zero_param_persistence_threshold()) == (12345, 678, 910, 11)
    assert e.zero_sub_group_size() == 4096 and e.zero_reduce_bucket_size() == 2048
    assert e.zero_overlap_comm() is True  # DeepSpeed's default for stage 3
    assert e.zero_gather_16bit_weights_on_model_save() is True
    assert e.optimizer_params()["lr"] == 2e-3 and e.optimizer_params()["weight_decay"] == 0.1
    assert e.scheduler_name() == "WarmupLR" and e.scheduler_params()["warmup_num_steps"] == 5
    assert e.scheduler_params()["warmup_type"] == "log"  # the defaults in force, filled in
    assert e.aio_config()["block_size"] == e.config.aio.block_size


def test_getters_of_a_stage2_fp16_cpu_engine(stage2_fp16_cpu) -> None:
    e = stage2_fp16_cpu
    assert (e.train_batch_size(), e.train_micro_batch_size_per_gpu(), e.gradient_accumulation_steps()) == (4, 4, 1)
    assert e.gradient_clipping() == 0.0 and e.steps_per_print() is None
    assert e.fp16_enabled() is True and e.bfloat16_enabled() is False
    assert e.dynamic_loss_scale() is True and e.loss_scale() == 0.0 and e.initial_dynamic_scale() == 256.0
    assert e.get_loss_scale() == 256.0  # the scaler starts where the getter says
    assert e.get_data_types() == (torch.float16, torch.float32)
    assert e.zero_optimization_stage() == 2 and e.zero_optimization_partition_gradients() is True
    assert e.zero_optimization_partition_weights() is False
    assert e.zero_cpu_offload() is True and e.zero_use_cpu_optimizer() is True
    assert e.zero_nvme_offload_optimizer() is False
    assert e.zero_overlap_comm() is False and e.zero_contiguous_gradients() is False
    assert e.zero_gather_16bit_weights_on_model_save() is False
    assert e.scheduler_name() is None and e.scheduler_params() is None
    # Switches infinity takes at DeepSpeed's default only: that default is what runs.
    assert (e.fp16_auto_cast(), e.amp_enabled(), e.sparse_gradients_enabled(), e.dataloader_drop_last(),
            e.memory_breakdown(), e.zero_elastic_checkpoint()) == (False,) * 6
    assert (e.postscale_gradients(), e.zero_load_from_fp32_weights(),
            e.gradient_predivide_factor()) == (True, True, 1.0)


def test_an_inference_engine_has_no_optimizer_params() -> None:
    engine = _engine({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}})
    try:
        assert engine.optimizer_params() is None and engine.zero_optimization() is False
        assert engine.get_data_types() == (torch.float32, torch.float32)
    finally:
        engine.close()


def test_getters_deepspeed_has_for_features_infinity_lacks_are_absent() -> None:
    # No stand-ins: a script asking about pipeline or progressive layer drop learns it is absent.
    for name in ("is_pipe_parallel", "pld_enabled", "eigenvalue_enabled", "flops_profiler_enabled"):
        assert not hasattr(infinity.Engine, name), name
