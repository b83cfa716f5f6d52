"""Activation checkpointing's mechanism: `checkpoint(function, *args)`, on torch autograd's
saved-tensor hooks; the inputs it keeps live where the activation tier puts them (activations.py).
`infinity.checkpointing` (DeepSpeed's `deepspeed.checkpointing`, infinity/deepspeed/checkpointing.py)
is its public face and configuration; the engine routes Hugging Face's gradient checkpointing
here ([Note: Hugging Face's gradient checkpointing] in engine/hf_models.py).

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
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from infinity.device import InFlight
from infinity.device.timeline import TIMELINE
from infinity.offload import activations
from infinity.offload.activations import Frame, prefetch, restore, settle

log = logging.getLogger("infinity")

_EMPTY = torch.empty(0)


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
