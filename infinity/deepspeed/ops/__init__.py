"""`deepspeed.ops`: the Adam optimizers and the aio handle (infinity.optim, infinity.io)."""

from infinity.deepspeed.ops import adam, aio, op_builder

__all__ = ["adam", "aio", "op_builder"]
