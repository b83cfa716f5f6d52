"""DeepSpeed's activation checkpointing API (`deepspeed.checkpointing`): `checkpoint`,
`configure`, `is_configured`, `reset`, and the `activation_checkpointing` config section, on
torch autograd's saved-tensor hooks. Where the inputs a checkpoint keeps live (on the device, in
page-locked host memory with `cpu_checkpointing`, on NVMe with `nvme_path`) is the activation
tier's: infinity/offload/activations.py.

The checkpoint itself, and [Note: what a checkpoint keeps], are in infinity/offload/checkpoint.py.

[Note: the keys without model parallelism]
DeepSpeed's `partition_activations` splits each checkpointed input over the model-parallel
group, every rank keeping 1/mp of it and gathering the rest before the recompute. infinity has
data parallelism only (ZeRO): its ranks hold different samples, so there is nothing to split, and
at a model-parallel size of 1 DeepSpeed's partition is the whole tensor too. The key is accepted
and changes nothing: each checkpoint keeps its inputs whole (on the device, or in host memory
with `cpu_checkpointing`). `mpu_` is accepted when its model-parallel world size is 1.
`contiguous_memory_optimization` (which needs `partition_activations` and `number_checkpoints`,
as in DeepSpeed) puts the host copies of `number_checkpoints` checkpoints in one page-locked arena
of equal slots, allocated once, instead of one buffer each; its slot is sized by the first
checkpoint, so checkpoints must be alike (DeepSpeed's "homogeneous"). Without
`cpu_checkpointing` the inputs are the caller's own tensors, not copies, and it changes nothing.
`synchronize_checkpoint_boundary` synchronizes a CUDA device at the start and end of each
checkpoint's forward and recompute (the CPU computes synchronously: nothing to do).
`profile` logs each checkpoint's forward and recompute time (synchronized on CUDA). The phases
run under the profiler names `infinity::checkpoint_forward` and `infinity::checkpoint_recompute`
always, and a recompute's wait for its inputs under `infinity::checkpoint_inputs` (a "wait" of the
engine's per-step report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from infinity.config.json_reader import parse_activation_checkpointing
from infinity.config.sections import ActivationCheckpointingConfig
from infinity.offload import activations
from infinity.offload.checkpoint import checkpoint, non_reentrant_checkpoint

__all__ = ["CheckpointingConfig", "checkpoint", "configure", "is_configured", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]

log = logging.getLogger("infinity")


CheckpointingConfig = ActivationCheckpointingConfig  # the section's settings (infinity.config.sections)

def _section(deepspeed_config: Any) -> dict:
    """The `activation_checkpointing` section of a DeepSpeed config (a dict or a JSON path),
    checked; the rest of the config is not this module's."""
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config, encoding="utf-8") as f:
            deepspeed_config = json.load(f)
    if not isinstance(deepspeed_config, dict):
        raise TypeError(f"deepspeed_config: expected a DeepSpeed config (a dict or a JSON file's path), got "
                        f"{type(deepspeed_config).__name__}")
    section = deepspeed_config.get("activation_checkpointing")
    return dataclasses.asdict(parse_activation_checkpointing(section)) if section is not None else {}


def _model_parallel_size(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    raise TypeError("mpu_: expected DeepSpeed's model-parallel unit (get_model_parallel_world_size()), got "
                    f"{type(mpu).__name__}")




# ---- configuration ------------------------------------------------------------------------------


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: the defaults, then the
    `activation_checkpointing` section of `deepspeed_config` (a dict or a JSON path), then each
    argument given (not None) over it. `mpu_` must describe a model-parallel size of 1 ([Note:
    the keys without model parallelism])."""
    if mpu_ is not None and _model_parallel_size(mpu_) != 1:
        raise ValueError(f"mpu_: model-parallel world size {_model_parallel_size(mpu_)}; infinity has no model "
                         "(tensor or pipeline) parallelism, so activations cannot be partitioned over it")
    values = dict(_section(deepspeed_config)) if deepspeed_config is not None else {}
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values.update({k: v for k, v in given.items() if v is not None})
    activations.configure_state(CheckpointingConfig(**values))


def is_configured() -> bool:
    """Whether `configure` has been called (DeepSpeed's meaning)."""
    return activations.STATE.configured


def reset() -> None:
    """Forgets the checkpoints of forwards whose backward never came (an evaluation that ran with
    grad enabled), frees the idle host buffers and the contiguous arena, and makes the next
    checkpoint pick its device again. Checkpoints still alive keep what they hold."""
    activations.STATE.forget()


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's name for setting `number_checkpoints`."""
    values = dataclasses.asdict(activations.STATE.config)
    values["number_checkpoints"] = nlayers
    _replace(values)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's name for setting `partition_activations` ([Note: the keys without model parallelism])."""
    values = dataclasses.asdict(activations.STATE.config)
    values["partition_activations"] = partition_activation
    _replace(values)


def _replace(values: dict) -> None:
    config = CheckpointingConfig(**values)
    reset()
    activations.STATE.config = config
