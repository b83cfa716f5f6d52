"""CPULamb: LAMB as DeepSpeed's FusedLamb defines it, for CPU parameters, as a torch optimizer.

The per-element arithmetic is the engine's (`LambRule`, [Note: LAMB's two passes] in
infinity/optim/rules.py): new moments, the direction u = m / (sqrt(v) + eps) + wd p, the trust
ratio ||p|| / ||u|| of the whole tensor clamped to [min_coeff, max_coeff] (1 where either norm
is 0), and the step lr sqrt(1 - b2^t) / (1 - b1^t); both passes run the SIMD kernels of
infinity/optim/lamb_kernel.py on each parameter. Passed to `infinity.initialize` (or as
DeepSpeed's `FusedLamb` under the alias) it becomes the engine's LAMB over the shards, in memory
or on NVMe. Its state is torch's layout: `step`, `exp_avg`, `exp_avg_sq` per parameter.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from infinity.optim.rules import LambHyper, LambRule

__all__ = ["CPULamb", "FusedLamb"]


class CPULamb(torch.optim.Optimizer):
    """LAMB (FusedLamb's arguments; eps is added outside the square root). amsgrad,
    eps_inside_sqrt and max_grad_norm (use the engine's gradient_clipping) are not implemented
    and raise. fp32_optimizer_states=False keeps the moments in bf16."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True) -> None:
        for name, bad in (("amsgrad", amsgrad), ("eps_inside_sqrt", eps_inside_sqrt),
                          ("max_grad_norm", max_grad_norm)):
            if bad:
                raise ValueError(f"CPULamb: {name}={bad!r} is not implemented (FusedLamb's default only)")
        if not 0.0 <= lr:
            raise ValueError(f"CPULamb: invalid lr: {lr} (expected >= 0)")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"CPULamb: invalid betas[{i}]: {beta} (expected in [0, 1))")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"CPULamb: expected 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff, fp32_optimizer_states=fp32_optimizer_states)
        super().__init__(params, defaults)
        self._rule = LambRule(fmt="fp32" if fp32_optimizer_states else "bf16")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = self._rule.hypers([group])[0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device.type != "cpu" or p.dtype != torch.float32 or p.grad.is_sparse:
                    raise TypeError(f"CPULamb: parameters must be dense fp32 CPU tensors, got {p.dtype} on {p.device}")
                state = self.state[p]
                if not state:
                    dtype = torch.float32 if group["fp32_optimizer_states"] else torch.bfloat16
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                self._update(p, state, hyper, int(state["step"]))
        return loss

    def _update(self, p: torch.Tensor, state: dict, hyper: LambHyper, step: int) -> None:
        flat, g = p.view(-1), p.grad.reshape(-1)
        moments = {k: state[k].view(-1) for k in ("exp_avg", "exp_avg_sq")}
        w_sq, u_sq = self._rule.norm_terms(flat, g, moments, hyper, step=step, grad_scale=1.0)
        w, u = w_sq ** 0.5, u_sq ** 0.5
        ratio = min(max(w / u, hyper.min_coeff), hyper.max_coeff) if w and u else 1.0
        self._rule.kernel(flat, g, moments, hyper._replace(ratio=ratio), step=step, grad_scale=1.0, half_out=None)


FusedLamb = CPULamb  # DeepSpeed's name (deepspeed.ops.lamb.FusedLamb) for the same optimizer on the CPU
