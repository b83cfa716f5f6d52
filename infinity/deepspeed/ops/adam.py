"""`deepspeed.ops.adam`: `DeepSpeedCPUAdam` is infinity's (infinity.optim), `FusedAdam` torch's Adam.

Given to `initialize` as the client optimizer, either counts for its param groups and
hyper-parameters only: the engine runs its own Adam over the offloaded shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from infinity.optim import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _tensors(groups: list[Any]) -> list[torch.Tensor]:
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return [p[1] if isinstance(p, tuple) else p for p in params]  # (name, tensor) pairs too


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam, with its arguments, as torch's Adam: the fused kernel when every
    parameter is on CUDA, torch's default (foreach) implementation otherwise; AdamW's decoupled
    weight decay unless `adam_w_mode=False`. torch's Adam always corrects the bias, so
    `bias_correction=False` is an error (DeepSpeedCPUAdam has it); amsgrad is refused, as
    DeepSpeed's FusedAdam refuses it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if not bias_correction:
            raise ValueError("bias_correction: False is not supported by FusedAdam here (torch's Adam always "
                             "corrects); use DeepSpeedCPUAdam(bias_correction=False)")
        if amsgrad:
            raise ValueError("amsgrad: FusedAdam does not support the AMSGrad variant")
        groups = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
        tensors = _tensors(groups)
        fused = bool(tensors) and all(t.is_cuda for t in tensors)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, fused=fused or None)
        self.adam_w_mode = adam_w_mode
        self.adamw_mode = adam_w_mode  # the name infinity's engine reads a client optimizer's mode by
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
