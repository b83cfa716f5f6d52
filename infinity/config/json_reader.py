"""Reading a DeepSpeed JSON config into the dataclasses of `sections`: the key tables and
the section parsers behind `load_config`. What a setting is lives in sections.py (and the
section modules it imports); how JSON becomes settings, here.

[Note: which DeepSpeed keys are accepted]
Every key falls in exactly one class, and none is silently ignored:
- implemented: a dataclass field of the same name, with DeepSpeed's default and meaning.
- accepted without effect: knobs of DeepSpeed's own machinery that do not change what is
  computed here (bucket sizes of collectives infinity does not issue, `torch_adam`, ...). The
  value is type-checked, then dropped. Tables `_NO_EFFECT_*`.
- accepted at DeepSpeed's default only: switches of features infinity lacks that configs often
  spell out at their "off" value (`"amsgrad": false`, `"use_gds": false`). Any other value is
  an error. Tables `_DEFAULT_ONLY_*`.
- a DeepSpeed key infinity does not implement: an error "DeepSpeed key not implemented by
  infinity", whatever its value. Tables `_NOT_IMPLEMENTED_*`.
- anything else: an unknown key, an error naming the closest valid key.
The value "auto" (Hugging Face's convention) is an error anywhere but in the two `max_in_cpu`
keys, which infinity resolves itself from the host's free memory: the caller resolves it.
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from infinity.config._checks import _bool, _float, _int, _join, _show, _size
from infinity.config.optimizer_sections import (
    PARAMS_OF_TYPE,
    _optimizer_type,
    OptimizerConfig,
    SchedulerConfig,
    _SCHEDULER_PARAMS,
    _scheduler_type,
)
from infinity.config.sections import (
    AIOConfig,
    ActivationCheckpointingConfig,
    BF16Config,
    BatchConfig,
    CheckpointConfig,
    ChunkedLossConfig,
    DataTypesConfig,
    FP16Config,
    InfinityConfig,
    TraceConfig,
)
from infinity.config.zero_sections import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

NOT_IMPLEMENTED = "DeepSpeed key not implemented by infinity"


# --------------------------------------------------------------------------------------------
# Key tables (see [Note: which DeepSpeed keys are accepted])
# --------------------------------------------------------------------------------------------

_Check = Callable[[Any, str], Any]


def _fraction(value: Any, path: str) -> float:
    return _float(value, path, minimum=0.0, maximum=1.0)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ROOT_SCALARS = ("gradient_clipping", "steps_per_print", "wall_clock_breakdown")
_ROOT_SECTIONS = ("fp16", "bf16", "bfloat16", "optimizer", "scheduler", "zero_optimization", "aio", "trace",
                  "checkpoint", "data_types", "activation_checkpointing", "chunked_loss")

_NO_EFFECT_ROOT: dict[str, _Check] = {
    "zero_allow_untested_optimizer": _bool,
    "zero_force_ds_cpu_optimizer": _bool,
}
_DEFAULT_ONLY_ROOT: dict[str, Any] = {
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "sparse_gradients": False,
    "disable_allgather": False, "dump_state": False, "memory_breakdown": False,
    "dataloader_drop_last": False, "disable_python_gc": False,
}
_NOT_IMPLEMENTED_ROOT: dict[str, str] = {
    name: "" for name in (
        "autotuning", "comet", "comms_logger",
        "communication_data_type", "compile", "compression_training", "csv_monitor",
        "curriculum_learning", "data_efficiency", "datastates", "eigenvalue",
        "elasticity", "expert_parallel", "flops_profiler", "gradient_allreduce_op",
        "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation",
        "nebula", "pipeline", "progressive_layer_drop", "quantize_training",
        "seq_parallel_communication_data_type", "sequence_parallel_size", "sparse_attention",
        "swap_tensor", "tensor_parallel", "tensorboard", "timers",
        "use_data_before_expert_parallelism", "vocabulary_size", "wandb", "weight_quantization",
    )
} | {
    "amp": "use bf16 or fp16",
    "torch_autocast": "use bf16 or fp16",
}

_DEFAULT_ONLY_CHECKPOINT: dict[str, Any] = {"load_universal": False, "use_node_local_storage": False}


def _tag_validation(value: Any, path: str) -> None:
    """DeepSpeed's check that every rank saves under the same tag: "Warn" and "Ignore" are
    what happens here (rank 0 names the directory); "Fail" is not implemented."""
    if not any(_is_default(value, mode) for mode in ("Warn", "Ignore")):
        raise ValueError(f'{path}: {NOT_IMPLEMENTED} except at "Warn" or "Ignore", got {_show(value)}')


_NO_EFFECT_CHECKPOINT: dict[str, _Check] = {"tag_validation": _tag_validation}

_DEFAULT_ONLY_FP16: dict[str, Any] = {"auto_cast": False, "fp16_master_weights_and_grads": False}
_NOT_IMPLEMENTED_FP16 = {"fused_mode": "a legacy DeepSpeed key"}

_NO_EFFECT_BF16: dict[str, _Check] = {"immediate_grad_update": _bool}
_DEFAULT_ONLY_BF16: dict[str, Any] = {
    "bf16_master_weights_and_grads": False,
    "bf16_optimizer_states": False,
}

_DEFAULT_ONLY_OPTIMIZER: dict[str, Any] = {"legacy_fusion": False}
_NO_EFFECT_ADAM: dict[str, _Check] = {"torch_adam": _bool}
_DEFAULT_ONLY_ADAM: dict[str, Any] = {
    "amsgrad": False, "bias_correction": True,
}
_NOT_IMPLEMENTED_ADAM = {
    "max_grad_norm": "use the top-level gradient_clipping (DeepSpeed refuses it here too)",
}

_NO_EFFECT_ZERO: dict[str, _Check] = {
    **{name: _bool for name in (
        "reduce_scatter", "allgather_partitions", "round_robin_gradients",
        "ignore_unused_parameters", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
        "cpu_offload_use_pin_memory",  # deprecated: DeepSpeed warns and reads nothing from it
    )},
    **{name: _size for name in (
        "allgather_bucket_size", "stage3_module_granularity_threshold",
        "stage3_partition_stream_chunk_size",
    )},
}
_DEFAULT_ONLY_ZERO: dict[str, Any] = {
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "compute_grad_norm": True,
    "parameter_alignment": False, "zero_hpz_partition_size": 1,
}
_NOT_IMPLEMENTED_ZERO: dict[str, str] = {
    name: "" for name in (
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "zenflow", "leaf_module",
        "stage3_model_persistence_threshold", "save_muon_momentum_buffer_in_memory",
        "pipeline_loading_checkpoint", "legacy_stage1",
    )
}

# DeepSpeed's deprecated switches, read as DeepSpeed reads them: true is the section it names with
# device "cpu", false no offload; given beside that section, an error (DeepSpeed asserts).
_DEPRECATED_OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}

_NO_EFFECT_OFFLOAD_OPTIMIZER: dict[str, _Check] = {
    "convert_grad_on_cpu": _bool, "cpuadam_cores_perc": _fraction,
}
_DEFAULT_ONLY_OFFLOAD_OPTIMIZER: dict[str, Any] = {"ratio": 1.0, "super_offload": False}

_DEFAULT_ONLY_AIO: dict[str, Any] = {"use_gds": False}


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | InfinityConfig, *,
                world_size: int = 1) -> InfinityConfig:
    """Parse a DeepSpeed config (a dict, or the path of a JSON file) for `world_size` ranks.

    The dict is not modified. An `InfinityConfig` is returned as it is if it was built for the
    same world size.
    """
    world_size = _int(world_size, "world_size", minimum=1)
    if isinstance(config, InfinityConfig):
        if config.batch.world_size != world_size:
            raise ValueError(f"world_size: the config was built for world_size "
                             f"{config.batch.world_size}, got {world_size}")
        return config
    raw = _read(config)
    _reject_auto(raw)
    return _parse_root(raw, world_size)


def _read(config: Any) -> Any:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config: expected a dict or the path of a JSON file, "
                        f"got {type(config).__name__}")
    path = Path(config)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config: no such file: {path}") from None
    except UnicodeDecodeError as error:  # a binary file (a model's weights given as the config)
        raise ValueError(f"config: {path}: not a JSON file (byte {error.object[error.start]:#04x} at offset "
                         f"{error.start} is not UTF-8 text)") from None
    try:
        return json.loads(text, object_pairs_hook=_without_duplicates)
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"config: {path}: invalid JSON: {error}") from None


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _auto_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, str):
        return [path] if value == "auto" else []
    if isinstance(value, Mapping):
        return [found for key, item in value.items()
                for found in _auto_paths(item, _join(path, str(key)))]
    if isinstance(value, (list, tuple)):
        return [found for i, item in enumerate(value)
                for found in _auto_paths(item, f"{path}[{i}]")]
    return []


# "auto" that infinity resolves itself ([Note: host memory before the disk] in offload/placement.py).
_OWN_AUTO = frozenset({"zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.max_in_cpu"})


def _reject_auto(raw: Any) -> None:
    paths = [path for path in _auto_paths(raw, "") if path not in _OWN_AUTO]
    if paths:
        raise ValueError(
            f'{", ".join(paths)}: "auto" must be resolved before the config reaches infinity. '
            '"auto" is a trainer-integration convention (e.g. Hugging Face Trainer fills these '
            "in from its own arguments): let the integration resolve them and pass the resolved "
            "config, or write the values in")


def _take(raw: Any, path: str, accepted: tuple[str, ...], *,
          no_effect: Mapping[str, _Check] | None = None,
          default_only: Mapping[str, Any] | None = None,
          not_implemented: Mapping[str, str] | None = None,
          misplaced: Mapping[str, str] | None = None,
          required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The accepted keys of one JSON object; every other key is checked here and then dropped
    or refused (see [Note: which DeepSpeed keys are accepted])."""
    no_effect, default_only = no_effect or {}, default_only or {}
    not_implemented, misplaced = not_implemented or {}, misplaced or {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"{path or 'config'}: expected an object ({{...}}), got {_show(raw)}")
    taken: dict[str, Any] = {}
    for key, value in raw.items():
        key_path = _join(path, str(key))
        if not isinstance(key, str):
            raise TypeError(f"{key_path}: keys must be strings, got {key!r}")
        if key in accepted:
            taken[key] = value
        elif key in no_effect:
            no_effect[key](value, key_path)
        elif key in default_only:
            _require_default(value, key_path, default_only[key])
        elif key in not_implemented and isinstance(value, Mapping) and value.get("enabled", True) is False:
            continue  # a disabled feature is not an unimplemented one: {"amp": {"enabled": false}}
        elif key in not_implemented:
            hint = not_implemented[key]
            raise ValueError(f"{key_path}: {NOT_IMPLEMENTED}" + (f"; {hint}" if hint else ""))
        elif key in misplaced:
            raise ValueError(f"{key_path}: unknown key here; it belongs in {misplaced[key]} "
                             "(DeepSpeed silently ignores it here)")
        else:
            valid = (*accepted, *no_effect, *default_only)
            raise ValueError(_unknown_key_message(key, path, valid))
    for key in required:
        if key not in taken:
            raise ValueError(f"{_join(path, key)}: required key is missing")
    return taken


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or default is None:
        return value is default
    if isinstance(default, numbers.Real):
        return not isinstance(value, bool) and isinstance(value, numbers.Real) and value == default
    if isinstance(default, str):  # DeepSpeed upper-cases its mode names ("Warn", "WARN")
        return isinstance(value, str) and value.casefold() == default.casefold()
    return value == default


