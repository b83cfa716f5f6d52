"""DeepSpeed's helpers for reading and setting one partitioned parameter's full values
(`deepspeed.utils.safe_get_full_fp32_param` and friends), under the same names.

Each gathers what it needs unit by unit from the shards, wherever they live (device, host
memory, NVMe); with several ranks, every rank must call it, as in DeepSpeed. A parameter that
infinity does not manage gives None. Frozen parameters ([Note: frozen parameters] in
zero/unit.py) have no fp32 master, gradient or optimizer state: those helpers give None for them.
"""

from __future__ import annotations

import torch

from infinity.zero.registry import owner_of

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _full(param: torch.nn.Parameter, kind: str) -> torch.Tensor | None:
    owner = owner_of(param)
    if owner is None:
        return None
    engine, unit, slot = owner
    full = engine.full_optimizer_values(unit, kind)
    if full is None or slot.group < 0:
        return None
    return unit.param_values(full, slot).clone()


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's full fp32 master (a CPU tensor of its shape)."""
    return _full(param, "master")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's full fp32 gradient, reduced over ranks (unscaled, divided by the
    accumulation steps as the loss was): valid between the backward that ends an accumulation
    and `engine.step()`, None outside it."""
    return _full(param, "grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's full Adam state: `optim_state_key` is "exp_avg" or "exp_avg_sq"."""
    if optim_state_key not in _STATE_KEYS:
        raise ValueError(f"optim_state_key: expected one of {', '.join(_STATE_KEYS)}, got {optim_state_key!r}")
    return _full(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Sets the parameter's full value (its fp32 master, and its compute-dtype shard); every
    rank passes the same value."""
    owner = owner_of(param)
    if owner is None:
        raise ValueError("param: not a parameter of a model wrapped by infinity.initialize")
    engine, unit, slot = owner
    if tuple(value.shape) != tuple(slot.shape):
        raise ValueError(f"value: expected shape {tuple(slot.shape)} for {slot.name}, got {tuple(value.shape)}")
    full = engine.full_fp32_values(unit)
    unit.param_values(full, slot).copy_(value.detach())
    engine.set_fp32_values(unit, full)
