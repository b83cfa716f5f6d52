"""DeepSpeed's activation checkpointing API (`deepspeed.checkpointing`): `checkpoint`,
`configure`, `is_configured`, `reset`, and the `activation_checkpointing` config section, on
torch autograd's saved-tensor hooks. Where the inputs a checkpoint keeps live (on the device, in
page-locked host memory with `cpu_checkpointing`, on NVMe with `nvme_path`) is the activation
tier's: infinity/offload/activations.py.

[Note: what a checkpoint keeps]
`checkpoint(function, *args, **kwargs)` runs `function` once with autograd recording as usual,
but every tensor autograd saves for backward inside it is dropped (`saved_tensors_hooks`): each
is replaced by its position in the order they were saved. What the checkpoint keeps is its
tensor arguments, the RNG states (CPU and device) and the autocast state. The first time
backward asks for a dropped tensor, `function` runs again on the kept arguments under the saved
RNG and autocast state, every tensor it saves is caught in the same order, and each is handed to
backward once, then forgotten. This is torch's non-reentrant checkpoint (`use_reentrant=False`),
not DeepSpeed's reentrant `CheckpointFunction`: the parameters inside `function` get gradients
even when no argument requires one (the seed page's `checkpoint(self.block_1, x)` on a batch
`x` trains `block_1` here; DeepSpeed's reentrant version leaves it without gradients, as torch's
`use_reentrant=True` does), and `retain_graph` runs the recompute again when backward comes back.
The gradients are those of `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` bit for
bit. A function that changes an argument in place is refused (the recompute would start from the
changed values), and so is a change to a kept argument between the forward and its recompute.
Without grad (evaluation) `function` just runs.

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
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from infinity.config.json_reader import parse_activation_checkpointing
from infinity.config.sections import ActivationCheckpointingConfig
from infinity.device import InFlight
from infinity.device.timeline import TIMELINE
from infinity.offload import activations
from infinity.offload.activations import Frame, prefetch, restore, settle

__all__ = ["CheckpointingConfig", "checkpoint", "configure", "is_configured", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]

log = logging.getLogger("infinity")

_EMPTY = torch.empty(0)


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


# ---- forward and recompute ---------------------------------------------------------------------


def _unpack(handle: tuple[Frame, int]) -> torch.Tensor:
    frame, index = handle
    if frame.recomputed is None or index not in frame.recomputed:  # first use, or a retained graph again
        _recompute(frame)
    return frame.recomputed.pop(index)


def _recompute(frame: Frame) -> None:
    state = activations.STATE
    device = frame.device
    cfg = state.config
    if cfg.synchronize_checkpoint_boundary or cfg.profile:
        device.synchronize()
    t0 = time.perf_counter()
    settle(state)
    if frame.spill is not None:  # its own read first (the last checkpoint's had nothing to run under)
        frame.spill.fetch()
    prefetch(frame, state)
    tensors = restore(frame, device)
    args, kwargs = frame.fill(tensors)
    caught: list[torch.Tensor] = []

    def catch(t: torch.Tensor) -> None:
        # Detached, and nothing of `caught` left with the recompute's own graph (never run backward):
        # a saved tensor's node holding the list that holds the tensor is a cycle no collector breaks.
        caught.append(t.detach())

    cpu_rng, device_rng = torch.get_rng_state(), device.rng_state()
    try:
        torch.set_rng_state(frame.rng[0])
        device.set_rng_state(frame.rng[1])
        with TIMELINE.span("checkpoint_recompute"), _autocast(frame.autocast), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(catch, _never_unpacked):
            frame.function(*args, **kwargs)
    finally:
        torch.set_rng_state(cpu_rng)
        device.set_rng_state(device_rng)
    if len(caught) != frame.num_saved:
        raise RuntimeError(f"checkpoint: the recompute of {_name(frame.function)} saved {len(caught)} tensors for "
                           f"backward where its forward saved {frame.num_saved}; the function must compute the same "
                           "way both times (no branch on state that changed in between)")
    frame.recomputed = dict(enumerate(caught))
    for k in frame.kept:  # the recompute has what it needs: the device copies go (the host copy stays)
        if k.copy_in is not None:
            k.copy_in = InFlight(_EMPTY, None, k.copy_in.fence)
    if cfg.synchronize_checkpoint_boundary or cfg.profile:
        device.synchronize()
    if cfg.profile:
        log.info("infinity.checkpointing: %s recompute %.3f ms", _name(frame.function),
                 (time.perf_counter() - t0) * 1e3)


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("checkpoint: backward through a recompute's own graph (it only serves the forward's)")


class _autocast:
    """Re-enters the autocast state a forward ran under."""

    def __init__(self, state: list[tuple[str, bool, torch.dtype]]):
        self.contexts = [torch.autocast(kind, dtype=dtype, enabled=enabled) for kind, enabled, dtype in state]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, with what autograd saves inside it recomputed in backward
    instead of kept ([Note: what a checkpoint keeps]); tensor arguments passed by keyword take
    part in autograd as positional ones do. Returns what `function` returns."""
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    if not torch.is_grad_enabled():  # no backward will come: nothing to recompute
        return function(*args, **kwargs)
    state = activations.STATE
    device = state.device
    cfg = state.config
    settle(state)
    frame = Frame(function, args, kwargs, device)
    if cfg.synchronize_checkpoint_boundary or cfg.profile:
        device.synchronize()
    t0 = time.perf_counter()
    with TIMELINE.span("checkpoint_forward"), torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        out = function(*args, **kwargs)
    frame.check_unchanged(args, kwargs)
    if frame.num_saved:  # else backward never comes back here: nothing to keep
        state.frames.append(weakref.ref(frame))
        if not activations.spill(frame, state) and state.moves_to_host():
            activations.offload(frame, state)
    if cfg.synchronize_checkpoint_boundary or cfg.profile:
        device.synchronize()
    if cfg.profile:
        log.info("infinity.checkpointing: %s forward %.3f ms", _name(function), (time.perf_counter() - t0) * 1e3)
    return out


non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for the non-reentrant variant: this one is


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
