"""The engine: one training step's owner (forward, backward, step over units), its lifecycle and
signals, the step's policy, the report, the faces it shows DeepSpeed's users (getters, the
module face) and `initialize`."""

from infinity.engine.engine import Engine

__all__ = ["Engine"]
