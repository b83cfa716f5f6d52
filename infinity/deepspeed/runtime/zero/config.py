"""`deepspeed.runtime.zero.config`: the `zero_optimization` section as infinity parses it.
`DeepSpeedZeroConfig(**section)` returns infinity's `ZeroConfig` (its field names are the JSON
keys, `stage3_*` included; DeepSpeed's pydantic model also answers to shortened names and
deprecated keys, which infinity's parser refuses by name); the offload sections' classes are
infinity's `OffloadParamConfig` and `OffloadOptimizerConfig`."""

from __future__ import annotations

from typing import Any

from infinity.config import load_config
from infinity.config.zero_sections import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig"]

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


def DeepSpeedZeroConfig(**section: Any) -> ZeroConfig:  # noqa: N802 (DeepSpeed's class name)
    """The `zero_optimization` section `section`, parsed and checked as `initialize` does."""
    return load_config({"train_batch_size": 1, "zero_optimization": section}).zero
