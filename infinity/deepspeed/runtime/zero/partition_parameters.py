"""`deepspeed.runtime.zero.partition_parameters`: `Init`, `GatheredParameters`, and
`ZeroParamStatus` with `param_status`, which reads a parameter's state from the unit infinity
keeps it in.

[Note: DeepSpeed's parameter attributes]
Frameworks read DeepSpeed's attributes on a partitioned parameter: TRL `param.ds_status` (gather
it unless AVAILABLE), transformers and peft `ds_numel` / `ds_shape` (a released parameter has 0
elements). infinity sets no attributes on parameters: `deepspeed.initialize` gives each
parameter the engine partitions the class `PartitionedParameter`, an nn.Parameter whose
`ds_status`, `ds_id`, `ds_numel` and `ds_shape` are properties read from the unit that holds it,
so they cannot go stale. Only in processes where `deepspeed` means infinity; `infinity.initialize`
leaves the class alone.

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
from infinity.zero import dist as zdist
from infinity.zero.registry import owner_of
from infinity.zero.unit import UnitState

__all__ = ["GatheredParameters", "Init", "PartitionedParameter", "ZeroParamStatus", "get_accelerator",
           "mark_partitioned", "param_status", "zero_wrapper_for_fp_tensor_constructor"]



class Init(infinity.Init):
    """infinity.Init ([Note: deferred initialisation] in infinity/zero/init.py) that first
    creates the process group, as DeepSpeed's does: transformers' ZeRO-3 loading, which builds
    the model under it, calls torch.distributed.get_rank() next."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.enabled:
            zdist.init_distributed(nccl=get_accelerator().communication_backend_name() == "nccl")


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


class PartitionedParameter(torch.nn.Parameter):
    """A parameter an engine partitions, with DeepSpeed's attributes read from its unit
    ([Note: DeepSpeed's parameter attributes])."""

    @property
    def ds_status(self) -> ZeroParamStatus | None:
        return param_status(self)

    @property
    def ds_numel(self) -> int:
        return self._slot().numel

    @property
    def ds_shape(self) -> torch.Size:
        return self._slot().shape

    @property
    def ds_id(self) -> int:
        """The parameter's place among its engine's, in unit order (stable for the engine's life)."""
        _, unit, slot = self._owner()
        return unit.index * _IDS_PER_UNIT + next(i for i, s in enumerate(unit.slots) if s is slot)

    def _owner(self):
        owner = owner_of(self)
        if owner is None:
            raise AttributeError("this parameter is not partitioned by a live infinity engine")
        return owner

    def _slot(self):
        return self._owner()[2]


_IDS_PER_UNIT = 1 << 20


def mark_partitioned(model: torch.nn.Module) -> None:
    """Gives the parameters an engine partitions DeepSpeed's attributes ([Note: DeepSpeed's
    parameter attributes]); the others keep their class."""
    for p in model.parameters():
        if owner_of(p) is not None and type(p) is torch.nn.Parameter:
            p.__class__ = PartitionedParameter


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
