"""`deepspeed.moe`: infinity has no mixture-of-experts layers; `utils` answers for models without them."""

from infinity.deepspeed.moe import utils

__all__ = ["utils"]
