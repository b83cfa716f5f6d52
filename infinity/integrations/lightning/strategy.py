"""Lightning on infinity: `InfinityStrategy` for the Trainer and `InfinityFabricStrategy` for
Fabric, taking `DeepSpeedStrategy`'s arguments, on the CPU accelerator as on CUDA, and
`convert_zero_checkpoint_to_fp32_state_dict` for a single-file checkpoint
(`pip install "infinity[lightning]"`).

    import infinity.integrations.lightning.strategy  # registers the names below with Lightning
    trainer = Trainer(strategy="infinity_stage_3_offload", precision="bf16-mixed")
    trainer = Trainer(strategy=InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                                remote_device="nvme", offload_params_device="nvme",
                                                offload_optimizer_device="nvme", nvme_path="/local_nvme"))

Registered names (Trainer and Fabric): `infinity` (ZeRO stage 2, as `deepspeed` is),
`infinity_stage_1`, `infinity_stage_2`, `infinity_stage_2_offload`, `infinity_stage_3`,
`infinity_stage_3_offload`, `infinity_stage_3_offload_nvme`.

The pieces, one module each beside this one: config.py (the arguments as a DeepSpeed config, and
the names' presets), trainer.py (`InfinityStrategy`; [Note: the engine behind a Trainer] and
[Note: Lightning checkpoints in infinity's format] are there), fabric.py
(`InfinityFabricStrategy`), precision.py (`InfinityPrecision`, `InfinityFabricPrecision`) and
checkpoints.py (`convert_zero_checkpoint_to_fp32_state_dict`). `infinity.lightning` is this
module.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("lightning") is None:
    raise ModuleNotFoundError('infinity.integrations.lightning.strategy needs Lightning: pip install "infinity[lightning]"')

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from infinity.integrations.lightning.checkpoints import convert_zero_checkpoint_to_fp32_state_dict
from infinity.integrations.lightning.config import FP16_OPTIONS, OPTIONS, deepspeed_config
from infinity.integrations.lightning.fabric import InfinityFabricStrategy
from infinity.integrations.lightning.precision import PRECISIONS, InfinityFabricPrecision, InfinityPrecision
from infinity.integrations.lightning.trainer import InfinityStrategy

__all__ = ["InfinityFabricStrategy", "InfinityPrecision", "InfinityStrategy",
           "convert_zero_checkpoint_to_fp32_state_dict", "deepspeed_config",
           # public names of this module before its pieces moved out, importable from here still
           "FP16_OPTIONS", "InfinityFabricPrecision", "OPTIONS", "PRECISIONS"]

InfinityStrategy.register_strategies(StrategyRegistry)
InfinityFabricStrategy.register_strategies(FABRIC_REGISTRY)
