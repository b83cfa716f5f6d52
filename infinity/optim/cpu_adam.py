"""CPUAdam: torch.optim.AdamW (or Adam) for fp32 CPU parameters, on infinity's SIMD kernel.

[Note: state_dict layout]
The per-parameter state is torch's: `step` (a float32 scalar tensor), `exp_avg`, `exp_avg_sq`,
so a state dict moves between CPUAdam and torch.optim.AdamW / Adam both ways. Param groups keep
torch's keys (lr, betas, eps, weight_decay, amsgrad) plus two of our own (adamw_mode,
bias_correction) that torch ignores; a group loaded from torch gets them from its
`decoupled_weight_decay` and True. Torch options that change the math and that CPUAdam does not
implement (amsgrad, maximize) raise instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from infinity._native import _adam
from infinity.optim.functional import check_hyper_params
from infinity.optim.kernel_optimizer import KernelOptimizer

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]


class CPUAdam(KernelOptimizer):
    """Adam / AdamW on the CPU with torch's arithmetic: the same bits as torch.optim.AdamW /
    Adam with fused=True, and within the last bit, step by step, of their default CPU path.

    adamw_mode=True is AdamW (decoupled weight decay), False is Adam with L2 weight decay added
    to the gradient. bias_correction=False drops both bias corrections. amsgrad is not
    implemented and raises. num_threads: threads per update, None for torch.get_num_threads()
    at each step. fp32_optimizer_states=False keeps exp_avg and exp_avg_sq in bf16 ([Note:
    moment dtype] in kernel_optimizer.py).
    """

    name = "CPUAdam"
    moment_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        num_threads: int | None = None,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults, num_threads=num_threads, fp32_optimizer_states=fp32_optimizer_states)

    def _complete_group(self, group: dict[str, Any]) -> None:
        super()._complete_group(group)
        # A group saved by torch.optim.Adam/AdamW ([Note: state_dict layout]).
        group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
        group.setdefault("bias_correction", True)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_group(group)

    def _hyper(self, group: dict[str, Any], step: int) -> _adam.HyperParams:
        return _hyper(group, step)


class DeepSpeedCPUAdam(CPUAdam):
    """CPUAdam under DeepSpeed's name and argument order, so that `from infinity.optim import
    DeepSpeedCPUAdam` replaces `from deepspeed.ops.adam import DeepSpeedCPUAdam`.

    Parameters may be fp32, bf16 or fp16 ([Note: half-precision parameters] in
    kernel_optimizer.py); fp32_optimizer_states=False keeps the moments in bf16 ([Note: moment
    dtype] in kernel_optimizer.py).
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, adamw_mode=adamw_mode, bias_correction=bias_correction,
                         fp32_optimizer_states=fp32_optimizer_states)

    # [Note: sub-group steps]
    # DeepSpeed's SuperOffload drives one optimizer for many flat fp32 partitions: before each
    # call it puts the partition as the only parameter of a group and names its state by an int
    # `subgroup_id` (`self.state[subgroup_id]`, with DeepSpeed's int `step`), so that one
    # optimizer object holds the moments of every partition. A call with more than one parameter
    # holding a gradient would make them share one set of moments, so it raises.

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Callable[[], float] | None = None) -> float | None:
        """One Adam step of the parameter that has a gradient, its state kept under
        `self.state[subgroup_id]` ([Note: sub-group steps]). Returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group, p = self._subgroup_param("step_subgroup", subgroup_id)
        state = self.state[subgroup_id]
        if state and isinstance(state["step"], torch.Tensor):
            state["step"] = int(state["step"].item())
        if not state:
            state["step"] = 0
        self._update([(group, p, state)])
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Callable[[], float] | None = None) -> float | None:
        """Undoes the last step_subgroup(sub_group_id), given the same gradient: the parameter
        and both moments go back to their values before it (to within float rounding: the
        inverse is computed, not restored from a copy) and the step count drops by one.

        Raises RuntimeError when the sub-group has no state or its step count is 0.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state[sub_group_id] if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(f"DeepSpeedCPUAdam.rollback_subgroup: Cannot rollback optimizer state for "
                               f"sub_group_id {sub_group_id}: it has none (no step_subgroup ran for it)")
        if int(state["step"]) <= 0:
            raise RuntimeError(f"DeepSpeedCPUAdam.rollback_subgroup: Cannot rollback sub_group_id {sub_group_id}: "
                               f"step count is {int(state['step'])}, nothing to roll back")
        group, p = self._subgroup_param("rollback_subgroup", sub_group_id)
        target = state.get("master", p)
        moments = [state["exp_avg"], state["exp_avg_sq"]]
        wide = [m.float() for m in moments]  # bf16 moments ([Note: moment dtype] in kernel_optimizer.py)
        _adam_inverse(group, int(state["step"]), target, p.grad.to(torch.float32), *wide)
        for m, w in zip(moments, wide):
            if m is not w:
                m.copy_(w)
        if target is not p:
            p.copy_(target)
        state["step"] = int(state["step"]) - 1
        return loss

    def _subgroup_param(self, method: str, subgroup_id: int) -> tuple[dict[str, Any], torch.Tensor]:
        found = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(found) != 1:
            raise ValueError(f"DeepSpeedCPUAdam.{method}({subgroup_id}): expected exactly one "
                             f"parameter with a gradient (the sub-group's flat partition), got {len(found)}")
        group, p = found[0]
        if p.device.type != "cpu":
            raise TypeError(f"DeepSpeedCPUAdam.{method}: the parameter is on {p.device}, expected "
                            "cpu; set zero_optimization.offload_optimizer.device to 'cpu'")
        return group, p


def _hyper(group: dict[str, Any], step: int) -> _adam.HyperParams:
    beta1, beta2 = group["betas"]
    hyper = _adam.HyperParams(
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
        bias_correction=bool(group["bias_correction"]))
    hyper.step = step
    return hyper


def _adam_inverse(group: dict[str, Any], step: int, param: torch.Tensor, grad: torch.Tensor,
                  exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """In place, the values before the Adam step `step` of `group` that produced these, given its
    gradient: the kernel's update ([Note: exact parity with torch] in csrc/adam/adam.h) solved
    backwards. A second moment that rounding would leave below zero is set to zero."""
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
    denom = exp_avg_sq.sqrt() / (bc2**0.5) + eps
    param.addcdiv_(exp_avg, denom, value=lr / bc1)
    if group["adamw_mode"]:
        param.div_(1 - lr * wd)
    elif wd != 0:
        grad = grad + wd * param  # Adam's L2 decay was folded into the gradient
    exp_avg.sub_(grad, alpha=1 - beta1).div_(beta1)
    exp_avg_sq.addcmul_(grad, grad, value=-(1 - beta2)).div_(beta2).clamp_(min=0)


def _check_group(group: dict[str, Any]) -> None:
    """Raises ValueError for a hyper-parameter out of range or an option CPUAdam lacks."""
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise ValueError(f"CPUAdam: {key}=True is not supported")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"CPUAdam: betas must be a pair, got {betas!r}")
    check_hyper_params(float(group["lr"]), float(betas[0]), float(betas[1]),
                       float(group["eps"]), float(group["weight_decay"]))
