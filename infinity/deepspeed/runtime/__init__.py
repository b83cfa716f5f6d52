"""`deepspeed.runtime`: the engine, the config as DeepSpeed reads it, the LR schedules and ZeRO (`deepspeed.zero` is `runtime.zero`)."""

from infinity.deepspeed.runtime import config, constants, engine, lr_schedules, precision_config, zero

__all__ = ["config", "constants", "engine", "lr_schedules", "precision_config", "zero"]
