"""`deepspeed.runtime.config`: `DeepSpeedConfig`, a config as DeepSpeed's engine reads it, over
infinity's parser (the same checks and errors `initialize` gives: a key infinity does not
implement is an error naming it, not ignored), and `get_gradient_clipping`. Read-only: the
engine is built from the config by `initialize`, never from this object."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as torch_dist

from infinity.config import load_config
from infinity.deepspeed.runtime.constants import GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DeepSpeedConfig", "DeepSpeedConfigError",
           "LAMB_OPTIMIZER", "LION_OPTIMIZER", "get_gradient_clipping"]

# DeepSpeed's names of the optimizer types a config may give (infinity's parser takes any case)
ADAM_OPTIMIZER, ADAMW_OPTIMIZER, ADAGRAD_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER = (
    "adam", "adamw", "adagrad", "lamb", "lion")


class DeepSpeedConfigError(Exception):
    """DeepSpeed's config error type (infinity's parser raises ValueError / TypeError)."""


def get_gradient_clipping(param_dict: Mapping[str, Any]) -> float:
    """The config's `gradient_clipping`, 1.0 when absent (DeepSpeed 0.19.8's default)."""
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


def _read(config: Any) -> dict:
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a DeepSpeed config dict or a JSON file's path, got {type(config).__name__}")
    return dict(config)


class DeepSpeedConfig:
    """A DeepSpeed config parsed for this process's world (torch.distributed's, else 1), with
    DeepSpeed's attribute names: the batch sizes (the missing one derived), `zero_config` /
    `zero_optimization_stage` / `zero_enabled`, `gradient_clipping`, `fp16_enabled`,
    `bfloat16_enabled`, `optimizer_name` / `optimizer_params`, `scheduler_name` /
    `scheduler_params`, `steps_per_print`, `wall_clock_breakdown`, and `_param_dict`, the dict as
    given. `mpu` (model parallelism) is refused, as by `initialize`."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None):
        if mpu is not None or mesh_device is not None:
            raise NotImplementedError("mpu / mesh_device: model parallelism is not provided by infinity")
        self._param_dict = _read(config)
        self.world_size = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
        parsed = load_config(self._param_dict, world_size=self.world_size)
        self.infinity_config = parsed
        self.train_batch_size = parsed.batch.train_batch_size
        self.train_micro_batch_size_per_gpu = parsed.batch.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = parsed.batch.gradient_accumulation_steps
        self.zero_config = parsed.zero
        self.zero_optimization_stage = parsed.zero.stage
        self.zero_enabled = parsed.zero.stage > 0
        self.gradient_clipping = parsed.gradient_clipping
        self.fp16_enabled = parsed.fp16.enabled
        self.bfloat16_enabled = parsed.bf16.enabled
        self.steps_per_print = parsed.steps_per_print
        self.wall_clock_breakdown = parsed.wall_clock_breakdown
        optimizer = self._param_dict.get("optimizer")
        self.optimizer_name = optimizer["type"].lower() if optimizer else None
        self.optimizer_params = optimizer.get("params") if optimizer else None
        scheduler = self._param_dict.get("scheduler")
        self.scheduler_name = scheduler["type"] if scheduler else None
        self.scheduler_params = scheduler.get("params") if scheduler else None

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._param_dict!r})"
