"""The frozen dataclasses, one per DeepSpeed JSON section, and `InfinityConfig` that holds
them all. The `optimizer` and `scheduler` sections live in optimizer_sections.py and
`zero_optimization` in zero_sections.py; the rest here, and all of them are importable from here.

Each validates itself on construction with the checks of `_checks` (see [Note: error paths]
there), so a value is checked the same whether the dataclass is built from JSON by
`json_reader.load_config` or directly from Python.
"""

from __future__ import annotations

import dataclasses
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
    _choice,
    _directory,
    _float,
    _instance,
    _int,
    _join,
    _optional,
    _path,
    _show,
    _size,
    _spec,
    _validate,
)
from infinity.config.optimizer_sections import (
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    WARMUP_TYPES,
    AdamParams,
    LRRangeTestParams,
    OneCycleParams,
    OptimizerConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from infinity.config.zero_sections import OFFLOAD_DEVICES, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "OFFLOAD_DEVICES", "OPTIMIZER_TYPES", "SCHEDULER_TYPES", "WARMUP_TYPES",
    "AIOConfig", "ActivationCheckpointingConfig", "AdamParams", "BF16Config", "BatchConfig", "CheckpointConfig",
    "DataTypesConfig", "FP16Config", "InfinityConfig", "LRRangeTestParams", "OffloadOptimizerConfig",
    "OffloadParamConfig", "OneCycleParams", "OptimizerConfig", "SchedulerConfig", "TraceConfig",
    "WarmupCosineLRParams", "WarmupDecayLRParams", "WarmupLRParams", "ZeroConfig",
]

log = logging.getLogger("infinity")


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


@dataclass(frozen=True, kw_only=True, slots=True)
class AIOConfig:
    """Asynchronous NVMe I/O (section `aio`): how one transfer is split and queued."""

    _PATH: ClassVar[str] = "aio"
    _RESOLVED: ClassVar[tuple[str, ...]] = ("min_request",)  # measured by the engine, never a JSON key

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
    min_request: int | None = _spec(_optional(_int), minimum=1, default=None)
    """Not a JSON key: bytes, the least request size the measured disk keeps its pace with
    (`autotune.least_request`), which the optimizer tier cuts streamed pieces no smaller than;
    None where nothing was measured (an `aio` section given, a disk refusing O_DIRECT)."""

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
class ChunkedLossConfig:
    """(infinity) A Hugging Face causal LM trained with `labels` computes its LM head and loss
    block by block, never the whole logits ([Note: the chunked LM loss] in zero/head_loss.py);
    section `chunked_loss`."""

    _PATH: ClassVar[str] = "chunked_loss"

    enabled: bool = _spec(_bool, default=True)
    """On for the causal LMs it knows (`infinity.engine.hf_models.CHUNKED_FAMILIES`); off computes
    the logits whole, as the model does without infinity (and returns them)."""
    chunk_bytes: int = _spec(_size, minimum=1, default=1 << 26)
    """fp32 logits a chunk of tokens may take against one block of the head's rows; the peak is
    about three times this, whatever the sequence's length; a chunk has one token at least."""

    def __post_init__(self) -> None:
        _validate(self)


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
    chunked_loss: ChunkedLossConfig = _spec(_instance, ChunkedLossConfig, factory=ChunkedLossConfig)
    """How a causal LM's head and loss run (infinity's own section)."""
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
