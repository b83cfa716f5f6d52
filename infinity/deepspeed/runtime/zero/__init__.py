"""`deepspeed.zero` / `deepspeed.runtime.zero`: infinity's `Init` and `GatheredParameters`
(DeepSpeed's signature), and `ZeroParamStatus`."""

from infinity.deepspeed.runtime.zero import partition_parameters
from infinity.deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters"]
