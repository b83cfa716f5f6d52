"""The frozen dataclasses, one per DeepSpeed JSON section, and `InfinityConfig` that holds
them all.

Each validates itself on construction with the checks of `_checks` (see [Note: error paths]
there), so a value is checked the same whether the dataclass is built from JSON by
`json_reader.load_config` or directly from Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
import logging
from typing import Any, ClassVar

import torch

from infinity.config._checks import (
    _bool,
    _check,
    _choice,
    _directory,
    _float,
    _instance,
    _int,
    _join,
    _lrs,
    _optional,
    _path,
    _show,
    _size,
    _spec,
    _validate,
)

log = logging.getLogger("infinity")

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
WARMUP_TYPES = ("log", "linear")
OPTIMIZER_TYPES = ("Adam", "AdamW")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")

# DeepSpeed optimizer types that infinity does not provide (lower-cased: DeepSpeed matches them
# case-insensitively).
_DEEPSPEED_ONLY_OPTIMIZERS = frozenset({
    "adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muon", "muadam",
    "muadamw", "musgd",
})


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchConfig:
    """How many samples one optimizer step sees and how they are split (top-level keys).

    `load_config` derives whichever of the three sizes is missing as DeepSpeed does; built
    directly, all three must be given consistently.
    """

    _PATH: ClassVar[str] = ""

    train_batch_size: int = _spec(_int, minimum=1)
    """Samples per optimizer step over all ranks: micro batch * accumulation steps * world size."""
    train_micro_batch_size_per_gpu: int = _spec(_int, minimum=1)
    """Samples one rank runs per forward/backward pass."""
    gradient_accumulation_steps: int = _spec(_int, minimum=1)
    """Micro batches whose gradients are summed before each optimizer step."""
    world_size: int = _spec(_int, minimum=1, default=1)
    """Data-parallel ranks (not a JSON key: the `world_size` argument of `load_config`)."""

    def __post_init__(self) -> None:
        _validate(self)
        product = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps
        if self.train_batch_size != product * self.world_size:
            raise ValueError(
                f"train_batch_size: {self.train_batch_size} != train_micro_batch_size_per_gpu "
                f"{self.train_micro_batch_size_per_gpu} * gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} * world_size {self.world_size} "
                f"(= {product * self.world_size})")


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """fp16 mixed precision with loss scaling (section `fp16`)."""

    _PATH: ClassVar[str] = "fp16"

    enabled: bool = _spec(_bool, default=False)
    """Compute in float16 and scale the loss so that small gradients do not flush to zero."""
    loss_scale: float = _spec(_float, minimum=0.0, default=0.0)
    """A fixed loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = _spec(_int, minimum=0, default=16)
    """Dynamic scaling starts at a loss scale of 2**initial_scale_power."""
    loss_scale_window: int = _spec(_int, minimum=1, default=1000)
    """Steps without overflow after which the dynamic loss scale is doubled."""
    hysteresis: int = _spec(_int, minimum=1, default=2)
    """Overflowing steps tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: bool = _spec(_bool, default=False)
    """Refill the hysteresis budget after every step without overflow, not only after a window."""
    min_loss_scale: float = _spec(_float, minimum=0.0, default=1.0)
    """The dynamic loss scale is never lowered below this."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config:
    """bfloat16 mixed precision (section `bf16`, or DeepSpeed's legacy name `bfloat16`)."""

    _PATH: ClassVar[str] = "bf16"

    enabled: bool = _spec(_bool, default=False)
    """Compute in bfloat16; master weights and optimizer state stay float32."""
    check_grad_overflow: bool = _spec(_bool, default=True)
    """Skip a step whose global gradient norm is inf or nan (DeepSpeed 0.19.8's default); false
    applies it. Units already updated during backward (clipping 0) cannot be skipped."""

    def __post_init__(self) -> None:
        _validate(self)


