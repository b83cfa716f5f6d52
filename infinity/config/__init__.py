"""DeepSpeed's JSON configuration, parsed into small frozen dataclasses.

A user moves a DeepSpeed ZeRO-Infinity job over by changing the import, so `load_config` reads
DeepSpeed's JSON schema with DeepSpeed's key names, defaults and meanings. Each JSON section
becomes one frozen dataclass that validates itself on construction, and a component receives
only its own section: the CPU optimizer gets `OptimizerConfig`, the NVMe tier
`OffloadParamConfig` / `OffloadOptimizerConfig` and `AIOConfig`, the engine `BatchConfig`.

Modules, each importing only the ones before it: `_checks` (value checks and the field
machinery, [Note: error paths]); the dataclasses, by section: `optimizer_sections` (optimizer
and scheduler), `zero_sections` (zero_optimization and its offload sections), `sections` (the
rest and `InfinityConfig`); and `json_reader` (`load_config` and the key tables, [Note: which
DeepSpeed keys are accepted]). A DeepSpeed config key is changed in these files alone.
"""

from infinity.config.json_reader import NOT_IMPLEMENTED, load_config
from infinity.config.sections import (
    OFFLOAD_DEVICES,
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    WARMUP_TYPES,
    AIOConfig,
    AdamParams,
    BF16Config,
    BatchConfig,
    CheckpointConfig,
    ChunkedLossConfig,
    FP16Config,
    InfinityConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    TraceConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroConfig,
)

# The constants above are importable by name (lr_schedules uses WARMUP_TYPES) but, as before
# the split into a package, are not part of __all__.
__all__ = [
    "AIOConfig", "AdamParams", "BF16Config", "BatchConfig", "CheckpointConfig", "ChunkedLossConfig", "FP16Config", "InfinityConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig",
    "TraceConfig", "WarmupCosineLRParams", "WarmupDecayLRParams", "WarmupLRParams", "ZeroConfig", "load_config",
]
