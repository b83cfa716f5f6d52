"""`infinity.utils` (DeepSpeed's `deepspeed.utils.safe_get_full_*`): a public name of
infinity/deepspeed/utils/full_values.py, the very same module object."""

import sys

from infinity.deepspeed.utils import full_values as _module

sys.modules[__name__] = _module
