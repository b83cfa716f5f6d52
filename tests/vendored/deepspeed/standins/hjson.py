"""Stand-in for the hjson package, which DeepSpeed's test_ds_config_dict.py imports to write a
config file: `dump`/`dumps`/`load`/`loads` as JSON (not a dependency of infinity)."""

from __future__ import annotations

import json

dump, dumps, load, loads = json.dump, json.dumps, json.load, json.loads
