"""`deepspeed.ops`: the CPU optimizers and the aio handle (infinity.optim, infinity.io)."""

from infinity.deepspeed.ops import adagrad, adam, aio, lamb, lion, op_builder

# DeepSpeed's tables of its ops: built at install (all of infinity's are) and usable here
__compatible_ops__ = op_builder.compatible_ops()
__installed_ops__ = dict(__compatible_ops__)

__all__ = ["__compatible_ops__", "__installed_ops__", "adagrad", "adam", "aio", "lamb", "lion", "op_builder"]
