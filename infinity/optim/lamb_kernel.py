"""LAMB's two passes as SIMD kernels (csrc/adam/lamb.h), checked before a pointer crosses into
`infinity._adam`.

[Note: LAMB's two passes] in infinity/optim/rules.py says why there are two: `lamb_norms` reads
a flat fp32 master shard, its gradient and moments and returns (sum p^2, sum u^2) without
writing anything; the caller adds those sums over every part of a tensor, derives the trust
ratio and passes it to `lamb_apply`, which computes the same direction u again (the same bits)
and steps. The arithmetic is [Note: LAMB arithmetic] in csrc/adam/lamb.h, the same on every
SIMD path; the sums are [Note: LAMB's sums] there, the same on every path and thread count.
`LambRule` runs these on CPU tensors and the same order with torch ops elsewhere.
"""

from __future__ import annotations

import operator
from typing import Protocol

import torch

from infinity._native import _adam
from infinity.optim.functional import check_range, check_update, shared_updater

__all__ = ["LambParams", "lamb_apply", "lamb_norms"]

_DTYPES = {torch.float32: _adam.DType.float32, torch.bfloat16: _adam.DType.bfloat16,
           torch.float16: _adam.DType.float16}  # check_update has checked which slot takes which


class LambParams(Protocol):
    """What the kernels read of a LAMB hyper-parameter set (`infinity.optim.rules.LambHyper`)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    ratio: float  # the tensor's trust ratio, clamped; read by lamb_apply only


def lamb_norms(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: LambParams, *, grad_scale: float = 1.0, num_threads: int | None = None,
               simd: str | None = None, updater: _adam.Updater | None = None) -> tuple[float, float]:
    """LAMB's first pass over flat CPU tensors: (sum p^2, sum u^2) in float64, nothing written.

    param: contiguous fp32. grad: the same length, fp32, bf16 or fp16 (times grad_scale first).
    exp_avg, exp_avg_sq: the same length, both fp32 or both bf16, as they are before this step.
    num_threads: None means torch.get_num_threads(); the sums do not depend on it, nor on
    `simd` (None: $INFINITY_SIMD, else the best path). The GIL is released while it runs.
    """
    where = "lamb_norms: "
    count = _check_tensors(where, param, grad, exp_avg, exp_avg_sq, None)
    _check_hyper(where, hyper)
    dtypes = _dtypes(grad, exp_avg, None)
    return _adam.lamb_norms(updater or shared_updater(), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                            exp_avg_sq.data_ptr(), count, dtypes[0], dtypes[1], beta1=hyper.beta1,
                            beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                            grad_scale=grad_scale, num_threads=num_threads or torch.get_num_threads(),
                            simd=simd or "")


def lamb_apply(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: LambParams, *, step: int, grad_scale: float = 1.0, half_out: torch.Tensor | None = None,
               num_threads: int | None = None, simd: str | None = None,
               updater: _adam.Updater | None = None) -> None:
    """LAMB's second pass over flat CPU tensors, in place: param -= float(step_size * ratio) * u
    with step_size = lr sqrt(1 - beta2^step) / (1 - beta1^step) (lr without bias correction),
    the new moments stored (rounded to nearest even when bf16), and the new param rounded into
    `half_out` (None, or bf16/fp16 of the same length). The other arguments are lamb_norms'.
    """
    where = "lamb_apply: "
    count = _check_tensors(where, param, grad, exp_avg, exp_avg_sq, half_out)
    step = _check_step(where, step)
    _check_hyper(where, hyper)
    check_range(where, "ratio", hyper.ratio, 0.0)
    grad_dtype, moment_dtype, half_dtype = _dtypes(grad, exp_avg, half_out)
    _adam.lamb_apply(updater or shared_updater(), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                     exp_avg_sq.data_ptr(), count, grad_dtype, moment_dtype,
                     0 if half_out is None else half_out.data_ptr(), half_dtype, lr=hyper.lr, beta1=hyper.beta1,
                     beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay, grad_scale=grad_scale,
                     step=step, bias_correction=bool(hyper.bias_correction), ratio=hyper.ratio,
                     num_threads=num_threads or torch.get_num_threads(), simd=simd or "")


def _check_tensors(where: str, param, grad, exp_avg, exp_avg_sq, half_out) -> int:
    """The element count, after the checks of functional.check_update (errors name the argument)."""
    return check_update(where.rstrip(": "), param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, half_out,
                        0, None)


def _check_hyper(where: str, hyper: LambParams) -> None:
    check_range(where, "lr", hyper.lr, 0.0)
    check_range(where, "beta1 (betas[0])", hyper.beta1, 0.0, 1.0, high_open=True)
    check_range(where, "beta2 (betas[1])", hyper.beta2, 0.0, 1.0, high_open=True)
    check_range(where, "eps", hyper.eps, 0.0)
    check_range(where, "weight_decay", hyper.weight_decay, 0.0)


def _check_step(where: str, step: object) -> int:
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"{where}step must be an int, got {step!r}") from None
    if step < 1:
        raise ValueError(f"{where}step must be >= 1, got {step}")
    return step


def _dtypes(grad: torch.Tensor, exp_avg: torch.Tensor, half_out: torch.Tensor | None):
    half = _adam.DType.none if half_out is None else _DTYPES[half_out.dtype]
    return _DTYPES[grad.dtype], _DTYPES[exp_avg.dtype], half
