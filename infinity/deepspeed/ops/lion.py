"""`deepspeed.ops.lion`: `DeepSpeedCPULion` is infinity's (infinity.optim)."""

from infinity.optim import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
