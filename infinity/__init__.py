"""infinity: train models larger than GPU and CPU memory on one node (ZeRO-Infinity style).

The package's face: `initialize`, `Engine`, `Init`, `GatheredParameters`, `load_pretrained`, and
DeepSpeed's top-level names (`as_deepspeed`, `init_distributed`, `add_config_arguments`, and
`zero` / `utils` as attributes, so that `import infinity as deepspeed` reads as DeepSpeed). The
layout of the packages below is the README's Layout section.
"""

from infinity import utils, zero  # deepspeed.utils / deepspeed.zero after the import alone
from infinity.checkpoint.pretrained import load_pretrained
from infinity.deepspeed._alias import as_deepspeed
from infinity.deepspeed._compat import add_config_arguments, init_distributed
from infinity.engine import Engine
from infinity.engine.initialize import initialize
from infinity.zero.init import Init
from infinity.zero.registry import GatheredParameters

__version__ = "0.1.0"

__all__ = ["Engine", "GatheredParameters", "Init", "add_config_arguments", "as_deepspeed", "init_distributed",
           "initialize", "load_pretrained", "__version__"]
