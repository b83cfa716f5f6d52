"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is infinity.Engine (isinstance checks and
`unwrap_model` in accelerate and transformers see the engine `initialize` returns)."""

import infinity

DeepSpeedEngine = infinity.Engine

__all__ = ["DeepSpeedEngine"]
