"""The optimizer object users and LR schedulers see.

It is a real `torch.optim.Optimizer` over the model's parameters, so torch and DeepSpeed LR
schedulers can read and set `param_groups[i]["lr"]`; the update itself runs over unit shards in
the engine's optimizer tier (`engine.step()`), reading its hyper-parameters from these groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from infinity.optim.rules import AdagradRule, AdamRule, LambRule, LionRule, rule_for_optimizer


def _from_user_optimizer(optimizer: torch.optim.Optimizer) -> tuple[list[dict], dict]:
    name = type(optimizer).__name__
    defaults = dict(optimizer.defaults)
    if name in ("AdamW", "CPUAdam", "DeepSpeedCPUAdam", "FusedAdam"):
        defaults["adamw_mode"] = bool(getattr(optimizer, "adamw_mode", defaults.get("adamw_mode", name == "AdamW")))
    elif name == "Adam":
        defaults["adamw_mode"] = bool(defaults.get("decoupled_weight_decay", False))
    # The user's own group dicts: a scheduler built on that optimizer sets the lr we read.
    return list(optimizer.param_groups), defaults


def _config_defaults(config: Any) -> dict:
    """The param-group defaults of the optimizer a config's `optimizer` section names."""
    p = config.params
    if config.type == "Adagrad":
        return {"lr": p.lr, "eps": p.eps, "weight_decay": p.weight_decay, "lr_decay": p.lr_decay,
                "initial_accumulator_value": p.initial_accumulator_value}
    if config.type == "Lion":
        return {"lr": p.lr, "betas": tuple(p.betas), "weight_decay": p.weight_decay}
    if config.type == "Lamb":
        return {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay,
                "bias_correction": p.bias_correction, "max_coeff": p.max_coeff, "min_coeff": p.min_coeff}
    return {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay,
            "adamw_mode": config.decoupled_weight_decay, "bias_correction": True}


def _config_rule(config: Any):
    fmt = config.params.moment_format
    if config.type == "Adagrad":
        return AdagradRule(fmt=fmt, initial_accumulator_value=config.params.initial_accumulator_value)
    if config.type == "Lion":
        return LionRule(fmt=fmt)
    if config.type == "Lamb":
        return LambRule(fmt=fmt)
    return AdamRule(fmt=fmt)


class ZeroOptimizer(torch.optim.Optimizer):
    """Param groups and hyper-parameters of the sharded update, and the rule that runs it
    ([Note: update rules] in infinity/optim/rules.py)."""

    def __init__(self, groups: list[dict], config: Any, user_optimizer: torch.optim.Optimizer | None):
        if user_optimizer is not None:
            groups, defaults = _from_user_optimizer(user_optimizer)
            self.rule = rule_for_optimizer(user_optimizer)  # [Note: update rules] in infinity/optim/rules.py
            if getattr(self.rule, "name", "") == "Adam":
                defaults.setdefault("bias_correction", True)
        elif config is not None:
            defaults = _config_defaults(config)
            self.rule = _config_rule(config)
        else:  # an engine for inference: every parameter frozen, nothing to update
            defaults = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True,
                        "bias_correction": True}
            groups = groups or [{"params": []}]  # torch refuses an optimizer without a group
            self.rule = AdamRule()
        super().__init__(groups, defaults)
        self.step_count = 0
        self._user_optimizer = user_optimizer  # its schedulers step our (shared) groups
        self._shards = None  # the engine's optimizer tier and units, for state_dict()
        self._run_pending: Callable[[], None] = lambda: None  # until bound: nothing waits

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The client optimizer given to `initialize` (DeepSpeed's ZeRO optimizers expose the
        optimizer they wrap as `.optimizer`, and integrations read it): its param groups are this
        optimizer's, so its lr is the one the update reads. A config-built optimizer wraps none
        (the engine runs its update rule over the shards itself), and then this is an
        AttributeError, as for any object without the attribute."""
        if self._user_optimizer is None:
            raise AttributeError("optimizer: this engine's optimizer was built from the config's optimizer section "
                                 "and wraps no torch optimizer (the update runs over the shards in engine.step()); "
                                 "its param groups are engine.optimizer.param_groups")
        return self._user_optimizer

    def bind(self, tier, units, set_params, run_pending: Callable[[], None]) -> None:
        """The optimizer tier (infinity.offload.protocols.OptimizerTier) holding the state of `units`,
        `set_params(unit, master)`, which makes a unit's compute-dtype values the masters', and
        `run_pending()`, which runs the updates that wait for their units' next use ([Note: a
        unit's update] in step_policy.py): the state is read and replaced after them."""
        self._shards = (tier, [u for u in units if u.trainable], set_params)
        self._run_pending = run_pending

    def state_dict(self) -> dict:
        """This rank's whole optimizer state in host memory: per unit, the fp32 master and the
        rule's moments of its shard (fp32), with the param groups and the step count (and a client
        optimizer's own `state_dict()` under "client"). For models whose state
        does not fit in memory use `engine.save_checkpoint`, which streams it to disk."""
        self._run_pending()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = {}
        if self._shards is not None:
            tier, units, _ = self._shards
            state = {u.name: {kind: tier.read(u, kind).clone() for kind in self.rule.kinds}
                     for u in units}
        out = {"state": state, "param_groups": groups, "step_count": self.step_count}
        if self.rule.client:
            out["client"] = self.rule.state_dict()
        return out

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
        if self.rule.client and state_dict.get("client") is not None:
            self.rule.load_state_dict(state_dict["client"])

    def hypers(self) -> list:
        """This step's hyper-parameters of each group, as the rule's kernel takes them."""
        return self.rule.hypers(self.param_groups)

    def step(self, closure=None):
        raise RuntimeError("the update of partitioned parameters runs in engine.step(); call that instead")

    def mark_stepped(self) -> None:
        """Tells torch LR schedulers an update happened (they warn otherwise)."""
        self._opt_called = True  # noqa: SLF001 (torch's own flag)
        if self._user_optimizer is not None:
            self._user_optimizer._opt_called = True  # noqa: SLF001
