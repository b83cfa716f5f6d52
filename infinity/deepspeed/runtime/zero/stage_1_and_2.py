"""`deepspeed.runtime.zero.stage_1_and_2`: `DeepSpeedZeroOptimizer` is infinity's ZeroOptimizer,
the engine's optimizer at every ZeRO stage (`engine.optimizer`)."""

from infinity.zero.zero_optimizer import ZeroOptimizer as DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