def _betas(value: Any, path: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{path}: expected a list of two numbers, got {_show(value)}")
    betas = tuple(_float(beta, f"{path}[{i}]") for i, beta in enumerate(value))
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{path}[{i}]: expected a number in [0, 1), got {_show(beta)}")
    return betas  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamParams:
    """Adam hyperparameters (section `optimizer.params`), with DeepSpeed's defaults."""

    _PATH: ClassVar[str] = "optimizer.params"

    lr: float = _spec(_float, minimum=0.0, default=1e-3)
    """Learning rate (a scheduler, if configured, overwrites it every step)."""
    betas: tuple[float, float] = _spec(_betas, default=(0.9, 0.999))
    """Decay rates of the first and second moment estimates."""
    eps: float = _spec(_float, minimum=0.0, default=1e-8)
    """Added to the denominator for numerical stability."""
    weight_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """Weight decay, decoupled (AdamW) or added to the gradient (L2), see `adam_w_mode`."""
    adam_w_mode: bool = _spec(_bool, default=True)
    """For type Adam: decoupled weight decay when true (DeepSpeed's default). AdamW ignores it."""

    def __post_init__(self) -> None:
        _validate(self)


def _optimizer_type(value: Any, path: str) -> str:
    """Adam or AdamW, matched case-insensitively as DeepSpeed does; returned canonical."""
    if not isinstance(value, str):
        raise TypeError(f"{path}: expected a string, got {_show(value)}")
    for name in OPTIMIZER_TYPES:
        if value.lower() == name.lower():
            return name
    if value.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
        raise ValueError(f"{path}: DeepSpeed optimizer {_show(value)} not implemented by "
                         f"infinity; expected one of {', '.join(map(_show, OPTIMIZER_TYPES))}")
    return _choice(value, path, OPTIMIZER_TYPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer infinity builds (section `optimizer`): Adam or AdamW, run on the CPU."""

    _PATH: ClassVar[str] = "optimizer"

    type: str = _spec(_optimizer_type)
    """"Adam" or "AdamW" (any case in JSON, stored canonical)."""
    params: AdamParams = _spec(_instance, AdamParams, factory=AdamParams)
    """Hyperparameters."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style decay: type AdamW, or type Adam with adam_w_mode (DeepSpeed's rule)."""
        return self.type == "AdamW" or self.params.adam_w_mode


# Fields shared by the schedules, as keyword arguments of `_spec`.
_WARMUP_NUM_STEPS = dict(minimum=1, default=1000)
_LAST_BATCH_ITERATION = dict(minimum=-1, default=-1)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupLRParams:
    """WarmupLR: from warmup_min_lr up to warmup_max_lr, then constant (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    warmup_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.0)
    """Learning rate at the first step; a list gives one per optimizer param group."""
    warmup_max_lr: float | tuple[float, ...] | None = _spec(_optional(_lrs), default=None)
    """Learning rate reached after warmup; None (the default) takes the optimizer's lr."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupDecayLRParams:
    """WarmupDecayLR: WarmupLR's warmup, then linear decay to warmup_min_lr at total_num_steps."""

    _PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = _spec(_int, minimum=1)
    """Step at which the decay reaches warmup_min_lr (required)."""
    warmup_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.0)
    """Learning rate at the first step and at the end of decay; a list gives one per group."""
    warmup_max_lr: float | tuple[float, ...] = _spec(_lrs, default=0.001)
    """Learning rate reached after warmup; a list gives one per optimizer param group."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosineLRParams:
    """WarmupCosineLR: warmup of the optimizer's lr by a ratio, then cosine decay."""

    _PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = _spec(_int, minimum=1)
    """Step at which the cosine reaches cos_min_ratio (required)."""
    warmup_min_ratio: float = _spec(_float, minimum=0.0, maximum=1.0, default=0.0)
    """Fraction of the optimizer's lr at the first step."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    cos_min_ratio: float = _spec(_float, minimum=0.0, maximum=1.0, default=0.0001)
    """Fraction of the optimizer's lr at the end of the cosine decay."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


def _momentum(value: Any, path: str) -> float:
    momentum = _float(value, path)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{path}: expected a number in [0, 1), got {_show(value)}")
    return momentum


def _momenta(value: Any, path: str) -> float | tuple[float, ...]:
    """One Adam beta1, or one per optimizer param group (a JSON list)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{path}: expected a number or a non-empty list of numbers, got []")
        return tuple(_momentum(item, f"{path}[{i}]") for i, item in enumerate(value))
    return _momentum(value, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class OneCycleParams:
    """OneCycle: the lr rises from cycle_min_lr to cycle_max_lr and falls back in one cycle,
    then decays; Adam's beta1 cycles the other way (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    cycle_min_lr: float | tuple[float, ...] = _spec(_lrs)
    """Learning rate at both ends of the cycle (required); a list gives one per param group."""
    cycle_max_lr: float | tuple[float, ...] = _spec(_lrs)
    """Learning rate at the top of the cycle (required); a list gives one per param group."""
    decay_lr_rate: float = _spec(_float, minimum=0.0, default=0.0)
    """After the cycle the lr is cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size)."""
    cycle_first_step_size: int = _spec(_int, minimum=1, default=2000)
    """Steps in which the lr rises (and beta1 falls)."""
    cycle_second_step_size: int | None = _spec(_optional(_int), minimum=0, default=None)
    """Steps in which the lr falls back; None (the default) takes cycle_first_step_size."""
    cycle_first_stair_count: int = _spec(_int, minimum=0, default=0)
    """Stairs the rise is cut into (lr and beta1 held flat on each); 0 rises every step."""
    cycle_second_stair_count: int | None = _spec(_optional(_int), minimum=0, default=None)
    """Stairs of the fall; None (the default) takes cycle_first_stair_count."""
    decay_step_size: int = _spec(_int, minimum=0, default=0)
    """Steps per unit of the decay after the cycle; 0 (the default) does not decay."""
    cycle_momentum: bool = _spec(_bool, default=True)
    """Cycle Adam's beta1 from cycle_max_mom down to cycle_min_mom and back (beta2 is set to
    0.99, as DeepSpeed does)."""
    cycle_min_mom: float | tuple[float, ...] = _spec(_momenta, default=0.8)
    """beta1 at the top of the lr cycle; a list gives one per param group."""
    cycle_max_mom: float | tuple[float, ...] = _spec(_momenta, default=0.9)
    """beta1 at both ends of the lr cycle; a list gives one per param group."""
    decay_mom_rate: float = _spec(_float, minimum=0.0, default=0.0)
    """After the cycle beta1 is cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class LRRangeTestParams:
    """LRRangeTest: the lr grows linearly from lr_range_test_min_lr, to find the largest that
    trains (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    lr_range_test_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.001)
    """Learning rate at the first step; a list gives one per optimizer param group."""
    lr_range_test_step_size: int = _spec(_int, minimum=1, default=2000)
    """Steps over which the lr grows by lr_range_test_step_rate times lr_range_test_min_lr."""
    lr_range_test_step_rate: float = _spec(_float, minimum=0.0, default=1.0)
    """Growth per lr_range_test_step_size steps, as a multiple of lr_range_test_min_lr."""
    lr_range_test_staircase: bool = _spec(_bool, default=False)
    """Grow in whole steps of lr_range_test_step_size instead of every step."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


_SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


def _scheduler_type(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{path}: expected a string, got {_show(value)}")
    if value not in SCHEDULER_TYPES:
        close = difflib.get_close_matches(value, SCHEDULER_TYPES, n=1)
        hint = f"; did you mean {_show(close[0])}?" if close else ""
        raise ValueError(f"{path}: expected one of {', '.join(map(_show, SCHEDULER_TYPES))}, "
                         f"got {_show(value)}{hint}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """The learning-rate schedule (section `scheduler`); see `infinity.optim.lr_schedules`."""

    _PATH: ClassVar[str] = "scheduler"

    type: str = _spec(_scheduler_type)
    """"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle" or "LRRangeTest"
    (case-sensitive, as in DeepSpeed)."""
    params: (WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | OneCycleParams
             | LRRangeTestParams) = _spec(_instance, tuple(_SCHEDULER_PARAMS.values()))
    """Parameters of that schedule, with DeepSpeed's names and defaults."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self, "params", _instance, _SCHEDULER_PARAMS[self.type])


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


@dataclass(frozen=True, kw_only=True, slots=True)
class AIOConfig:
    """Asynchronous NVMe I/O (section `aio`): how one transfer is split and queued."""

    _PATH: ClassVar[str] = "aio"

    block_size: int = _spec(_size, minimum=1, default=1_048_576)
    """Bytes per I/O request a transfer is split into: whole pages, as aio_bench_sweep measures
    them (the engine cuts requests at the page, so 1000 would be read as 4096)."""
    queue_depth: int = _spec(_int, minimum=1, default=8)
    """Requests each worker keeps in flight."""
    thread_count: int = _spec(_int, minimum=1, default=1)
    """Worker threads per transfer (DeepSpeed's newer name: intra_op_parallelism)."""
    single_submit: bool = _spec(_bool, default=False)
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = _spec(_bool, default=True)
    """Reap completions while still submitting."""
    engine: str = _spec(_choice, ("auto", "io_uring", "aio", "psync"), default="auto")
    """Kernel interface (infinity's own key, written by aio_bench_sweep): io_uring, kernel AIO,
    or a pread thread pool; auto picks the best the kernel offers."""
    tune: bool = _spec(_bool, default=False)
    """Not a JSON key: true when the config has no `aio` section, so an engine offloading to NVMe
    measures the disk once and uses the setting it measured (or cached) instead of these defaults
    ([Note: the disk tunes itself] in infinity/io/autotune.py); false honours the values given."""

    def __post_init__(self) -> None:
        _validate(self)
        page = os.sysconf("SC_PAGE_SIZE")
        if self.block_size % page:
            raise ValueError(f"{self._PATH}.block_size: expected a whole number of pages (a multiple of {page} "
                             f"bytes, where the engine cuts its requests), got {self.block_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceConfig:
    """A timeline of some steps, written as Chrome trace JSON (section `trace`, infinity's own;
    [Note: the timeline] in infinity/device/timeline.py)."""

    _PATH: ClassVar[str] = "trace"

    path: Path | None = _spec(_optional(_path), default=None)
    """The file to write (rank r > 0 writes `<path>.rank<r>`); None records nothing."""
    start_step: int = _spec(_int, minimum=1, default=2)
    """The first optimizer step recorded (the first one also builds the prefetch schedule); a run
    resumed past it starts recording at its own first step."""
    steps: int = _spec(_int, minimum=1, default=3)
    """How many steps are recorded; the file is written after the last of them."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """What `engine.save_checkpoint` keeps (section `checkpoint`; DeepSpeed's other keys there,
    `tag_validation`, `load_universal`, `use_node_local_storage`, at the values that describe
    what infinity does)."""

    _PATH: ClassVar[str] = "checkpoint"

    save_total_limit: int | None = _spec(_optional(_int), minimum=1, default=None)
    """(infinity) Checkpoints kept in a save directory: once a save is published, the oldest
    beyond the newest N are removed (never the one `latest` names); None keeps them all.
    Hugging Face's name for the same setting."""

    def __post_init__(self) -> None:
        _validate(self)


# DeepSpeed's spellings of each dtype (its DtypeEnum), by the name infinity keeps.
_DTYPE_NAMES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
}


def _dtype_name(value: Any, path: str) -> str:
    for name, spellings in _DTYPE_NAMES.items():
        if isinstance(value, str) and value in spellings:
            return name
    raise ValueError(f"{path}: expected one of {', '.join(map(_show, _DTYPE_NAMES))} "
                     f"(or null for the model's dtype), got {_show(value)}")


@functools.cache
def _log_fp32_accumulation(grad_accum_dtype: str) -> None:
    """Once per process and value: configs pass through load_config more than once."""
    log.warning('data_types.grad_accum_dtype: "%s" accepted; infinity accumulates gradients in '
                'fp32 on the host, as DeepSpeed does when the optimizer is offloaded', grad_accum_dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataTypesConfig:
    """Data types of the training state (section `data_types`).

    [Note: gradient accumulation dtype]
    DeepSpeed reads `grad_accum_dtype` to pick its wrapper: with ZeRO it matters only for
    stage 1 without offload (bf16 model, fp32 accumulation); with the optimizer offloaded,
    gradient partitions accumulate in fp32 on the host whatever it says. Infinity always
    offloads, so it does the same: every value DeepSpeed takes is accepted, and "fp16" or
    "bf16" is logged once as accumulating in fp32. A lower-precision accumulation would only
    lose bits to save host memory that the fp32 master already costs four times over.
    """

    _PATH: ClassVar[str] = "data_types"

    grad_accum_dtype: str | None = _spec(_optional(_dtype_name), default=None)
    """"fp32", "fp16" or "bf16" (and DeepSpeed's other spellings), or None for the model's
    dtype; gradients accumulate in fp32 whichever ([Note: gradient accumulation dtype])."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.grad_accum_dtype in ("fp16", "bf16"):
            _log_fp32_accumulation(self.grad_accum_dtype)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_JSON_SECTIONS = {"zero_optimization": "zero"}  # JSON name -> field, where they differ


def _steps_per_print(value: Any, path: str) -> int | None:
    """A whole number >= 1 (1e5 as JSON writes it too), or None / infinity for never."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _int(value, path, minimum=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's activation checkpointing settings (section `activation_checkpointing`), read by
    `infinity.checkpointing` ([Note: the keys without model parallelism] there), plus infinity's
    own spill of checkpointed inputs to NVMe ([Note: checkpointed inputs on NVMe] there)."""

    _PATH: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = _spec(_bool, default=False)
    """Accepted; with no model parallelism a rank's partition of an input is the whole input."""
    contiguous_memory_optimization: bool = _spec(_bool, default=False)
    """Host copies of `number_checkpoints` checkpoints in one arena of equal slots."""
    cpu_checkpointing: bool = _spec(_bool, default=False)
    """Checkpointed inputs kept in page-locked host memory between forward and recompute."""
    number_checkpoints: int | None = _spec(_optional(_int), minimum=1, default=None)
    """Checkpoints alive at once (the arena's slots); needed by contiguous_memory_optimization."""
    synchronize_checkpoint_boundary: bool = _spec(_bool, default=False)
    """Synchronize the device around each checkpoint's forward and recompute."""
    profile: bool = _spec(_bool, default=False)
    """Log each checkpoint's forward and recompute time."""
    nvme_path: Path | None = _spec(_optional(_directory), default=None)
    """(infinity) An existing directory on NVMe: the inputs of each checkpoint of at least
    `nvme_min_bytes` are written there after its forward, through the aio handle, and read back
    ahead of its recompute, instead of staying in memory; None keeps them in memory."""
    nvme_min_bytes: int = _spec(_size, default=1 << 20)
    """(infinity) With nvme_path, a checkpoint whose floating-point inputs take fewer bytes keeps
    them in memory (a spill costs a file extent and two transfers: worth it for long sequences)."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError(f"{_join(self._PATH, 'contiguous_memory_optimization')}: needs partition_activations "
                             "true, as in DeepSpeed")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError(f"{_join(self._PATH, 'contiguous_memory_optimization')}: needs number_checkpoints (the "
                             "checkpoints alive at once, which size its buffer), as in DeepSpeed")


@dataclass(frozen=True, kw_only=True, slots=True)
class InfinityConfig:
    """A whole job's configuration: one sub-config per DeepSpeed section, plus top-level keys."""

    _PATH: ClassVar[str] = ""

    batch: BatchConfig = _spec(_instance, BatchConfig)
    """Batch sizes (top-level train_batch_size, train_micro_batch_size_per_gpu, ...)."""
    fp16: FP16Config = _spec(_instance, FP16Config, factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = _spec(_instance, BF16Config, factory=BF16Config)
    """bf16 mixed precision."""
    optimizer: OptimizerConfig | None = _spec(_optional(_instance), OptimizerConfig, default=None)
    """The optimizer to build; None when the caller passes its own."""
    scheduler: SchedulerConfig | None = _spec(_optional(_instance), SchedulerConfig, default=None)
    """The learning-rate schedule to build; None for none (or the caller's own)."""
    zero: ZeroConfig = _spec(_instance, ZeroConfig, factory=ZeroConfig)
    """ZeRO stage and offload (JSON section `zero_optimization`)."""
    aio: AIOConfig = _spec(_instance, AIOConfig, factory=lambda: AIOConfig(tune=True))
    """NVMe I/O tuning; left out, measured on the NVMe path's disk (`AIOConfig.tune`)."""
    trace: TraceConfig = _spec(_instance, TraceConfig, factory=TraceConfig)
    """The step timeline (infinity's own section)."""
    checkpoint: CheckpointConfig = _spec(_instance, CheckpointConfig, factory=CheckpointConfig)
    """Checkpoints kept by save_checkpoint."""
    activation_checkpointing: ActivationCheckpointingConfig | None = _spec(
        _optional(_instance), ActivationCheckpointingConfig, default=None)
    """What `infinity.checkpointing` does with checkpointed inputs: `initialize` configures it
    with this section, as `checkpointing.configure(deepspeed_config=...)` would; None (no such
    section) leaves it as it is."""
    data_types: DataTypesConfig = _spec(_instance, DataTypesConfig, factory=DataTypesConfig)
    """Data types of the training state; gradients accumulate in fp32 whatever it says."""
    gradient_clipping: float = _spec(_float, minimum=0.0, default=1.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    steps_per_print: int | None = _spec(_steps_per_print, default=None)
    """Report progress every this many optimizer steps; None never does (also spelled as
    infinity, `float("inf")`, which accelerate sets)."""
    wall_clock_breakdown: bool = _spec(_bool, default=False)
    """Time forward, backward and step separately and report them."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled, bf16.enabled: both are true; enable at most one")

    def get(self, key: str, default: Any = None) -> Any:
        """[Note: the config as a dict]
        DeepSpeed's `engine.config` is the JSON config as a dict, and the frameworks read it so
        (Hugging Face's Trainer: `engine.config.get("zero_optimization", {}).get("stage")`).
        This answers the same lookups from the values in force: a section as a dict of its
        fields (nested sections as dicts), a top-level setting as its value, `default` for a key
        this config has no value for (an absent optimizer or scheduler section too)."""
        if key in _BATCH_KEYS:
            return getattr(self.batch, key)
        name = _JSON_SECTIONS.get(key, key)
        if name == "batch" or name not in type(self).__dataclass_fields__:
            return default
        value = getattr(self, name)
        if value is None:
            return default
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of parameters and activations on the device: float16, bfloat16 or float32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32
