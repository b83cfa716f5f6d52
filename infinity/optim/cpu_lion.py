"""CPULion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms") for fp32 CPU parameters, on infinity's SIMD kernel.

torch has no Lion; the arithmetic, in torch ops, is [Note: Adagrad and Lion arithmetic] in
csrc/adam/adam.h. The per-parameter state is `step` (a float32 scalar tensor, counted though
Lion does not read it) and `exp_avg`, the momentum; DeepSpeed's CPU Lion saves the same keys
(and an unused exp_avg_sq, ignored here), so its state loads.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from infinity._native import _adam
from infinity.optim.functional import check_lion_hyper
from infinity.optim.kernel_optimizer import KernelOptimizer

__all__ = ["CPULion", "DeepSpeedCPULion"]


class CPULion(KernelOptimizer):
    """Lion on the CPU: p = p * (1 - lr * weight_decay) - lr * sign(beta1 m + (1 - beta1) g),
    then m = beta2 m + (1 - beta2) g.

    num_threads: threads per update, None for torch.get_num_threads() at each step.
    fp32_optimizer_states=False keeps exp_avg in bf16 ([Note: moment dtype] in
    kernel_optimizer.py).
    """

    name = "CPULion"
    moment_keys = ("exp_avg", None)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        num_threads: int | None = None,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, num_threads=num_threads, fp32_optimizer_states=fp32_optimizer_states)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize", False):
            raise ValueError(f"{self.name}: maximize=True is not supported")
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{self.name}: betas must be a pair, got {betas!r}")
        check_lion_hyper(float(group["lr"]), float(betas[0]), float(betas[1]), float(group["weight_decay"]),
                         f"{self.name}: ")

    def _hyper(self, group: dict[str, Any], step: int) -> _adam.HyperParams:
        beta1, beta2 = group["betas"]
        return _adam.HyperParams(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                 weight_decay=float(group["weight_decay"]), step=step, rule=_adam.Rule.lion)


class DeepSpeedCPULion(CPULion):
    """CPULion under DeepSpeed's name, arguments and defaults (lr 1e-3, betas (0.9, 0.999)), so
    that `from infinity.optim import DeepSpeedCPULion` replaces `from deepspeed.ops.lion import
    DeepSpeedCPULion`. Parameters may be fp32, bf16 or fp16 ([Note: half-precision parameters] in
    kernel_optimizer.py); fp32_optimizer_states=False keeps exp_avg in bf16 ([Note: moment dtype]
    in kernel_optimizer.py).
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay,
                         fp32_optimizer_states=fp32_optimizer_states)
