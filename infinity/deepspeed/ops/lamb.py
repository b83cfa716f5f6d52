"""`deepspeed.ops.lamb`: `FusedLamb` is infinity's CPULamb (infinity.optim), DeepSpeed's arguments;
given to `deepspeed.initialize` it is the engine's LAMB over the shards."""

from infinity.optim import FusedLamb

__all__ = ["FusedLamb"]
