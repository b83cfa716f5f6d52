"""`deepspeed.zero` / `deepspeed.runtime.zero`: infinity's `Init` and `GatheredParameters`
(DeepSpeed's signature), `ZeroParamStatus`, the `zero_optimization` section's parser (`config`)
and the engine's optimizer under DeepSpeed's class names (`stage3`, `stage_1_and_2`)."""

from infinity.deepspeed.runtime.zero import config, partition_parameters, stage3, stage_1_and_2
from infinity.deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "config", "partition_parameters", "stage3",
           "stage_1_and_2"]
