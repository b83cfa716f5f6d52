"""DeepSpeed's engine getters: what the config in force says, under the method names of
`DeepSpeedEngine` that scripts, frameworks and DeepSpeed's own tests call
(`engine.gradient_clipping()`, `engine.zero_optimization_stage()`, ...).

[Note: which getters]
Every getter here answers from the parsed config (`infinity.config.InfinityConfig`) alone, so
it cannot disagree with what the engine does: the engine reads the same values. Getters of
switches infinity accepts only at DeepSpeed's default (`fp16.auto_cast`,
`prescale_gradients`, `zero_optimization.load_from_fp32_weights`, ...) answer that default,
which is what runs. DeepSpeed getters of features infinity does not have (pipeline, progressive
layer drop, eigenvalue, flops profiler, ...) are left out: their absence is an AttributeError,
never a stand-in. `get_data_types()` says fp32 for the gradients whatever
`data_types.grad_accum_dtype` asks ([Note: gradient accumulation dtype] in
infinity/config/sections.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from infinity.config import InfinityConfig, OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["ConfigGetters"]


def _as_dict(section: Any) -> dict[str, Any] | None:
    """A config section as DeepSpeed hands it out (a dict of its keys); None when absent."""
    return None if section is None else dataclasses.asdict(section)


class ConfigGetters:
    """Mixed into `infinity.Engine`: DeepSpeed's getters over `self.config`."""

    config: InfinityConfig

    # ---- batch

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    # ---- precision and gradients

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return False  # fp16.auto_cast: accepted at DeepSpeed's default only

    def amp_enabled(self) -> bool:
        return False  # the amp section: accepted disabled only

    def loss_scale(self) -> float:
        """fp16.loss_scale: a fixed scale, or 0 for dynamic loss scaling."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.dynamic_loss_scale

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(dtype of the model on the device, dtype gradients accumulate in): the second is
        float32 whatever data_types.grad_accum_dtype says ([Note: which getters])."""
        return self.config.compute_dtype, torch.float32

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def postscale_gradients(self) -> bool:
        return True  # prescale_gradients: accepted at DeepSpeed's default (false) only

    def gradient_predivide_factor(self) -> float:
        return 1.0  # accepted at DeepSpeed's default only

    def sparse_gradients_enabled(self) -> bool:
        return False  # sparse_gradients: accepted at DeepSpeed's default only

    # ---- optimizer and schedule sections

    def optimizer_params(self) -> dict[str, Any] | None:
        """The `optimizer.params` in force (defaults filled in); None without the section."""
        return _as_dict(self.config.optimizer and self.config.optimizer.params)

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        """The `scheduler.params` in force (defaults filled in); None without the section."""
        return _as_dict(self.config.scheduler and self.config.scheduler.params)

    # ---- ZeRO

    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero.stage >= 3

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig:
        return self.config.zero.offload_optimizer

    def zero_offload_param(self) -> OffloadParamConfig:
        return self.config.zero.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer runs on the CPU (its state offloaded to host memory or NVMe)."""
        return self.config.zero.offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self.config.zero.offload_optimizer.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.device == "nvme"

    def zero_sub_group_size(self) -> int:
        return self.config.zero.sub_group_size

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero.reduce_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.zero.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero.contiguous_gradients

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero.stage3_prefetch_bucket_size

    def zero_max_live_parameters(self) -> int:
        return self.config.zero.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero.stage3_max_reuse_distance

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero.stage3_param_persistence_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """stage3_gather_16bit_weights_on_model_save: whether a framework's save_model may gather
        the whole 16-bit state dict (accelerate asks before it saves)."""
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def zero_load_from_fp32_weights(self) -> bool:
        return True  # accepted at DeepSpeed's default only

    def zero_elastic_checkpoint(self) -> bool:
        return False  # accepted at DeepSpeed's default only

    # ---- I/O and reporting

    def aio_config(self) -> dict[str, Any]:
        return _as_dict(self.config.aio)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dataloader_drop_last(self) -> bool:
        return False  # accepted at DeepSpeed's default only

    def memory_breakdown(self) -> bool:
        return False  # accepted at DeepSpeed's default only
