"""The optimizer object users and LR schedulers see.

It is a real `torch.optim.Optimizer` over the model's parameters, so torch and DeepSpeed LR
schedulers can read and set `param_groups[i]["lr"]`; the update itself runs over unit shards in
the engine's optimizer tier (`engine.step()`), reading its hyper-parameters from these groups.
"""

from __future__ import annotations

from collections.abc import Callable
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
    # The user's own group dicts: a scheduler built on that optimizer sets the lr we read.
    groups = list(optimizer.param_groups)
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
        else:  # an engine for inference: every parameter frozen, nothing to update
            defaults = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True}
            groups = groups or [{"params": []}]  # torch refuses an optimizer without a group
        defaults.setdefault("bias_correction", True)
        super().__init__(groups, defaults)
        self.step_count = 0
        self._user_optimizer = user_optimizer  # its schedulers step our (shared) groups
        self._shards = None  # the engine's optimizer tier and units, for state_dict()
        self._run_pending: Callable[[], None] = lambda: None  # until bound: nothing waits

    def bind(self, tier, units, set_params, run_pending: Callable[[], None]) -> None:
        """The optimizer tier (infinity.offload.protocols.OptimizerTier) holding the state of `units`,
        `set_params(unit, master)`, which makes a unit's compute-dtype values the masters', and
        `run_pending()`, which runs the updates that wait for their units' next use ([Note: a
        unit's update] in step_policy.py): the state is read and replaced after them."""
        self._shards = (tier, [u for u in units if u.trainable], set_params)
        self._run_pending = run_pending

    def state_dict(self) -> dict:
        """This rank's whole Adam state in host memory: per unit, the fp32 master, exp_avg and
        exp_avg_sq of its shard, with the param groups and the step count. For models whose state
        does not fit in memory use `engine.save_checkpoint`, which streams it to disk."""
        self._run_pending()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = {}
        if self._shards is not None:
            tier, units, _ = self._shards
            state = {u.name: {kind: tier.read(u, kind).clone() for kind in ("master", "exp_avg", "exp_avg_sq")}
                     for u in units}
        return {"state": state, "param_groups": groups, "step_count": self.step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of `state_dict()`, for the same model, world size and rank."""
        self._run_pending()
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict: has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        if self._shards is not None:
            tier, units, set_params = self._shards
            state = state_dict.get("state", {})
            for u in units:
                saved = state.get(u.name)
                if saved is None or saved["master"].numel() != u.train_shard_numel:
                    raise ValueError(f"state_dict: no state of this rank's shard of unit {u.name!r} (another model or "
                                     "world size?); engine.load_checkpoint re-shards checkpoints")
            for u in units:
                tier.write(u, state[u.name])
                set_params(u, state[u.name]["master"])
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)
        self.step_count = state_dict.get("step_count", self.step_count)

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
        if self._user_optimizer is not None:
            self._user_optimizer._opt_called = True  # noqa: SLF001
