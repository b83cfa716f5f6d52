"""infinity: train models larger than GPU and CPU memory on one node (ZeRO-Infinity style)."""

from infinity import utils, zero  # deepspeed.utils / deepspeed.zero after the import alone
from infinity.alias import as_deepspeed
from infinity.checkpoint.pretrained import load_pretrained
from infinity.compat import add_config_arguments, init_distributed
from infinity.engine import Engine
from infinity.entry import initialize
from infinity.zero.init import Init
from infinity.zero.registry import GatheredParameters

__version__ = "0.1.0"

__all__ = ["Engine", "GatheredParameters", "Init", "add_config_arguments", "as_deepspeed", "init_distributed",
           "initialize", "load_pretrained", "__version__"]
