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
from infinity.optim.functional import (check_hyper_params, check_tensor, kernel_job, simd_path,
                                       torch_thread_updater)

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]

# [Note: one step, one kernel call]
# step() checks every parameter that has a gradient (creating the state of new ones) before it
# counts any step, then passes all of them to the kernel in one call: the threads wake once per
# step and share out chunks of all the tensors ([Note: one region per batch] in
# csrc/adam/updater.h), on torch's own OpenMP threads where torch runs on OpenMP ([Note:
# torch's OpenMP team] in csrc/adam/openmp_team.h). With one call per parameter on a pool of
# our own, a step over 100M parameters in six tensors run right after torch's fused AdamW step
# was 0.95x its speed (quartiles 0.92-0.97, 2 threads; bench/bench_adam.py, public API side by
# side), though the kernel alone was not slower. A parameter that fails its checks raises
# before any step is counted or any parameter changes.

# [Note: half-precision parameters]
# bf16 and fp16 parameters (as DeepSpeedCPUAdam takes them) get an fp32 copy in their state
# ("master"), made at their first step; the kernel updates master and moments in fp32 and writes
# the rounded value into the parameter in the same pass, so no precision is lost between steps.
# DeepSpeed instead updates the half-precision value itself, rounding it every step: the two
# agree on the first step and drift apart by rounding after it.
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW on the CPU with torch's arithmetic: the same bits as torch.optim.AdamW /
    Adam with fused=True, and within the last bit, step by step, of their default CPU path.

    adamw_mode=True is AdamW (decoupled weight decay), False is Adam with L2 weight decay added
    to the gradient. bias_correction=False drops both bias corrections. amsgrad is not
    implemented and raises. num_threads: threads per update, None for torch.get_num_threads()
    at each step.
    """

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
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        _check_group(defaults)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"CPUAdam: num_threads must be >= 1, got {num_threads}")
        self._num_threads = num_threads
        self._updater = torch_thread_updater()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            _check_group(self.param_groups[index])
            for i, p in enumerate(self.param_groups[index]["params"]):
                check_tensor(f"CPUAdam: param_groups[{index}]['params'][{i}]", p, _PARAM_DTYPES, None)
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_updater"):  # unpickled: torch's __getstate__ keeps no attribute
            self._updater = torch_thread_updater()
            self._num_threads = None
        for group in self.param_groups:
            # A group saved by torch.optim.Adam/AdamW ([Note: state_dict layout]).
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            group.setdefault("bias_correction", True)
            _check_group(group)

    def _prepare(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Creates the state of `p` at its first step and checks the tensors of its update."""
        if "exp_avg" not in state:
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if p.dtype != torch.float32:  # [Note: half-precision parameters]
                state["master"] = p.detach().to(torch.float32, copy=True)
        n = p.numel()
        check_tensor("CPUAdam: param.grad", p.grad, (p.dtype, torch.float32), n)
        check_tensor("CPUAdam: state['exp_avg']", state["exp_avg"], (torch.float32,), n)
        check_tensor("CPUAdam: state['exp_avg_sq']", state["exp_avg_sq"], (torch.float32,), n)

    def _update(self, params: list[tuple[dict[str, Any], torch.Tensor, dict[str, Any]]]) -> None:
        """One Adam step of every (group, param, state) in one kernel call ([Note: one step,
        one kernel call])."""
        for _, p, state in params:
            self._prepare(p, state)
        simd = simd_path()  # raises for a bad $INFINITY_SIMD before any step is counted
        _count_steps([state for _, _, state in params])
        hypers: dict[tuple[int, int], _adam.HyperParams] = {}  # one per group and step count
        jobs = []
        for group, p, state in params:
            step = int(state["step"])
            hyper = hypers.get((id(group), step))
            if hyper is None:
                hyper = hypers[id(group), step] = _hyper(group, step)
            half = p.dtype != torch.float32  # [Note: half-precision parameters]
            jobs.append(kernel_job(hyper, state["master"] if half else p, p.grad, state["exp_avg"],
                                   state["exp_avg_sq"], half_out=p if half else None, offset=0,
                                   count=p.numel()))
        num_threads = self._num_threads or torch.get_num_threads()
        self._updater.update_many(jobs, num_threads=num_threads, simd=simd)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if state and not isinstance(state["step"], torch.Tensor):  # saved by DeepSpeed: an int
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                params.append((group, p, state))
        self._update(params)
        return loss


class DeepSpeedCPUAdam(CPUAdam):
    """CPUAdam under DeepSpeed's name and argument order, so that `from infinity.optim import
    DeepSpeedCPUAdam` replaces `from deepspeed.ops.adam import DeepSpeedCPUAdam`.

    Parameters may be fp32, bf16 or fp16 ([Note: half-precision parameters]); the optimizer
    state is fp32 whatever fp32_optimizer_states says (it is kept for DeepSpeed's signature).
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
                         amsgrad=amsgrad, adamw_mode=adamw_mode, bias_correction=bias_correction)
        self.fp32_optimizer_states = fp32_optimizer_states

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
            raise RuntimeError(f"DeepSpeedCPUAdam.rollback_subgroup: sub_group_id {sub_group_id} "
                               "has no optimizer state (no step_subgroup ran for it)")
        if int(state["step"]) <= 0:
            raise RuntimeError(f"DeepSpeedCPUAdam.rollback_subgroup: sub_group_id {sub_group_id} "
                               f"has step count {int(state['step'])}, nothing to roll back")
        group, p = self._subgroup_param("rollback_subgroup", sub_group_id)
        target = state.get("master", p)
        _adam_inverse(group, int(state["step"]), target, p.grad.to(torch.float32),
                      state["exp_avg"], state["exp_avg_sq"])
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


def _count_steps(states: list[dict[str, Any]]) -> None:
    """Adds one to every state's step: torch's float tensors in one call (as torch's own
    optimizers do), step_subgroup's Python ints ([Note: sub-group steps]) one by one."""
    tensors = [s["step"] for s in states if isinstance(s["step"], torch.Tensor)]
    if tensors:
        torch._foreach_add_(tensors, 1)
    for s in states:
        if not isinstance(s["step"], torch.Tensor):
            s["step"] += 1


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
