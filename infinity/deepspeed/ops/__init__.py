"""`deepspeed.ops`: the CPU optimizers and the aio handle (infinity.optim, infinity.io)."""

from infinity.deepspeed.ops import adagrad, adam, aio, lamb, lion, op_builder

__all__ = ["adagrad", "adam", "aio", "lamb", "lion", "op_builder"]
