"""What `import deepspeed` gives where the alias is on ([Note: the deepspeed alias] in
infinity.alias): infinity behind DeepSpeed's names and module paths.

Each submodule is a thin adapter over infinity (the engine never imports them): `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine` (infinity.Engine), `zero`
(`Init`, `GatheredParameters`, `ZeroParamStatus`), `comm` (torch.distributed),
`accelerator.get_accelerator()` (infinity's device choice), `runtime.lr_schedules`,
`ops.adam` (`DeepSpeedCPUAdam`, `FusedAdam`), `ops.aio`, `utils` (the `safe_get_full_*`
helpers, `logger`), `checkpoint.utils`, `moe.utils`, `checkpointing` (activation checkpointing).
What DeepSpeed has and this package does not is missing here too (an ImportError or
AttributeError), never a stand-in that does nothing.

`python -m infinity.deepspeed SCRIPT ARGS...` runs a script with the alias on (__main__.py).
"""

import infinity
from infinity.alias import DEEPSPEED_VERSION
from infinity.deepspeed import checkpoint, checkpointing, comm, moe, ops, runtime, utils
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.runtime import zero
from infinity.deepspeed.utils import log_dist, logger

__version__ = DEEPSPEED_VERSION
version = DEEPSPEED_VERSION
# DeepSpeed's build records its git commit and branch here; infinity's alias was built from none.
__git_hash__ = None
__git_branch__ = None
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in DEEPSPEED_VERSION.split("."))

DeepSpeedEngine = infinity.Engine


def initialize(*args, **kwargs):
    """infinity.initialize, whose partitioned parameters then answer DeepSpeed's attributes
    (`ds_status`, `ds_numel`, ...: [Note: DeepSpeed's parameter attributes] in
    deepspeed.runtime.zero.partition_parameters)."""
    engine, optimizer, loader, scheduler = infinity.initialize(*args, **kwargs)
    zero.partition_parameters.mark_partitioned(engine.module)
    return engine, optimizer, loader, scheduler


init_distributed = infinity.init_distributed
add_config_arguments = infinity.add_config_arguments

__all__ = ["DeepSpeedEngine", "__version__", "add_config_arguments", "checkpoint", "checkpointing", "comm",
           "get_accelerator", "init_distributed", "initialize", "log_dist", "logger", "moe", "ops", "runtime", "utils",
           "version", "zero"]
