"""CPUAdagrad: torch.optim.Adagrad for fp32 CPU parameters, on infinity's SIMD kernel.

The per-parameter state is torch's: `step` (a float32 scalar tensor) and `sum`, starting at
initial_accumulator_value, so a state dict moves between CPUAdagrad and torch.optim.Adagrad
both ways; a state saved by DeepSpeed's CPU Adagrad (its sum named `exp_avg_sq`, an int step)
loads too. The arithmetic is torch's fused CPU kernel's, bit for bit ([Note: Adagrad and Lion
arithmetic] in csrc/adam/adam.h). Torch's `maximize` raises instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from infinity._native import _adam
from infinity.optim.functional import check_adagrad_hyper, check_range
from infinity.optim.kernel_optimizer import KernelOptimizer

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]


class CPUAdagrad(KernelOptimizer):
    """Adagrad on the CPU with torch's arguments and arithmetic: the same bits as
    torch.optim.Adagrad(fused=True), and within the last bit, step by step, of its default path
    (which takes its square root from MKL).

    weight_decay is L2 (added to the gradient, as torch's); the step size is
    lr / (1 + (step - 1) * lr_decay). A parameter's sum starts, at its first step, at its
    group's initial_accumulator_value (torch's Adagrad starts every sum, at construction, at the
    constructor's value, whatever a group says). num_threads: threads per update, None for
    torch.get_num_threads() at each step. fp32_optimizer_states=False keeps the sum in bf16
    ([Note: moment dtype] in kernel_optimizer.py).
    """

    name = "CPUAdagrad"
    moment_keys = (None, "sum")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        num_threads: int | None = None,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, defaults, num_threads=num_threads, fp32_optimizer_states=fp32_optimizer_states)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize", False):
            raise ValueError(f"{self.name}: maximize=True is not supported")
        check_adagrad_hyper(float(group["lr"]), float(group["eps"]), float(group["weight_decay"]),
                            float(group["lr_decay"]), f"{self.name}: ")
        check_range(f"{self.name}: ", "initial_accumulator_value", float(group["initial_accumulator_value"]), 0.0)

    def _complete_group(self, group: dict[str, Any]) -> None:
        super()._complete_group(group)
        group.setdefault("lr_decay", 0.0)  # a group saved by DeepSpeed's CPU Adagrad
        group.setdefault("initial_accumulator_value", 0.0)

    def _initial_moment(self, group: dict[str, Any]) -> float:
        return float(group["initial_accumulator_value"])

    def _adopt_state(self, state: dict[str, Any]) -> None:
        if "sum" not in state and "exp_avg_sq" in state:  # saved by DeepSpeed's CPU Adagrad
            state["sum"] = state.pop("exp_avg_sq")

    def _hyper(self, group: dict[str, Any], step: int) -> _adam.HyperParams:
        return _adam.HyperParams(lr=float(group["lr"]), eps=float(group["eps"]),
                                 weight_decay=float(group["weight_decay"]), lr_decay=float(group["lr_decay"]),
                                 step=step, rule=_adam.Rule.adagrad)


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """CPUAdagrad under DeepSpeed's name and arguments, so that `from infinity.optim import
    DeepSpeedCPUAdagrad` replaces `from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad`.

    DeepSpeed's has no lr_decay or initial_accumulator_value (both 0 here); its amsgrad has no
    effect there and none here. Parameters may be fp32, bf16 or fp16 ([Note: half-precision
    parameters] in kernel_optimizer.py); fp32_optimizer_states=False keeps the sum in bf16
    ([Note: moment dtype] in kernel_optimizer.py).
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        del amsgrad  # DeepSpeed's CPU Adagrad takes it and never reads it
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay,
                         fp32_optimizer_states=fp32_optimizer_states)