def _require_default(value: Any, path: str, default: Any) -> None:
    if not _is_default(value, default):
        raise ValueError(f"{path}: {NOT_IMPLEMENTED} except at DeepSpeed's default "
                         f"{json.dumps(default)}, got {_show(value)}")


def _unknown_key_message(key: str, section: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        return f"{_join(section, key)}: unknown key; did you mean {_join(section, close[0])}?"
    return f"{_join(section, key)}: unknown key; valid keys here: {', '.join(sorted(valid))}"


def _field_names(cls: type) -> tuple[str, ...]:
    """The JSON keys of a section: its fields, but those the engine resolves (`_RESOLVED`)."""
    return tuple(f.name for f in fields(cls) if f.name not in getattr(cls, "_RESOLVED", ()))


def _required_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls)
                 if f.default is MISSING and f.default_factory is MISSING)


def _parse_section(raw: Any, path: str, cls: type, **tables: Any) -> Any:
    """A section whose keys are exactly the fields of `cls`, plus the given key tables."""
    return cls(**_take(raw, path, _field_names(cls), required=_required_fields(cls), **tables))


def _parse_root(raw: Any, world_size: int) -> InfinityConfig:
    keys = _take(raw, "", (*_BATCH_KEYS, *_ROOT_SCALARS, *_ROOT_SECTIONS),
                 no_effect=_NO_EFFECT_ROOT, default_only=_DEFAULT_ONLY_ROOT,
                 not_implemented=_NOT_IMPLEMENTED_ROOT)
    bf16_key = "bfloat16" if "bfloat16" in keys and "bf16" not in keys else "bf16"
    if "bfloat16" in keys:  # DeepSpeed's legacy name; name the key as written
        if isinstance(keys["bfloat16"], Mapping):
            _bool(keys["bfloat16"].get("enabled", False), "bfloat16.enabled")
        legacy = _parse_section(keys["bfloat16"], "bfloat16", BF16Config, no_effect=_NO_EFFECT_BF16,
                                default_only=_DEFAULT_ONLY_BF16)
        # Both (accelerate adds a "bf16" section beside a user's "bfloat16"): DeepSpeed reads bf16
        # alone; accepted when they say the same, refused when the legacy one would be ignored.
        if "bf16" in keys and legacy != _parse_section(keys["bf16"], "bf16", BF16Config, no_effect=_NO_EFFECT_BF16,
                                                       default_only=_DEFAULT_ONLY_BF16):
            raise ValueError(f"bfloat16: DeepSpeed's legacy name for bf16, given beside bf16 with other settings "
                             f"(bfloat16: {keys['bfloat16']}, bf16: {keys['bf16']}); DeepSpeed would read bf16 "
                             "alone: give one of them")
    return InfinityConfig(
        batch=_parse_batch(keys, world_size),
        fp16=_parse_section(keys.get("fp16", {}), "fp16", FP16Config,
                            default_only=_DEFAULT_ONLY_FP16,
                            not_implemented=_NOT_IMPLEMENTED_FP16),
        bf16=_parse_section(keys.get(bf16_key, {}), bf16_key, BF16Config,
                            no_effect=_NO_EFFECT_BF16, default_only=_DEFAULT_ONLY_BF16),
        optimizer=_parse_optimizer(keys["optimizer"]) if "optimizer" in keys else None,
        scheduler=_parse_scheduler(keys["scheduler"]) if "scheduler" in keys else None,
        zero=_parse_zero(keys.get("zero_optimization", {})),
        aio=_parse_aio(keys["aio"]) if "aio" in keys else AIOConfig(tune=True),
        trace=_parse_section(keys.get("trace", {}), "trace", TraceConfig),
        checkpoint=_parse_section(keys.get("checkpoint", {}), "checkpoint", CheckpointConfig,
                                  no_effect=_NO_EFFECT_CHECKPOINT, default_only=_DEFAULT_ONLY_CHECKPOINT),
        data_types=_parse_section(keys.get("data_types", {}), "data_types", DataTypesConfig),
        chunked_loss=_parse_section(keys.get("chunked_loss", {}), "chunked_loss", ChunkedLossConfig),
        activation_checkpointing=(parse_activation_checkpointing(keys["activation_checkpointing"])
                                  if "activation_checkpointing" in keys else None),
        **{name: keys[name] for name in _ROOT_SCALARS if name in keys},
    )


