"""ZeRO stage 3 over units: partitioning, hooks, the fetcher, and the parameter and optimizer tiers."""

from infinity.zero.init import Init  # noqa: E402 (DeepSpeed's spelling: infinity.zero.Init)
from infinity.zero.registry import GatheredParameters  # noqa: E402

__all__ = ["GatheredParameters", "Init"]
