"""DeepSpeedStrategy's arguments as a DeepSpeed config (`deepspeed_config`), the config a strategy
starts from (the user's, or the one its arguments write), what a precision adds to it, and the
strategy names registered with Lightning, each a preset of those arguments."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException


class ConfigFileNotFoundError(FileNotFoundError, MisconfigurationException):
    """A config path that names no file: a FileNotFoundError, and the MisconfigurationException
    Lightning's DeepSpeedStrategy raises for it."""


# DeepSpeedStrategy's arguments that write its DeepSpeed config, with their defaults (Lightning 2.6).
OPTIONS: dict[str, Any] = {
    "zero_optimization": True, "stage": 2, "offload_optimizer": False, "offload_parameters": False,
    "offload_params_device": "cpu", "offload_optimizer_device": "cpu", "nvme_path": "/local_nvme",
    "params_buffer_count": 5, "params_buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
    "optimizer_buffer_count": 4, "block_size": 1_048_576, "queue_depth": 8, "single_submit": False,
    "overlap_events": True, "thread_count": 1, "pin_memory": False, "sub_group_size": 1_000_000_000_000,
    "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True, "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000, "zero_allow_untested_optimizer": True,
    "logging_batch_size_per_gpu": "auto", "partition_activations": False, "cpu_checkpointing": False,
    "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
}
CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"  # DeepSpeedStrategy's: the config file when none is given
# Arguments read also when a config is given: the fp16 section they write when it has none.
FP16_OPTIONS: dict[str, Any] = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                                "hysteresis": 2, "min_loss_scale": 1}


def deepspeed_config(**options: Any) -> dict:
    """The DeepSpeed config `DeepSpeedStrategy` writes from its arguments (`OPTIONS`)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of DeepSpeedStrategy's config (expected one of "
                        f"{', '.join(OPTIONS)})")
    o = {**OPTIONS, **options}
    config: dict[str, Any] = {
        "activation_checkpointing": {k: o[k] for k in ("partition_activations", "cpu_checkpointing",
                                                       "contiguous_memory_optimization",
                                                       "synchronize_checkpoint_boundary")},
        "aio": {k: o[k] for k in ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")},
    }
    if o["zero_optimization"]:
        zero = {k: o[k] for k in ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions",
                                  "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")}
        if o["offload_optimizer"]:
            zero["offload_optimizer"] = {"device": o["offload_optimizer_device"], "nvme_path": o["nvme_path"],
                                         "buffer_count": o["optimizer_buffer_count"], "pin_memory": o["pin_memory"]}
        if o["offload_parameters"]:
            zero["offload_param"] = {"device": o["offload_params_device"], "nvme_path": o["nvme_path"],
                                     "buffer_count": o["params_buffer_count"], "buffer_size": o["params_buffer_size"],
                                     "max_in_cpu": o["max_in_cpu"], "pin_memory": o["pin_memory"]}
        config["zero_allow_untested_optimizer"] = o["zero_allow_untested_optimizer"]
        config["zero_optimization"] = zero
    if o["logging_batch_size_per_gpu"] != "auto":
        config["train_micro_batch_size_per_gpu"] = o["logging_batch_size_per_gpu"]
    return config


def _user_config(config: Any, options: dict) -> dict:
    """The config a strategy starts from: the user's (a dict, copied, or a JSON path; without one,
    the file PL_DEEPSPEED_CONFIG_PATH names, as DeepSpeedStrategy reads it), else the one its
    arguments write. With a config, the arguments that would write it are an error rather than
    ignored."""
    where = "config=..."
    if config is None and os.environ.get(CONFIG_ENV):
        config, where = os.environ[CONFIG_ENV], f"{CONFIG_ENV}={os.environ[CONFIG_ENV]}"
    if config is None:
        return deepspeed_config(**options)
    if options:
        raise ValueError(f"{sorted(options)[0]}: given with {where}; with a config every setting comes from it "
                         "(DeepSpeedStrategy ignores such arguments): set it in the config")
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise ConfigFileNotFoundError(f"{where.split('=')[0]}: You passed in a path to a DeepSpeed config but the "
                                          f"path does not exist: {config}")
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a DeepSpeed config dict or a JSON file's path, got {type(config).__name__}")
    return copy.deepcopy(config)


def _check_device_indices(devices: list[torch.device] | None) -> None:
    """Each process drives the accelerator its local rank names: a selection of CUDA devices
    other than 0..N-1 would put two ranks' tensors where neither expects them."""
    indices = [d.index for d in devices or () if d.type == "cuda"]
    if indices and indices != list(range(len(indices))):
        raise RuntimeError(f"devices: The selected device indices {indices!r} don't match the local rank values of "
                           "processes (each process drives the device its local rank names); to run on other "
                           f"GPUs, set CUDA_VISIBLE_DEVICES={','.join(map(str, indices))} instead")


def _split_options(kwargs: dict) -> tuple[dict, dict]:
    """(config-writing options, fp16 options) of a strategy's keyword arguments."""
    unknown = sorted(set(kwargs) - set(OPTIONS) - set(FP16_OPTIONS))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of InfinityStrategy (DeepSpeedStrategy's config arguments: "
                        f"{', '.join(OPTIONS)}; fp16: {', '.join(FP16_OPTIONS)})")
    return ({k: v for k, v in kwargs.items() if k in OPTIONS},
            {**FP16_OPTIONS, **{k: v for k, v in kwargs.items() if k in FP16_OPTIONS}})


def _add_precision(config: dict, precision: str, fp16: dict) -> None:
    """The fp16 or bf16 section a precision asks for, unless the config has its own (as Lightning)."""
    if precision in ("16-mixed", "16-true") and "fp16" not in config:
        config["fp16"] = {"enabled": True, **fp16}
    elif precision in ("bf16-mixed", "bf16-true") and "bf16" not in config:
        config["bf16"] = {"enabled": True}


def _config_dtype(config: dict) -> torch.dtype:
    """The dtype an engine of this config computes in."""
    enabled = lambda key: bool((config.get(key) or {}).get("enabled", False))  # noqa: E731
    if enabled("fp16"):
        return torch.float16
    return torch.bfloat16 if enabled("bf16") or enabled("bfloat16") else torch.float32


def _zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


_NVME = {"remote_device": "nvme", "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}
_NAMES: tuple[tuple[str, str, dict], ...] = (
    ("infinity", "infinity, ZeRO stage 2", {}),
    ("infinity_stage_1", "infinity, ZeRO stage 1", {"stage": 1}),
    ("infinity_stage_2", "infinity, ZeRO stage 2", {"stage": 2}),
    ("infinity_stage_2_offload", "infinity, ZeRO stage 2, optimizer on the CPU",
     {"stage": 2, "offload_optimizer": True}),
    ("infinity_stage_3", "infinity, ZeRO stage 3", {"stage": 3}),
    ("infinity_stage_3_offload", "infinity, ZeRO stage 3, parameters and optimizer on the CPU",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ("infinity_stage_3_offload_nvme", "infinity, ZeRO stage 3, parameters and optimizer on NVMe",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **_NVME}),
)


def _register(cls: type, strategy_registry: Any) -> None:
    """Registers a strategy class under each of the names (`_NAMES`), with its preset."""
    for name, description, init in _NAMES:
        strategy_registry.register(name, cls, description=description, override=True, **init)
