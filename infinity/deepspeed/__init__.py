"""What `import deepspeed` gives where the alias is on ([Note: the deepspeed alias] in
infinity.deepspeed._alias): infinity behind DeepSpeed's names and module paths.

This package is also the one home of infinity's DeepSpeed-named surfaces: the alias itself
(`_alias.py`), `init_distributed` and `add_config_arguments` (`_compat.py`), the `safe_get_full_*`
helpers (`utils/full_values.py`) and activation checkpointing (`checkpointing.py`, over the
activation tier in infinity/offload/activations.py). The engine never imports it: `import
infinity` loads `_alias` and `_compat` alone, and the rest on first use ([Note: a light package
face] below).

Each submodule is a thin adapter over infinity (the engine never imports them): `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine` (infinity.Engine), `zero`
(`Init`, `GatheredParameters`, `ZeroParamStatus`), `comm` (torch.distributed),
`accelerator.get_accelerator()` (infinity's device choice), `runtime.lr_schedules`,
`runtime.config` (`DeepSpeedConfig`, read-only, over infinity's parser), `runtime.zero.config`,
`ops.adam` (`DeepSpeedCPUAdam`, `FusedAdam`), `ops.aio`, `ops.op_builder` (the builders of the
ops infinity compiles), `git_version_info`, `utils` (the `safe_get_full_*` helpers, `logger`),
`checkpoint.utils`, `moe.utils`, `checkpointing` (activation checkpointing).
What DeepSpeed has and this package does not is missing here too (an ImportError or
AttributeError), never a stand-in that does nothing.

`python -m infinity.deepspeed SCRIPT ARGS...` runs a script with the alias on (__main__.py).

[Note: a light package face]
`import infinity` needs `as_deepspeed` (in `_alias`) and `init_distributed` (in `_compat`),
whose modules sit in this package, so importing them runs this file while `infinity` itself is
still being imported. So this file imports nothing of infinity's at the top: the version comes
from `_alias` (standard library only), and every other name is loaded by `__getattr__` on first
use (`deepspeed.zero`, `from deepspeed import comm`, `deepspeed.initialize`), by which time
`infinity` is whole.
"""

import importlib

from infinity.deepspeed._alias import DEEPSPEED_VERSION

__version__ = DEEPSPEED_VERSION
version = DEEPSPEED_VERSION
# DeepSpeed's build records its git commit and branch here; infinity's alias was built from none.
__git_hash__ = None
__git_branch__ = None
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in DEEPSPEED_VERSION.split("."))

_SUBMODULES = ("checkpoint", "checkpointing", "comm", "moe", "ops", "runtime", "utils", "accelerator",
               "git_version_info")
_NAMES = {"get_accelerator": ("infinity.deepspeed.accelerator", "get_accelerator"),
          "zero": ("infinity.deepspeed.runtime", "zero"),
          "log_dist": ("infinity.deepspeed.utils", "log_dist"), "logger": ("infinity.deepspeed.utils", "logger"),
          "DeepSpeedEngine": ("infinity.engine", "Engine"),
          "DeepSpeedConfig": ("infinity.deepspeed.runtime.config", "DeepSpeedConfig"),
          "DeepSpeedConfigError": ("infinity.deepspeed.runtime.config", "DeepSpeedConfigError"),
          "init_distributed": ("infinity.deepspeed._compat", "init_distributed"),
          "add_config_arguments": ("infinity.deepspeed._compat", "add_config_arguments")}


def initialize(*args, **kwargs):
    """infinity.initialize, whose partitioned parameters then answer DeepSpeed's attributes
    (`ds_status`, `ds_numel`, ...: [Note: DeepSpeed's parameter attributes] in
    deepspeed.runtime.zero.partition_parameters)."""
    from infinity.deepspeed.runtime.zero import partition_parameters
    from infinity.engine.initialize import initialize as infinity_initialize

    engine, optimizer, loader, scheduler = infinity_initialize(*args, **kwargs)
    partition_parameters.mark_partitioned(engine.module)
    return engine, optimizer, loader, scheduler


def __getattr__(name: str):
    """[Note: a light package face]: submodules and names loaded on first use."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"infinity.deepspeed.{name}")
    elif name in _NAMES:
        module, attr = _NAMES[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES) | set(_NAMES))


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "__version__", "add_config_arguments", "checkpoint", "checkpointing", "comm",
           "get_accelerator", "init_distributed", "initialize", "log_dist", "logger", "moe", "ops", "runtime", "utils",
           "version", "zero"]
