"""`deepspeed.runtime.zero.stage3`: `DeepSpeedZeroOptimizer_Stage3` is infinity's ZeroOptimizer,
the engine's optimizer at every ZeRO stage (`engine.optimizer`)."""

from infinity.zero.zero_optimizer import ZeroOptimizer as DeepSpeedZeroOptimizer_Stage3

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
