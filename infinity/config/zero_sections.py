"""The `zero_optimization` section: the ZeRO stage and where parameters and optimizer state are
offloaded (`offload_param`, `offload_optimizer`), with the checks that tie the two to the stage.

Like every section they validate themselves on construction (see sections.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from infinity.config._checks import (
    _bool,
    _check,
    _choice,
    _directory,
    _instance,
    _join,
    _optional,
    _path,
    _show,
    _size,
    _spec,
    _validate,
)

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _size_or_auto(value: Any, path: str) -> int | str:
    """A size (`_size`), or "auto": the engine derives it from the host's free memory."""
    return "auto" if value == "auto" else _size(value, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """Where parameter shards live between uses (`zero_optimization.offload_param`, stage 3)."""

    _PATH: ClassVar[str] = "zero_optimization.offload_param"

    device: str = _spec(_choice, OFFLOAD_DEVICES, default="none")
    """"none" (accelerator memory), "cpu" (host memory) or "nvme" (files under nvme_path)."""
    nvme_path: Path | None = _spec(_optional(_path), default=None)
    """Existing directory for the parameter files; required when device is "nvme"."""
    buffer_count: int = _spec(_size, default=5)
    """Host buffers in the pool that parameter shards are read into from NVMe."""
    buffer_size: int = _spec(_size, default=100_000_000)
    """Elements per host buffer (raised to the largest unit shard, with a warning)."""
    max_in_cpu: int | str = _spec(_size_or_auto, default=1_000_000_000)
    """Parameter elements kept cached in host memory when offloading to NVMe; "auto": as many as
    the host's free memory allows ([Note: host memory before the disk] in offload/placement.py)."""
    pin_memory: bool = _spec(_bool, default=True)
    """Page-lock the host buffers (pinned with a GPU, mlocked without): asynchronous device copies
    and faster O_DIRECT. false leaves them pageable."""

    def __post_init__(self) -> None:
        _validate(self)
        _check_nvme_path(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """Where optimizer state lives (`zero_optimization.offload_optimizer`); Adam runs on CPU."""

    _PATH: ClassVar[str] = "zero_optimization.offload_optimizer"
    _RESOLVED: ClassVar[tuple[str, ...]] = ("pool_elements",)  # set by the engine, never a JSON key

    device: str = _spec(_choice, OFFLOAD_DEVICES, default="none")
    """"none" (accelerator memory), "cpu" (host memory) or "nvme" (files under nvme_path)."""
    nvme_path: Path | None = _spec(_optional(_path), default=None)
    """Existing directory for the optimizer-state files; required when device is "nvme"."""
    buffer_count: int = _spec(_size, default=4)
    """Host buffers for optimizer state swapped from NVMe; at least the tensors per parameter."""
    pin_memory: bool = _spec(_bool, default=True)
    """Page-lock the host buffers (pinned with a GPU, mlocked without): asynchronous device copies
    and faster O_DIRECT. false leaves them pageable."""
    pipeline_read: bool = _spec(_bool, default=False)
    """Read the next sub-group's state from NVMe while the current one is updated."""
    pipeline_write: bool = _spec(_bool, default=False)
    """Write the previous sub-group's state to NVMe while the current one is updated."""
    fast_init: bool = _spec(_bool, default=False)
    """Skip the initial write-out of optimizer state when creating it on NVMe."""
    max_in_cpu: int | str = _spec(_size_or_auto, default=0)
    """(infinity) Optimizer-state elements (fp32 master, exp_avg, exp_avg_sq) kept in host memory
    with device "nvme", whole units at a time; the others' state lives on NVMe. "auto": as many as
    the host's free memory allows ([Note: host memory before the disk] in offload/placement.py)."""
    max_grad_in_cpu: int = _spec(_size, default=1_000_000_000)
    """(infinity) fp32 gradient elements kept in host memory with device "nvme" while they
    accumulate for the step; the gradients of the units beyond it spill to the NVMe store. Not
    needed when the update runs during backward on one micro-step (no clipping, no fp16)."""
    pool_elements: int | None = _spec(_optional(_size), default=None)
    """Not a JSON key: fp32 elements of host memory the NVMe tier's pool may take, which the
    placement plan sets when max_in_cpu "auto" resolves (the pool then holds in memory as much of
    the state as those bytes allow: [Note: host memory before the disk] in offload/placement.py).
    None: the pool's budget is buffer_count x sub_group_size."""

    def __post_init__(self) -> None:
        _validate(self)
        _check_nvme_path(self)

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write


def _check_nvme_path(config: OffloadParamConfig | OffloadOptimizerConfig) -> None:
    """With device "nvme", nvme_path is required and must be a directory; otherwise it is
    kept unused, as DeepSpeed does."""
    if config.device != "nvme":
        return
    if config.nvme_path is None:
        raise ValueError(f'{_join(config._PATH, "nvme_path")}: required when device is "nvme"')
    _check(config, "nvme_path", _directory)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """ZeRO partitioning and offload (section `zero_optimization`)."""

    _PATH: ClassVar[str] = "zero_optimization"

    stage: int = _spec(_choice, (0, 1, 2, 3), default=0)
    """0: no partitioning; 1: optimizer state; 2: + gradients; 3: + parameters."""
    offload_param: OffloadParamConfig = _spec(
        _instance, OffloadParamConfig, factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = _spec(
        _instance, OffloadOptimizerConfig, factory=OffloadOptimizerConfig)
    """Optimizer-state offload (stage 1 or more; NVMe with stage 3 only)."""
    stage3_prefetch_bucket_size: int = _spec(_size, default=50_000_000)
    """Parameter elements fetched ahead of use."""
    stage3_max_live_parameters: int = _spec(_size, default=1_000_000_000)
    """Gathered parameter elements allowed on the device before units are released."""
    stage3_max_reuse_distance: int = _spec(_size, default=1_000_000_000)
    """A unit needed again within this many parameter elements is kept rather than released."""
    stage3_param_persistence_threshold: int = _spec(_size, default=100_000)
    """Parameters of at most this many elements stay gathered on the device (0: none do)."""
    stage3_gather_16bit_weights_on_model_save: bool = _spec(_bool, default=False)
    """Gather full 16-bit weights when the model is saved."""
    sub_group_size: int = _spec(_size, default=1_000_000_000)
    """Parameter elements per optimizer sub-group (the tile of the pipelined CPU Adam step)."""
    reduce_bucket_size: int = _spec(_size, default=500_000_000)
    """Gradient elements reduced together."""
    overlap_comm: bool | None = _spec(_bool, default=None)
    """Overlap gradient reduction with backward; None (default) resolves to stage == 3."""
    contiguous_gradients: bool = _spec(_bool, default=True)
    """Copy gradients into one contiguous buffer as they are produced."""
    tile_size: int = _spec(_size, default=1 << 25)
    """Elements of a tile (infinity's own key): with stage 3, an nn.Linear / nn.Embedding weight
    larger than this is stored, moved and computed as row tiles of at most this size, each its
    own unit, so buffers are sized by the tile, not by a large vocabulary ([Note: memory-centric
    tiling] in infinity/zero/tiling.py); 0 tiles nothing."""

    def __post_init__(self) -> None:
        if self.overlap_comm is None:  # DeepSpeed's dynamic default
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        _validate(self)
        param, optimizer = self.offload_param.device, self.offload_optimizer.device
        if param != "none" and self.stage != 3:
            raise ValueError(f"{OffloadParamConfig._PATH}.device: offloading parameters to "
                             f"{_show(param)} needs zero_optimization.stage 3, "
                             f"got stage {self.stage}")
        if optimizer == "nvme" and self.stage != 3:
            raise ValueError(f"{OffloadOptimizerConfig._PATH}.device: offloading optimizer state "
                             f'to "nvme" needs zero_optimization.stage 3, got stage {self.stage}')
        if optimizer == "cpu" and self.stage == 0:
            raise ValueError(f"{OffloadOptimizerConfig._PATH}.device: offloading optimizer state "
                             "needs zero_optimization.stage 1, 2 or 3, got stage 0")
