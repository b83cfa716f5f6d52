"""`deepspeed.runtime.zero.partition_parameters`: `Init`, `GatheredParameters`, and
`ZeroParamStatus` with `param_status`, which reads a parameter's state from the unit infinity
keeps it in (TRL asks `param.ds_status`; infinity puts no attributes on parameters, so the
engine side answers it through `param_status`).

[Note: constructor wrappers]
DeepSpeed's `zero.Init` replaces torch's tensor constructors by wrappers that make floating
tensors in the config's dtype on the accelerator, from a factory transformers swaps to keep RoPE's
`torch.arange` in its own dtype (`prevent_arange_dtype_change`). infinity.Init patches no
constructor (it builds on the meta device), so nothing here calls the factory: it is defined
with DeepSpeed's meaning for code that swaps or calls it, and swapping it changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch

import infinity
from infinity.deepspeed.accelerator import get_accelerator
from infinity.zero.registry import owner_of
from infinity.zero.unit import UnitState

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "param_status",
           "zero_wrapper_for_fp_tensor_constructor"]

Init = infinity.Init


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's full values are there to use."""

    AVAILABLE = 1  # gathered: the full values are on the device (a unit between fetch and release)
    NOT_AVAILABLE = 2  # partitioned: only this rank's shard exists, in its tier
    INFLIGHT = 3  # being gathered (DeepSpeed's prefetch); infinity's units never report it


def param_status(param: torch.Tensor) -> ZeroParamStatus | None:
    """`param`'s status from its unit's state; NOT_AVAILABLE for a parameter built under
    `Init` and not yet materialised (meta); None for a parameter infinity does not partition
    (DeepSpeed's such parameters have no `ds_status`)."""
    owner = owner_of(param)
    if owner is None:
        return ZeroParamStatus.NOT_AVAILABLE if isinstance(param, torch.Tensor) and param.is_meta else None
    _, unit, _ = owner
    return ZeroParamStatus.AVAILABLE if unit.state is UnitState.GATHERED else ZeroParamStatus.NOT_AVAILABLE


def GatheredParameters(params: torch.nn.Parameter | Iterable[torch.nn.Parameter],  # noqa: N802 (DeepSpeed's name)
                       modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                       enabled: bool = True):
    """infinity.GatheredParameters under DeepSpeed's signature. `fwd_module` (DeepSpeed's way to
    register the parameters with another module's forward) must be None: infinity keeps no
    external parameters."""
    if fwd_module is not None:
        raise ValueError(f"fwd_module: not supported (infinity registers no external parameters with a module's "
                         f"forward), got {type(fwd_module).__name__}; pass None")
    return infinity.GatheredParameters(params, modifier_rank=modifier_rank, enabled=enabled)


_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., torch.Tensor]:
    """`fn` making its tensors on `target_device` (the accelerator's current device when None)
    unless given a device, floating ones in `target_fp_dtype` ([Note: constructor wrappers])."""
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or torch.device(get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped
