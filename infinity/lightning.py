"""`infinity.lightning` (`InfinityStrategy`, `InfinityFabricStrategy`, ...): a public name of
infinity/integrations/lightning/strategy.py, the very same module object."""

import sys

from infinity.integrations.lightning import strategy as _module

sys.modules[__name__] = _module
