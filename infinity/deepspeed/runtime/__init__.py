"""`deepspeed.runtime`: the engine, the LR schedules and ZeRO (`deepspeed.zero` is `runtime.zero`)."""

from infinity.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
