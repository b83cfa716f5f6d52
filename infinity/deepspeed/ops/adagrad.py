"""`deepspeed.ops.adagrad`: `DeepSpeedCPUAdagrad` is infinity's (infinity.optim)."""

from infinity.optim import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
