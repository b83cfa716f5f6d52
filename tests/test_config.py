"""load_config: DeepSpeed's schema, defaults, batch rule, and errors that name the key path."""

from __future__ import annotations

import ast
import importlib
import copy
import dataclasses
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from infinity.config import sections as config_sections
from infinity.config import (
    AIOConfig,
    BatchConfig,
    InfinityConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
    load_config,
)

MINIMAL: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}


def design_example(nvme_path: str) -> dict[str, Any]:
    """The config shown in DESIGN.md section 1, with its NVMe directory replaced."""
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
    }


def with_key(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `base` with the dotted `path` set to `value` (objects created on the way)."""
    result = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = result
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return result


def raises(config: dict[str, Any], error: type[Exception], message: str, **kwargs: Any) -> str:
    """Assert load_config raises `error` whose message contains `message`; return the message."""
    with pytest.raises(error) as caught:
        load_config(config, **kwargs)
    assert message in str(caught.value), str(caught.value)
    return str(caught.value)


# --- whole configs

def test_design_example_parses(tmp_path: Path) -> None:
    config = load_config(design_example(str(tmp_path)))
    assert config.batch == BatchConfig(train_batch_size=4, train_micro_batch_size_per_gpu=4,
                                       gradient_accumulation_steps=1, world_size=1)
    assert config.gradient_clipping == 1.0
    assert config.bf16.enabled and not config.fp16.enabled
    assert config.compute_dtype == torch.bfloat16
    assert config.optimizer == OptimizerConfig(type="AdamW", params=config.optimizer.params)
    assert config.optimizer.params.lr == 1e-4 and config.optimizer.params.weight_decay == 0.01
    assert config.optimizer.params.betas == (0.9, 0.999)
    assert config.optimizer.decoupled_weight_decay
    zero = config.zero
    assert zero.stage == 3 and zero.overlap_comm is True
    assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == tmp_path
    assert zero.offload_param.buffer_size == 100_000_000
    assert isinstance(zero.offload_param.buffer_size, int)
    assert zero.offload_param.max_in_cpu == 1_000_000_000
    assert zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.buffer_count == 4
    assert config.aio == AIOConfig()
    assert config.scheduler is None


def test_design_example_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(design_example(str(tmp_path))))
    expected = load_config(design_example(str(tmp_path)))
    assert load_config(path) == expected
    assert load_config(str(path)) == expected


def test_design_example_verbatim_needs_its_nvme_directory() -> None:
    if os.path.isdir("/local_nvme"):
        pytest.skip("/local_nvme exists here")
    raises(design_example("/local_nvme"), ValueError,
           "zero_optimization.offload_param.nvme_path: directory does not exist: /local_nvme")


def test_resolved_hugging_face_style_config_parses(tmp_path: Path) -> None:
    config = {
        "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "consecutive_hysteresis": False,
                 "min_loss_scale": 1},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": False}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                     "warmup_num_steps": 500}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 16777216,
            "stage3_prefetch_bucket_size": 15099494,
            "stage3_param_persistence_threshold": 40960, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
            "reduce_scatter": True, "allgather_partitions": True, "allgather_bucket_size": 5e8,
            "round_robin_gradients": False,
        },
        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 2000,
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    parsed = load_config(config, world_size=2)
    assert parsed.compute_dtype == torch.float16
    assert parsed.fp16.dynamic_loss_scale
    assert parsed.optimizer.params.betas == (0.9, 0.95)
    assert parsed.scheduler.type == "WarmupLR"
    assert parsed.scheduler.params.warmup_max_lr == 3e-5
    assert parsed.zero.offload_param.pin_memory and parsed.zero.offload_optimizer.device == "cpu"
    assert parsed.zero.stage3_gather_16bit_weights_on_model_save
    assert parsed.steps_per_print == 2000


def test_defaults_are_deepspeeds() -> None:
    config = load_config(MINIMAL)
    assert config.batch.train_batch_size == 1 and config.batch.gradient_accumulation_steps == 1
    assert config.fp16.loss_scale == 0 and config.fp16.initial_scale_power == 16
    assert config.fp16.loss_scale_window == 1000 and config.fp16.hysteresis == 2
    assert config.fp16.min_loss_scale == 1 and not config.fp16.consecutive_hysteresis
    assert config.compute_dtype == torch.float32
    assert config.optimizer is None and config.scheduler is None
    assert config.gradient_clipping == 1.0 and config.steps_per_print is None  # 0.19.8: clips at 1.0, never prints
    assert not config.wall_clock_breakdown
    zero = config.zero
    assert zero.stage == 0 and zero.overlap_comm is False and zero.contiguous_gradients
    assert zero.offload_param == OffloadParamConfig()
    assert (zero.offload_param.device, zero.offload_param.buffer_count) == ("none", 5)
    assert zero.offload_param.buffer_size == 10**8 and zero.offload_param.max_in_cpu == 10**9
    assert zero.offload_optimizer.buffer_count == 4
    assert zero.stage3_prefetch_bucket_size == 5 * 10**7
    assert zero.stage3_max_live_parameters == 10**9 and zero.stage3_max_reuse_distance == 10**9
    assert zero.stage3_param_persistence_threshold == 10**5
    assert zero.sub_group_size == 10**9 and zero.reduce_bucket_size == 5 * 10**8
    aio = config.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count) == (1048576, 8, 1)
    assert not aio.single_submit and aio.overlap_events


def test_input_dict_is_not_modified(tmp_path: Path) -> None:
    config = with_key(design_example(str(tmp_path)), "aio.intra_op_parallelism", 1)
    before = copy.deepcopy(config)
    load_config(config)
    assert config == before


def test_configs_are_frozen() -> None:
    config = load_config(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero.stage = 3  # type: ignore[misc]


@pytest.mark.parametrize("module", ["sections", "optimizer_sections", "zero_sections"])
def test_every_dataclass_field_has_a_docstring(module: str) -> None:
    tree = ast.parse(inspect.getsource(importlib.import_module(f"infinity.config.{module}")))
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name[0].isupper()):
            continue
        body = node.body
        for i, statement in enumerate(body):
            if not isinstance(statement, ast.AnnAssign) or "ClassVar" in ast.unparse(
                    statement.annotation):
                continue
            following = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), (
                f"{node.name}.{ast.unparse(statement.target)} has no docstring")


# --- batch sizes

@pytest.mark.parametrize(("given", "world_size", "expected"), [
    # (train_batch_size, micro, accumulation) given -> (train, micro, accumulation)
    ((32, 4, 2), 4, (32, 4, 2)),                # all three, consistent
    ((32, 4, None), 4, (32, 4, 2)),             # accumulation derived
    ((32, None, 2), 4, (32, 4, 2)),             # micro derived
    ((None, 4, 2), 4, (32, 4, 2)),              # train derived
    ((32, None, None), 4, (32, 8, 1)),          # train only: accumulation 1
    ((None, 4, None), 4, (16, 4, 1)),           # micro only: accumulation 1
    ((None, 3, None), 1, (3, 3, 1)),
    ((12, None, None), 1, (12, 12, 1)),
])
def test_batch_sizes_follow_deepspeeds_rule(given: tuple, world_size: int,
                                            expected: tuple) -> None:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {name: value for name, value in zip(names, given) if value is not None}
    batch = load_config(raw, world_size=world_size).batch
    assert (batch.train_batch_size, batch.train_micro_batch_size_per_gpu,
            batch.gradient_accumulation_steps) == expected
    assert batch.world_size == world_size


@pytest.mark.parametrize(("raw", "world_size", "message"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 2,
     "train_batch_size: 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
     "* world_size 2 (= 16)"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1,
     "train_batch_size: 10 is not a multiple of train_micro_batch_size_per_gpu 3 * world_size 1"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, 1,
     "train_batch_size: 10 is not a multiple of gradient_accumulation_steps 4 * world_size 1"),
    ({"train_batch_size": 2}, 4, "train_batch_size: 2 is not a multiple of"),
    ({}, 1, "train_batch_size, train_micro_batch_size_per_gpu: give at least one"),
    ({"gradient_accumulation_steps": 4}, 1, "give at least one"),
    ({"train_batch_size": 0}, 1, "train_batch_size: expected an integer >= 1, got 0"),
    ({"train_micro_batch_size_per_gpu": -2}, 1, "train_micro_batch_size_per_gpu: expected an"),
    ({**MINIMAL, "gradient_accumulation_steps": 0}, 1, "gradient_accumulation_steps: expected"),
])
def test_batch_size_errors(raw: dict, world_size: int, message: str) -> None:
    raises(raw, ValueError, message, world_size=world_size)


@pytest.mark.parametrize("value", [4.0, "4", True])
def test_batch_sizes_must_be_integers(value: Any) -> None:
    raises({"train_micro_batch_size_per_gpu": value}, TypeError,
           "train_micro_batch_size_per_gpu: expected an integer")


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_is_checked(world_size: int) -> None:
    raises(MINIMAL, ValueError, "world_size: expected an integer >= 1", world_size=world_size)


def test_an_infinity_config_passes_through_for_its_world_size() -> None:
    config = load_config(MINIMAL, world_size=2)
    assert load_config(config, world_size=2) is config
    with pytest.raises(ValueError, match="world_size: the config was built for world_size 2"):
        load_config(config, world_size=1)


# --- sizes

@pytest.mark.parametrize(("value", "expected"), [
    (500000000, 500_000_000), (5e8, 500_000_000), ("5e8", 500_000_000), ("1e9", 10**9),
    ("500000000", 500_000_000), (" 1E8 ", 10**8), (0, 0), ("0", 0), (1.0e18, 10**18),
    ("1.5e3", 1500),
])
def test_sizes_accept_deepspeeds_spellings(value: Any, expected: int) -> None:
    config = load_config(with_key(MINIMAL, "zero_optimization.reduce_bucket_size", value))
    assert config.zero.reduce_bucket_size == expected
    assert type(config.zero.reduce_bucket_size) is int


@pytest.mark.parametrize(("value", "error", "message"), [
    (1.5, ValueError, "expected a whole number"),
    ("2.5e0", ValueError, "expected a whole number"),
    ("5e8x", ValueError, "expected a whole number"),
    ("nan", ValueError, "expected a whole number"),
    ("inf", ValueError, "expected a whole number"),
    (float("inf"), ValueError, "expected a whole number"),
    (-1, ValueError, "expected a size >= 0, got -1"),
    ("-5e8", ValueError, "expected a size >= 0"),
    (True, TypeError, "expected a whole number"),
    (None, TypeError, "expected a whole number"),
    ([5], TypeError, "expected a whole number"),
])
def test_bad_sizes_name_their_path(value: Any, error: type, message: str) -> None:
    config = with_key(MINIMAL, "zero_optimization.offload_param.buffer_size", value)
    raises(config, error, f"zero_optimization.offload_param.buffer_size: {message}")


def test_aio_block_size_must_be_positive() -> None:
    raises(with_key(MINIMAL, "aio.block_size", 0), ValueError, "aio.block_size: expected a size")


def test_aio_block_size_is_whole_pages_as_aio_bench_sweep_says() -> None:
    raises(with_key(MINIMAL, "aio.block_size", 1000), ValueError, "aio.block_size: expected a whole number of pages")
    assert load_config(with_key(MINIMAL, "aio.block_size", 262144)).aio.block_size == 262144


# --- unknown, unimplemented and "auto" keys

@pytest.mark.parametrize(("path", "suggestion"), [
    ("train_batch_sise", "train_batch_size"),
    ("zero_optimisation", "zero_optimization"),
    ("zero_optimization.offload_parm", "zero_optimization.offload_param"),
    ("zero_optimization.offload_param.buffer_sise", "zero_optimization.offload_param.buffer_size"),
    ("zero_optimization.offload_optimizer.pipline_read",
     "zero_optimization.offload_optimizer.pipeline_read"),
    ("zero_optimization.stage3_prefetch_bucket", "zero_optimization.stage3_prefetch_bucket_size"),
    ("aio.queue_dept", "aio.queue_depth"),
    ("fp16.loss_scale_windo", "fp16.loss_scale_window"),
    ("bf16.enable", "bf16.enabled"),
])
def test_unknown_key_names_path_and_closest_valid_key(path: str, suggestion: str) -> None:
    raises(with_key(MINIMAL, path, 1), ValueError,
           f"{path}: unknown key; did you mean {suggestion}?")


def test_unknown_key_in_optimizer_and_scheduler_params() -> None:
    optimizer = {"type": "Adam", "params": {"betaz": [0.9, 0.99]}}
    raises({**MINIMAL, "optimizer": optimizer}, ValueError,
           "optimizer.params.betaz: unknown key; did you mean optimizer.params.betas?")
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_l": 0.1}}
    raises({**MINIMAL, "scheduler": scheduler}, ValueError,
           "scheduler.params.warmup_max_l: unknown key; did you mean scheduler.params.warmup_max_lr?")


def test_unknown_key_without_a_close_match_lists_the_valid_ones() -> None:
    message = raises(with_key(MINIMAL, "aio.zzz", 1), ValueError, "aio.zzz: unknown key; valid")
    assert "queue_depth" in message


@pytest.mark.parametrize(("path", "value"), [
    ("tensorboard", {"enabled": True}),
    ("flops_profiler", {"enabled": True}),
    ("comms_logger", {"enabled": True}),  # disabled, they are accepted: test_a_disabled_section_is_accepted
    ("amp", {"enabled": True}),
    ("compression_training", {}),
    ("pipeline", {}),
    ("data_efficiency", {}),
    ("wandb", {"enabled": True}),
    ("communication_data_type", "fp32"),
    ("zero_optimization.zero_hpz_partition_size", 8),
    ("checkpoint.tag_validation", "Fail"),
    ("checkpoint.use_node_local_storage", True),
    ("zero_optimization.mics_shard_size", 8),
    ("zero_optimization.zero_quantized_weights", True),
    ("zero_optimization.zero_quantized_gradients", True),
    ("zero_optimization.stage3_model_persistence_threshold", 1e9),
    ("fp16.fused_mode", True),
    ("optimizer.params.max_grad_norm", 1.0),
])
def test_deepspeed_keys_not_implemented_are_errors(path: str, value: Any) -> None:
    config = with_key({**MINIMAL, "optimizer": {"type": "Adam"}}, path, value)
    raises(config, ValueError, f"{path}: DeepSpeed key not implemented by infinity")


def test_not_implemented_hints_point_to_what_to_use() -> None:
    config = with_key({**MINIMAL, "optimizer": {"type": "Adam"}},
                      "optimizer.params.max_grad_norm", 1.0)
    raises(config, ValueError, "use the top-level gradient_clipping")



@pytest.mark.parametrize(("name", "field", "value"), [
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 10),
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 123),
    ("max_live_parameters", "stage3_max_live_parameters", 456),
    ("max_reuse_distance", "stage3_max_reuse_distance", 0),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
    ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
])
def test_deepspeeds_other_names_of_a_zero_key_are_read_as_it(name, field, value) -> None:
    """DeepSpeed's ZeRO config takes its stage-3 keys under their field names too (pydantic
    aliases), and its deprecated fp16 key as the 16-bit one."""
    config = load_config({**MINIMAL, "zero_optimization": {"stage": 3, name: value}})
    assert getattr(config.zero, field) == value
    raises({**MINIMAL, "zero_optimization": {"stage": 3, name: value, field: value}}, ValueError,
           f"zero_optimization.{name}, zero_optimization.{field}: one key under 2 names")


def test_a_string_enum_is_the_string_it_holds() -> None:
    import enum

    class Device(str, enum.Enum):  # DeepSpeed's OffloadDeviceEnum
        cpu = "cpu"

    config = load_config({**MINIMAL, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": Device.cpu}}})
    assert config.zero.offload_optimizer.device == "cpu" and type(config.zero.offload_optimizer.device) is str


@pytest.mark.parametrize(("path", "default", "other"), [
    ("optimizer.params.amsgrad", False, True),
    ("optimizer.params.bias_correction", True, False),
    ("optimizer.legacy_fusion", False, True),
    ("fp16.auto_cast", False, True),
    ("fp16.fp16_master_weights_and_grads", False, True),
    ("bf16.bf16_master_weights_and_grads", False, True),
    ("aio.use_gds", False, True),
    ("zero_optimization.offload_optimizer.ratio", 1.0, 0.5),
    ("zero_optimization.offload_optimizer.super_offload", False, True),
    ("zero_optimization.elastic_checkpoint", False, True),
    ("prescale_gradients", False, True),
    ("gradient_predivide_factor", 1.0, 2.0),
    ("disable_python_gc", False, True),
    ("zero_optimization.compute_grad_norm", True, False),
    ("zero_optimization.parameter_alignment", False, True),
])
def test_keys_accepted_only_at_deepspeeds_default(path: str, default: Any, other: Any) -> None:
    base = {**MINIMAL, "optimizer": {"type": "Adam"}}
    load_config(with_key(base, path, default))
    message = raises(with_key(base, path, other), ValueError,
                     f"{path}: DeepSpeed key not implemented by infinity except at DeepSpeed's "
                     f"default {json.dumps(default)}")
    assert message.endswith(f"got {json.dumps(other)}")


def test_a_default_only_boolean_is_not_matched_by_zero() -> None:
    config = with_key({**MINIMAL, "optimizer": {"type": "Adam"}}, "optimizer.params.amsgrad", 0)
    raises(config, ValueError, "optimizer.params.amsgrad: DeepSpeed key not implemented")


@pytest.mark.parametrize(("path", "value"), [
    ("zero_optimization.reduce_scatter", True),
    ("zero_optimization.allgather_partitions", False),
    ("zero_optimization.allgather_bucket_size", "5e8"),
    ("zero_optimization.round_robin_gradients", True),
    ("zero_optimization.offload_optimizer.convert_grad_on_cpu", True),
    ("optimizer.params.torch_adam", True),
    ("bf16.immediate_grad_update", True),
    ("zero_allow_untested_optimizer", True),
])
def test_keys_without_effect_are_accepted(path: str, value: Any) -> None:
    load_config(with_key({**MINIMAL, "optimizer": {"type": "Adam"}}, path, value))


@pytest.mark.parametrize(("path", "value", "error", "message"), [
    ("zero_optimization.reduce_scatter", 1, TypeError, "expected true or false, got 1"),
    ("zero_optimization.allgather_bucket_size", 1.5, ValueError, "expected a whole number"),
    ("optimizer.params.torch_adam", "true", TypeError, 'expected true or false, got "true"'),
])
def test_keys_without_effect_are_still_type_checked(path: str, value: Any, error: type,
                                                     message: str) -> None:
    raises(with_key({**MINIMAL, "optimizer": {"type": "Adam"}}, path, value), error,
           f"{path}: {message}")


@pytest.mark.parametrize(("config", "paths"), [
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
    ({**MINIMAL, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}},
     "optimizer.params.lr, optimizer.params.betas"),
    ({**MINIMAL, "zero_optimization": {"stage3_prefetch_bucket_size": "auto"}},
     "zero_optimization.stage3_prefetch_bucket_size"),
    ({**MINIMAL, "optimizer": {"type": "Adam", "params": {"betas": [0.9, "auto"]}}},
     "optimizer.params.betas[1]"),
    ({**MINIMAL, "bf16": {"enabled": "auto"}}, "bf16.enabled"),
])
def test_auto_values_must_be_resolved_by_the_caller(config: dict, paths: str) -> None:
    message = raises(config, ValueError, f'{paths}: "auto" must be resolved before the config')
    assert "Hugging Face Trainer" in message


def test_auto_is_reported_before_anything_else() -> None:
    raises({"train_batch_size": "auto", "tensorboard": {}}, ValueError, '"auto" must be resolved')


# --- wrong types and values

@pytest.mark.parametrize(("path", "value", "error", "message"), [
    ("zero_optimization.stage", 4, ValueError, "expected one of 0, 1, 2, 3, got 4"),
    ("zero_optimization.stage", "3", ValueError, 'expected one of 0, 1, 2, 3, got "3"'),
    ("zero_optimization.stage", True, ValueError, "expected one of 0, 1, 2, 3, got true"),
    ("zero_optimization.offload_param.device", "gpu", ValueError,
     'expected one of "none", "cpu", "nvme", got "gpu"'),
    ("zero_optimization.offload_optimizer.device", "CPU", ValueError,
     'expected one of "none", "cpu", "nvme", got "CPU"'),
    ("zero_optimization.overlap_comm", 1, TypeError, "expected true or false, got 1"),
    ("zero_optimization.contiguous_gradients", "true", TypeError, "expected true or false"),
    ("zero_optimization.offload_param.pin_memory", 0, TypeError, "expected true or false, got 0"),
    ("fp16.enabled", 1, TypeError, "expected true or false, got 1"),
    ("fp16.loss_scale", -1, ValueError, "expected a number >= 0.0, got -1"),
    ("fp16.loss_scale", "0", TypeError, 'expected a number, got "0"'),
    ("fp16.initial_scale_power", 16.0, TypeError, "expected an integer, got 16.0"),
    ("fp16.hysteresis", 0, ValueError, "expected an integer >= 1, got 0"),
    ("gradient_clipping", -1.0, ValueError, "expected a number >= 0.0"),
    ("gradient_clipping", float("nan"), ValueError, "expected a finite number"),
    ("gradient_clipping", True, TypeError, "expected a number, got true"),
    ("steps_per_print", 0, ValueError, "expected an integer >= 1, got 0"),
    ("wall_clock_breakdown", "false", TypeError, 'expected true or false, got "false"'),
    ("aio.queue_depth", 0, ValueError, "expected an integer >= 1, got 0"),
    ("aio.thread_count", 2.0, TypeError, "expected an integer, got 2.0"),
    ("aio.single_submit", 1, TypeError, "expected true or false, got 1"),
    ("aio.intra_op_parallelism", 0, ValueError, "expected an integer >= 1, got 0"),
    ("zero_optimization.offload_param.nvme_path", 5, TypeError, "expected a directory path"),
])
def test_wrong_values_name_path_and_expectation(path: str, value: Any, error: type,
                                                message: str) -> None:
    raises(with_key(MINIMAL, path, value), error, f"{path}: {message}")


@pytest.mark.parametrize("section", ["fp16", "zero_optimization", "aio", "optimizer",
                                     "zero_optimization.offload_param"])
def test_sections_must_be_objects(section: str) -> None:
    raises(with_key(MINIMAL, section, True), TypeError, f"{section}: expected an object")


def test_offload_sections_may_be_null() -> None:
    config = with_key(MINIMAL, "zero_optimization", {"stage": 3, "offload_param": None,
                                                     "offload_optimizer": None})
    assert load_config(config).zero.offload_param.device == "none"


def test_steps_per_print_may_be_null() -> None:
    assert load_config({**MINIMAL, "steps_per_print": None}).steps_per_print is None


def test_overlap_comm_defaults_to_stage_3() -> None:
    assert load_config(with_key(MINIMAL, "zero_optimization.stage", 3)).zero.overlap_comm
    assert not load_config(with_key(MINIMAL, "zero_optimization.stage", 2)).zero.overlap_comm
    config = with_key(MINIMAL, "zero_optimization", {"stage": 3, "overlap_comm": False})
    assert not load_config(config).zero.overlap_comm


# --- precision

def test_fp16_and_bf16_together_is_an_error() -> None:
    raises({**MINIMAL, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, ValueError,
           "fp16.enabled, bf16.enabled: both are true")


def test_bfloat16_is_deepspeeds_legacy_name_for_bf16() -> None:
    config = load_config({**MINIMAL, "bfloat16": {"enabled": True}})
    assert config.bf16.enabled and config.compute_dtype == torch.bfloat16
    raises({**MINIMAL, "bfloat16": {"enabled": 1}}, TypeError, "bfloat16.enabled: expected true")
    raises({**MINIMAL, "bfloat16": {"enabeld": True}}, ValueError, "bfloat16.enabeld: unknown")
    # both, as accelerate writes them beside a user's legacy section: accepted when they agree
    for enabled in (True, False):
        both = load_config({**MINIMAL, "bf16": {"enabled": enabled}, "bfloat16": {"enabled": enabled}})
        assert both.bf16.enabled is enabled
    raises({**MINIMAL, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, ValueError,
           "bfloat16: DeepSpeed's legacy name for bf16, given beside bf16 with other settings")


def test_fp16_settings() -> None:
    fp16 = {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": True,
            "min_loss_scale": 0.0001}
    config = load_config({**MINIMAL, "fp16": fp16})
    assert config.compute_dtype == torch.float16
    assert config.fp16.loss_scale == 128.0 and not config.fp16.dynamic_loss_scale
    assert config.fp16.consecutive_hysteresis and config.fp16.min_loss_scale == 0.0001


# --- optimizer and scheduler

@pytest.mark.parametrize(("name", "canonical"), [
    ("Adam", "Adam"), ("adam", "Adam"), ("ADAM", "Adam"), ("AdamW", "AdamW"), ("adamw", "AdamW"),
])
def test_optimizer_type_is_case_insensitive(name: str, canonical: str) -> None:
    assert load_config({**MINIMAL, "optimizer": {"type": name}}).optimizer.type == canonical


@pytest.mark.parametrize(("name", "adam_w_mode", "decoupled"), [
    ("Adam", None, True),       # DeepSpeed's adam_w_mode default is true
    ("Adam", False, False),
    ("AdamW", None, True),
    ("AdamW", False, True),     # AdamW forces decoupled decay
])
def test_decoupled_weight_decay_follows_deepspeed(name: str, adam_w_mode: bool | None,
                                                  decoupled: bool) -> None:
    params = {} if adam_w_mode is None else {"adam_w_mode": adam_w_mode}
    optimizer = load_config({**MINIMAL, "optimizer": {"type": name, "params": params}}).optimizer
    assert optimizer.decoupled_weight_decay is decoupled


@pytest.mark.parametrize(("optimizer", "error", "message"), [
    ({"type": "SGD"}, ValueError, 'optimizer.type: expected one of "Adam", "AdamW", "Adagrad", "Lion", "Lamb", got "SGD"'),
    ({"type": "OneBitAdam"}, ValueError,
     'optimizer.type: DeepSpeed optimizer "OneBitAdam" not implemented by infinity'),
    ({"type": "OneBitLamb"}, ValueError, "not implemented by infinity"),
    ({"params": {"lr": 1e-3}}, ValueError, "optimizer.type: required key is missing"),
    ({"type": 1}, TypeError, "optimizer.type: expected a string, got 1"),
    ({"type": "Adam", "lr": 1e-3}, ValueError,
     "optimizer.lr: unknown key here; it belongs in optimizer.params.lr"),
    ({"type": "Adam", "adam_w_mode": False}, ValueError, "belongs in optimizer.params.adam_w_mode"),
    ({"type": "Adam", "params": {"betas": [0.9]}}, TypeError,
     "optimizer.params.betas: expected a list of two numbers"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.0]}}, ValueError,
     "optimizer.params.betas[1]: expected a number in [0, 1), got 1.0"),
    ({"type": "Adam", "params": {"lr": -1e-3}}, ValueError, "optimizer.params.lr: expected"),
    ({"type": "Adam", "params": {"eps": "1e-8"}}, TypeError, "optimizer.params.eps: expected a"),
    ({"type": "Adam", "params": {"weight_decay": -0.1}}, ValueError, "optimizer.params.weight_d"),
    ({"type": "Adam", "params": {"adam_w_mode": 0}}, TypeError, "optimizer.params.adam_w_mode"),
])
def test_optimizer_errors(optimizer: dict, error: type, message: str) -> None:
    raises({**MINIMAL, "optimizer": optimizer}, error, message)


@pytest.mark.parametrize(("scheduler", "expected"), [
    ({"type": "WarmupLR"}, {"warmup_min_lr": 0.0, "warmup_max_lr": None,
                            "warmup_num_steps": 1000, "warmup_type": "log"}),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0.1], "warmup_max_lr": [1, 2],
                                     "warmup_type": "linear"}},
     {"warmup_min_lr": (0.0, 0.1), "warmup_max_lr": (1.0, 2.0), "warmup_type": "linear"}),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
     {"total_num_steps": 100, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
      "last_batch_iteration": -1}),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
     {"total_num_steps": 100, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001,
      "warmup_num_steps": 10}),
])
def test_scheduler_params_and_defaults(scheduler: dict, expected: dict) -> None:
    parsed = load_config({**MINIMAL, "scheduler": scheduler}).scheduler
    assert parsed.type == scheduler["type"]
    for name, value in expected.items():
        assert getattr(parsed.params, name) == value, name


@pytest.mark.parametrize(("scheduler", "error", "message"), [
    ({"type": "WarmupLr"}, ValueError,
     'scheduler.type: expected one of "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", '
     '"OneCycle", "LRRangeTest", got "WarmupLr"; did you mean "WarmupLR"?'),
    ({"type": "OneCycle", "params": {}}, ValueError,
     "scheduler.params.cycle_min_lr: required key is missing"),
    ({"type": "StepLR"}, ValueError, "scheduler.type: expected one of"),
    ({"params": {}}, ValueError, "scheduler.type: required key is missing"),
    ({"type": "WarmupDecayLR"}, ValueError,
     "scheduler.params.total_num_steps: required key is missing"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 0}}, ValueError,
     "scheduler.params.total_num_steps: expected an integer >= 1, got 0"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, ValueError,
     'scheduler.params.warmup_type: expected one of "log", "linear", got "cosine"'),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, ValueError,
     "scheduler.params.warmup_num_steps: expected an integer >= 1"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}, TypeError,
     "scheduler.params.warmup_num_steps: expected an integer"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": []}}, ValueError,
     "scheduler.params.warmup_max_lr: expected a number or a non-empty list"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.1, "x"]}}, TypeError,
     "scheduler.params.warmup_min_lr[1]: expected a number"),
    ({"type": "WarmupLR", "params": {"total_num_steps": 10}}, ValueError,
     "scheduler.params.total_num_steps: unknown key"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}},
     ValueError, "scheduler.params.cos_min_ratio: expected a number <= 1.0"),
    ({"type": "WarmupLR", "warmup_num_steps": 10}, ValueError,
     "scheduler.warmup_num_steps: unknown key here; it belongs in "
     "scheduler.params.warmup_num_steps"),
])
def test_scheduler_errors(scheduler: dict, error: type, message: str) -> None:
    raises({**MINIMAL, "scheduler": scheduler}, error, message)


# --- ZeRO, offload and aio

@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_device_requires_nvme_path(section: str) -> None:
    config = with_key(MINIMAL, "zero_optimization", {"stage": 3, section: {"device": "nvme"}})
    raises(config, ValueError,
           f'zero_optimization.{section}.nvme_path: required when device is "nvme"')


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_path_must_be_an_existing_directory(tmp_path: Path, section: str) -> None:
    missing = tmp_path / "missing"
    config = with_key(MINIMAL, "zero_optimization", {
        "stage": 3, section: {"device": "nvme", "nvme_path": str(missing)}})
    raises(config, ValueError,
           f"zero_optimization.{section}.nvme_path: directory does not exist: {missing}")
    a_file = tmp_path / "file"
    a_file.write_text("")
    config["zero_optimization"][section]["nvme_path"] = str(a_file)
    raises(config, ValueError, f"zero_optimization.{section}.nvme_path: not a directory: {a_file}")


def test_nvme_path_is_kept_unused_when_device_is_not_nvme() -> None:
    config = with_key(MINIMAL, "zero_optimization", {
        "stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/does/not/exist"}})
    assert load_config(config).zero.offload_param.nvme_path == Path("/does/not/exist")


@pytest.mark.parametrize(("zero", "message"), [
    ({"stage": 2, "offload_param": {"device": "cpu"}},
     'zero_optimization.offload_param.device: offloading parameters to "cpu" needs '
     "zero_optimization.stage 3, got stage 2"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
     'zero_optimization.offload_optimizer.device: offloading optimizer state to "nvme" needs '
     "zero_optimization.stage 3, got stage 2"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}},
     "zero_optimization.offload_optimizer.device: offloading optimizer state needs "
     "zero_optimization.stage 1, 2 or 3, got stage 0"),
])
def test_offload_needs_a_zero_stage(zero: dict, message: str) -> None:
    raises({**MINIMAL, "zero_optimization": zero}, ValueError, message)


def test_cpu_optimizer_offload_with_stage_1_and_2() -> None:
    for stage in (1, 2):
        config = {**MINIMAL, "zero_optimization": {"stage": stage,
                                                   "offload_optimizer": {"device": "cpu"}}}
        assert load_config(config).zero.offload_optimizer.device == "cpu"


def test_offload_optimizer_pipeline_flags(tmp_path: Path) -> None:
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True,
               "fast_init": True, "buffer_count": "8"}
    zero = load_config({**MINIMAL, "zero_optimization": {"stage": 3,
                                                          "offload_optimizer": offload}}).zero
    assert zero.offload_optimizer.pipeline and zero.offload_optimizer.fast_init
    assert zero.offload_optimizer.buffer_count == 8


@pytest.mark.parametrize(("aio", "threads"), [
    ({"thread_count": 4}, 4),
    ({"intra_op_parallelism": 4}, 4),
    ({"intra_op_parallelism": 4, "thread_count": 4}, 4),
])
def test_aio_thread_count_and_its_newer_name(aio: dict, threads: int) -> None:
    assert load_config({**MINIMAL, "aio": aio}).aio.thread_count == threads


def test_aio_thread_count_and_intra_op_parallelism_must_agree() -> None:
    raises({**MINIMAL, "aio": {"intra_op_parallelism": 4, "thread_count": 2}}, ValueError,
           "aio.intra_op_parallelism, aio.thread_count: two names for the same setting with "
           "different values (4 and 2)")


# --- built from Python

def test_dataclasses_validate_when_built_directly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("zero_optimization.stage: expected one of")):
        ZeroConfig(stage=5)
    with pytest.raises(ValueError, match=re.escape("zero_optimization.offload_param.nvme_path")):
        OffloadParamConfig(device="nvme")
    with pytest.raises(TypeError, match=re.escape("zero_optimization.offload_param: expected a "
                                                  "OffloadParamConfig")):
        ZeroConfig(offload_param={"device": "cpu"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("train_batch_size: 8 != ")):
        BatchConfig(train_batch_size=8, train_micro_batch_size_per_gpu=2,
                    gradient_accumulation_steps=2)
    offload = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_size="1e8")
    assert offload.nvme_path == tmp_path and offload.buffer_size == 10**8
    batch = BatchConfig(train_batch_size=4, train_micro_batch_size_per_gpu=4,
                        gradient_accumulation_steps=1)
    assert InfinityConfig(batch=batch).compute_dtype == torch.float32


# --- reading

def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config: no such file"):
        load_config(tmp_path / "nope.json")


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 4,}')
    with pytest.raises(ValueError, match=f"config: {re.escape(str(path))}: invalid JSON"):
        load_config(path)


def test_duplicate_keys_in_a_file_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 4, "train_batch_size": 8}')
    with pytest.raises(ValueError, match="duplicate key 'train_batch_size'"):
        load_config(path)


def test_config_must_be_an_object_or_a_path(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="config: expected a dict or the path of a JSON file"):
        load_config(42)  # type: ignore[arg-type]
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match=re.escape("config: expected an object ({...})")):
        load_config(path)


@pytest.mark.parametrize("section", ["amp", "flops_profiler", "tensorboard", "wandb"])
def test_a_disabled_section_is_accepted(section):
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    load_config({**base, section: {"enabled": False, "opt_level": "O1"}})
    with pytest.raises(ValueError, match=f"{section}: DeepSpeed key not implemented"):
        load_config({**base, section: {"enabled": True}})


def test_sections_of_missing_features_at_deepspeeds_defaults_are_accepted() -> None:
    """Configs written for DeepSpeed (Hugging Face's examples among them) spell these out at
    their "off" values, which is what infinity does; they were refused as unimplemented."""
    config = {**MINIMAL, "optimizer": {"type": "Adam"},
              "data_types": {"grad_accum_dtype": "fp32"},  # we accumulate in fp32
              "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False},
              "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False, "number_checkpoints": None,
                                           "synchronize_checkpoint_boundary": False, "profile": False},
              "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}
    load_config(config)
    load_config({**config, "data_types": {"grad_accum_dtype": None}, "checkpoint": {"tag_validation": "IGNORE"}})
    raises({**config, "activation_checkpointing": {"partition_activations": False, "checkpoint_in_cpu": True}},
           ValueError, "activation_checkpointing.checkpoint_in_cpu: unknown key; did you mean "
           "activation_checkpointing.cpu_checkpointing?")  # a section of its own (infinity.checkpointing)
    # "bf16"/"fp16" too, accumulating in fp32 (tests/test_config_data_types.py)
    bf16 = load_config(with_key(config, "data_types.grad_accum_dtype", "bf16"))
    assert bf16.data_types.grad_accum_dtype == "bf16"


def test_deepspeeds_deprecated_offload_switches_are_read_as_deepspeed_reads_them() -> None:
    """`cpu_offload: false` (DeepSpeed's own test configs spell it out) is no offload, true the
    section that replaced it with device "cpu"; both at once is DeepSpeed's error too."""
    base = {**MINIMAL, "optimizer": {"type": "Adam"}}
    zero = {"stage": 2, "cpu_offload": False, "cpu_offload_use_pin_memory": False}
    assert load_config({**base, "zero_optimization": zero}).zero.offload_optimizer.device == "none"
    config = load_config({**base, "zero_optimization": {**zero, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert config.zero.offload_optimizer.device == "cpu"
    config = load_config({**base, "zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload": False}})
    assert (config.zero.offload_param.device, config.zero.offload_optimizer.device) == ("cpu", "none")
    raises({**base, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
           ValueError, "zero_optimization.cpu_offload, zero_optimization.offload_optimizer: DeepSpeed's deprecated "
                       "switch and the section that replaces it; give only offload_optimizer")
    raises({**base, "zero_optimization": {"stage": 2, "cpu_offload": "yes"}}, TypeError,
           "zero_optimization.cpu_offload: expected true or false")


def test_checkpoint_section_keeps_deepspeeds_keys_and_adds_save_total_limit() -> None:
    base = {**MINIMAL, "optimizer": {"type": "Adam"}}
    assert load_config(base).checkpoint.save_total_limit is None
    config = load_config({**base, "checkpoint": {"save_total_limit": 3, "tag_validation": "Warn"}})
    assert config.checkpoint.save_total_limit == 3
    raises({**base, "checkpoint": {"save_total_limit": 0}}, ValueError,
           "checkpoint.save_total_limit: expected an integer >= 1, got 0")
    raises({**base, "checkpoint": {"save_total_limit": 2.5}}, TypeError,
           "checkpoint.save_total_limit: expected an integer")
    raises({**base, "checkpoint": {"save_total_limt": 2}}, ValueError,
           "checkpoint.save_total_limt: unknown key; did you mean checkpoint.save_total_limit?")
    raises({**base, "checkpoint": {"load_universal": True}}, ValueError,
           "checkpoint.load_universal: DeepSpeed key not implemented by infinity except at DeepSpeed's default false")
