"""`deepspeed.runtime.precision_config`: `get_bfloat16_config(param_dict)`, the config's bf16
section (or its legacy name `bfloat16`) as infinity parses it (`.enabled`, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infinity.config import load_config
from infinity.config import BF16Config

__all__ = ["get_bfloat16_config"]


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    sections = {k: param_dict[k] for k in ("bf16", "bfloat16") if k in param_dict}
    return load_config({"train_batch_size": 1, **sections}).bf16