def parse_activation_checkpointing(raw: Any) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` section alone (`infinity.checkpointing.configure` reads
    only it from a DeepSpeed config, as DeepSpeed's does); null is the defaults."""
    return _parse_section({} if raw is None else raw, ActivationCheckpointingConfig._PATH,
                          ActivationCheckpointingConfig)


def _parse_batch(keys: Mapping[str, Any], world_size: int) -> BatchConfig:
    """Derive the missing batch sizes as DeepSpeed's `_configure_train_batch_size` does."""
    given = {name: _int(keys[name], name, minimum=1) for name in _BATCH_KEYS if name in keys}
    train = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    accumulation = given.get("gradient_accumulation_steps")
    if train is None and micro is None:
        raise ValueError("train_batch_size, train_micro_batch_size_per_gpu: give at least one "
                         "(the other is derived from gradient_accumulation_steps and world size)")
    if train is None:
        accumulation = 1 if accumulation is None else accumulation
        train = micro * accumulation * world_size
    elif micro is None:
        accumulation = 1 if accumulation is None else accumulation
        _require_divisible(train, accumulation * world_size,
                           f"gradient_accumulation_steps {accumulation} * world_size {world_size}")
        micro = train // (accumulation * world_size)
    elif accumulation is None:
        _require_divisible(train, micro * world_size,
                           f"train_micro_batch_size_per_gpu {micro} * world_size {world_size}")
        accumulation = train // (micro * world_size)
    return BatchConfig(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                       gradient_accumulation_steps=accumulation, world_size=world_size)


def _require_divisible(train: int, divisor: int, divisor_text: str) -> None:
    if train % divisor:
        raise ValueError(f"train_batch_size: {train} is not a multiple of {divisor_text} "
                         f"(= {divisor})")


def _parse_optimizer(raw: Any) -> OptimizerConfig:
    keys = _take(raw, "optimizer", ("type", "params"), default_only=_DEFAULT_ONLY_OPTIMIZER,
                 misplaced={name: f"optimizer.params.{name}"
                            for cls in set(PARAMS_OF_TYPE.values()) for name in (*_field_names(cls), *_NO_EFFECT_ADAM)},
                 required=("type",))
    kind = _optimizer_type(keys["type"], "optimizer.type")  # canonical before its params are read
    params = _parse_section(keys.get("params", {}), "optimizer.params", PARAMS_OF_TYPE[kind],
                            no_effect=_NO_EFFECT_ADAM, default_only=_DEFAULT_ONLY_ADAM if kind in ("Adam", "AdamW")
                            else {"eps_inside_sqrt": False} if kind == "Lamb" else {"amsgrad": False},
                            not_implemented=_NOT_IMPLEMENTED_ADAM)
    return OptimizerConfig(type=kind, params=params)


def _parse_scheduler(raw: Any) -> SchedulerConfig:
    all_params = {name for cls in _SCHEDULER_PARAMS.values() for name in _field_names(cls)}
    keys = _take(raw, "scheduler", ("type", "params"),
                 misplaced={name: f"scheduler.params.{name}" for name in all_params},
                 required=("type",))
    kind = _scheduler_type(keys["type"], "scheduler.type")
    params = _parse_section(keys.get("params", {}), "scheduler.params", _SCHEDULER_PARAMS[kind])
    return SchedulerConfig(type=kind, params=params)


# DeepSpeed's ZeRO config takes each stage-3 key under its field name too (pydantic aliases:
# `param_persistence_threshold` is `stage3_param_persistence_threshold`), and reads the
# deprecated `stage3_gather_fp16_weights_on_model_save` as the 16-bit one.
_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
}


def _with_zero_names(raw: Any, path: str) -> Any:
    """`raw` with DeepSpeed's other names of a key (`_ZERO_ALIASES`) replaced by ours; both
    names of one key is an error naming them."""
    if not isinstance(raw, Mapping) or not any(key in _ZERO_ALIASES for key in raw):
        return raw
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _ZERO_ALIASES.get(key, key)
        if name in out:
            others = [k for k in raw if _ZERO_ALIASES.get(k, k) == name]
            raise ValueError(f"{', '.join(_join(path, k) for k in others)}: one key under {len(others)} names; "
                             f"give it once, as {name}")
        out[name] = value
    return out


def _parse_zero(raw: Any) -> ZeroConfig:
    path = ZeroConfig._PATH
    raw = _with_zero_names(raw, path)
    keys = _take(raw, path, (*_field_names(ZeroConfig), *_DEPRECATED_OFFLOAD_SWITCHES), no_effect=_NO_EFFECT_ZERO,
                 default_only=_DEFAULT_ONLY_ZERO, not_implemented=_NOT_IMPLEMENTED_ZERO)
    for switch, section in _DEPRECATED_OFFLOAD_SWITCHES.items():
        if switch in keys:
            on = _bool(keys.pop(switch), _join(path, switch))
            if section in keys:
                raise ValueError(f"{_join(path, switch)}, {_join(path, section)}: DeepSpeed's deprecated switch and "
                                 f"the section that replaces it; give only {section}")
            keys[section] = {"device": "cpu"} if on else None
    # DeepSpeed takes null for "no offload".
    offload_param = keys.get("offload_param")
    keys["offload_param"] = _parse_section(
        {} if offload_param is None else offload_param, OffloadParamConfig._PATH,
        OffloadParamConfig)
    offload_optimizer = keys.get("offload_optimizer")
    keys["offload_optimizer"] = _parse_section(
        {} if offload_optimizer is None else offload_optimizer, OffloadOptimizerConfig._PATH,
        OffloadOptimizerConfig,
        no_effect=_NO_EFFECT_OFFLOAD_OPTIMIZER, default_only=_DEFAULT_ONLY_OFFLOAD_OPTIMIZER)
    return ZeroConfig(**keys)


def _parse_aio(raw: Any) -> AIOConfig:
    json_keys = tuple(name for name in _field_names(AIOConfig) if name != "tune")  # tune: absent or given
    keys = _take(raw, "aio", (*json_keys, "intra_op_parallelism"),
                 default_only=_DEFAULT_ONLY_AIO)
    if "intra_op_parallelism" in keys:
        threads = _int(keys.pop("intra_op_parallelism"), "aio.intra_op_parallelism", minimum=1)
        count = _int(keys.get("thread_count", threads), "aio.thread_count", minimum=1)
        if count != threads:
            raise ValueError(
                f"aio.intra_op_parallelism, aio.thread_count: two names for the same setting "
                f"with different values ({threads} and {count}); give one")
        keys["thread_count"] = threads
    return AIOConfig(**keys)
