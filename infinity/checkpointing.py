"""`infinity.checkpointing` (activation checkpointing, DeepSpeed's `deepspeed.checkpointing`): a
public name of infinity/deepspeed/checkpointing.py, the very same module object."""

import sys

from infinity.deepspeed import checkpointing as _module

sys.modules[__name__] = _module
