"""`deepspeed.checkpoint`: the helper accelerate saves state dicts with (`utils`)."""

from infinity.deepspeed.checkpoint import utils

__all__ = ["utils"]
