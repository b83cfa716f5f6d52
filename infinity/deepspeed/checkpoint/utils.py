"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save` (accelerate's `get_state_dict`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """`item` with every tensor in it (nested in lists, tuples and dicts) replaced by a detached
    copy on `device` that shares no storage with the original, so `torch.save` writes each
    tensor's own bytes rather than the whole storage a view points into."""
    device = torch.device(device)
    if isinstance(item, torch.Tensor):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
