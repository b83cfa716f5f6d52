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
from infinity.optim.functional import check_hyper_params, check_tensor, run_update

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]

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
        self._updater = _adam.Updater()  # this optimizer's thread pool
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
            self._updater = _adam.Updater()
            self._num_threads = None
        for group in self.param_groups:
            # A group saved by torch.optim.Adam/AdamW ([Note: state_dict layout]).
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            group.setdefault("bias_correction", True)
            _check_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        num_threads = self._num_threads or torch.get_num_threads()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = _adam.HyperParams(
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                adamw_mode=bool(group["adamw_mode"]),
                bias_correction=bool(group["bias_correction"]))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                half = p.dtype != torch.float32  # [Note: half-precision parameters]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
                    if half:
                        state["master"] = p.detach().to(torch.float32, copy=True)
                n = p.numel()
                check_tensor("CPUAdam: param.grad", p.grad, (p.dtype, torch.float32), n)
                check_tensor("CPUAdam: state['exp_avg']", state["exp_avg"], (torch.float32,), n)
                check_tensor("CPUAdam: state['exp_avg_sq']", state["exp_avg_sq"],
                             (torch.float32,), n)
                if not isinstance(state["step"], torch.Tensor):  # DeepSpeed's state keeps a Python int
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                state["step"] += 1
                hyper.step = int(state["step"].item())
                run_update(self._updater, hyper, state["master"] if half else p, p.grad, state["exp_avg"],
                           state["exp_avg_sq"], half_out=p if half else None, offset=0, count=n,
                           num_threads=num_threads, simd=None)
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
