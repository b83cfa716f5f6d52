"""`deepspeed.moe.utils`, for scripts that import it unconditionally (DeepSpeedExamples' CIFAR-10
does) and use it on models without experts: infinity has no mixture-of-experts layers, so a
parameter marked as an expert's is an error."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert's parameter carries `allreduce = False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: dict | tuple | list,
                                                         max_group_size: int | float = 178956971) -> list[dict]:
    """The param groups as a list of dicts with list params: without experts there is nothing
    to split, as in DeepSpeed."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, (list, tuple)):
        raise ValueError(f"param_groups: expected a dict or a list of dicts, got {type(param_groups).__name__}")
    groups: list[dict[str, Any]] = [dict(g, params=list(g["params"])) for g in param_groups]
    for g in groups:
        if any(is_moe_param(p) for p in g["params"]):
            raise ValueError("param_groups: holds expert parameters (allreduce=False), and infinity has no "
                             "mixture-of-experts support")
    return groups
