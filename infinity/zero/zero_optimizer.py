"""The optimizer object users and LR schedulers see.

It is a real `torch.optim.Optimizer` over the model's parameters, so torch and DeepSpeed LR
schedulers can read and set `param_groups[i]["lr"]`; the update itself runs over unit shards in
the engine's optimizer tier (`engine.step()`), reading its hyper-parameters from these groups.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity.optim.functional import AdamHyper


def _from_user_optimizer(optimizer: torch.optim.Optimizer) -> tuple[list[dict], dict]:
    name = type(optimizer).__name__
    if name in ("AdamW", "CPUAdam", "DeepSpeedCPUAdam", "FusedAdam"):
        adamw = bool(getattr(optimizer, "adamw_mode", optimizer.defaults.get("adamw_mode", name == "AdamW")))
    elif name == "Adam":
        adamw = False
    else:
        raise TypeError(f"optimizer: infinity runs Adam or AdamW over its shards, got {name}")
    if optimizer.defaults.get("amsgrad"):
        raise ValueError("optimizer: amsgrad=True is not supported")
    groups = [dict(g) for g in optimizer.param_groups]
    defaults = dict(optimizer.defaults, adamw_mode=adamw)
    return groups, defaults


class ZeroOptimizer(torch.optim.Optimizer):
    """Param groups and hyper-parameters of the sharded Adam/AdamW update."""

    def __init__(self, groups: list[dict], config: Any, user_optimizer: torch.optim.Optimizer | None):
        if user_optimizer is not None:
            groups, defaults = _from_user_optimizer(user_optimizer)
        elif config is not None:
            p = config.params
            defaults = {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay,
                        "adamw_mode": config.decoupled_weight_decay, "bias_correction": True}
        else:
            raise ValueError("optimizer: the config has no 'optimizer' section and no optimizer was passed "
                             "to initialize(); give one of them")
        defaults.setdefault("bias_correction", True)
        super().__init__(groups, defaults)
        self.step_count = 0

    def hypers(self) -> list[AdamHyper]:
        out = []
        for g in self.param_groups:
            b1, b2 = g["betas"]
            out.append(AdamHyper(float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]),
                                 bool(g["adamw_mode"]), bool(g["bias_correction"])))
        return out

    def step(self, closure=None):
        raise RuntimeError("the update of partitioned parameters runs in engine.step(); call that instead")

    def mark_stepped(self) -> None:
        """Tells torch LR schedulers an update happened (they warn otherwise)."""
        self._opt_called = True  # noqa: SLF001 (torch's own flag)
