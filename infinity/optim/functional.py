"""The functional entry of CPU Adam: one call updates one flat fp32 shard, or a range of it.

This is what the engine calls per unit shard; `CPUAdam.step` passes all its parameters to
the kernel in one call instead, as `kernel_job`s ([Note: one step, one kernel call] in
cpu_adam.py). It checks every tensor (device, dtype, contiguity, length) before a pointer
crosses into `infinity._adam`, which trusts what it is given.

[Note: what one call does]
For the elements [offset, offset + count) of the flat views of the tensors, in one pass over
memory: grad * grad_scale, the Adam or AdamW step on param / exp_avg / exp_avg_sq in place,
and, when `half_out` is given, the new param rounded to nearest even into `half_out` (the copy
that goes back to the accelerator or to NVMe). The result is the same on every SIMD path, bit
for bit, and equals torch.optim.AdamW's (or Adam's, with L2 weight decay) fused CPU kernel on
the same fp32 values ([Note: exact parity with torch] in csrc/adam/adam.h).
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch

from infinity._native import _adam

__all__ = ["AdamHyper", "adam_step", "adam_update", "available_simd_paths", "simd_path"]

_GRAD_DTYPES = {
    torch.float32: _adam.DType.float32,
    torch.bfloat16: _adam.DType.bfloat16,
    torch.float16: _adam.DType.float16,
}
_HALF_DTYPES = {torch.bfloat16: _adam.DType.bfloat16, torch.float16: _adam.DType.float16}

# One pool of worker threads for every caller that brings no Updater of its own; its threads
# sleep between calls. Created on first use so that importing infinity starts no thread.
_shared_updater: _adam.Updater | None = None


def shared_updater() -> _adam.Updater:
    global _shared_updater
    if _shared_updater is None:
        _shared_updater = _adam.Updater()
    return _shared_updater


def torch_thread_updater() -> _adam.Updater:
    """A new Updater that runs on torch's OpenMP threads when torch runs on OpenMP and the call
    comes from the main thread, else on threads of its own ([Note: torch's OpenMP team] in
    csrc/adam/openmp_team.h)."""
    return _adam.Updater(borrow_openmp_team=_torch_runs_on_openmp())


@functools.cache
def _torch_runs_on_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def simd_path(simd: str | None = None) -> str:
    """The SIMD path an update runs: `simd` if given, else $INFINITY_SIMD, else the best one.

    Raises ValueError for an unknown name or a path this CPU lacks.
    """
    return _adam.resolve_simd(simd or "")


def available_simd_paths() -> list[str]:
    """The SIMD paths this CPU and OS can run, best first ("scalar" always last)."""
    return _adam.available_simd()


def check_tensor(name: str, tensor: object, dtypes, numel: int | None) -> torch.Tensor:
    """Raises TypeError/ValueError starting with `name` unless `tensor` is a dense, contiguous
    CPU tensor of one of `dtypes` with `numel` elements (None: any)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(f"{name} must be a CPU tensor, got device {tensor.device}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in dtypes:
        expected = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {expected}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()})")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(
            f"{name} has {tensor.numel()} elements, param has {numel}")
    return tensor


def check_hyper_params(lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float) -> None:
    """Raises ValueError naming the first hyper-parameter out of range (as torch.optim does)."""
    if not 0.0 <= lr:
        raise ValueError(f"invalid lr: {lr} (expected >= 0)")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"invalid beta1 (betas[0]): {beta1} (expected in [0, 1))")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"invalid beta2 (betas[1]): {beta2} (expected in [0, 1))")
    if not 0.0 <= eps:
        raise ValueError(f"invalid eps: {eps} (expected >= 0)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"invalid weight_decay: {weight_decay} (expected >= 0)")


class AdamHyper(NamedTuple):
    """Hyper-parameters of one param group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool = True
    bias_correction: bool = True


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              hyper: AdamHyper, *, step: int, grad_scale: float = 1.0, half_out: torch.Tensor | None = None,
              offset: int = 0, count: int | None = None) -> None:
    """`adam_update` with one group's hyper-parameters as an `AdamHyper` (the engine's call)."""
    adam_update(param, grad, exp_avg, exp_avg_sq, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode,
                bias_correction=hyper.bias_correction, grad_scale=grad_scale, half_out=half_out, offset=offset,
                count=count)


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    offset: int = 0,
    count: int | None = None,
    num_threads: int | None = None,
    simd: str | None = None,
    updater: _adam.Updater | None = None,
) -> None:
    """One Adam (adamw_mode=False: L2 decay) or AdamW step over a flat shard, in place.

    param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors of one length (any shape: the
    update sees their flat views). grad: the same length, fp32, bf16 or fp16. half_out: None,
    or the same length in bf16 or fp16, receives the updated param.
    step: the step number of this update, 1 on the first (torch's state["step"] after += 1).
    grad_scale: multiplies the gradient first (loss-scale unscale times clip coefficient).
    offset, count: update only elements [offset, offset + count) (count=None: to the end), so
    that one piece of a shard can be updated while the next is still being read.
    num_threads: None means torch.get_num_threads(). simd: None means $INFINITY_SIMD, else the
    best path. updater: the thread pool to run on (None: one shared by the process).
    The GIL is released while the kernel runs.
    """
    n = check_tensor("adam_update: param", param, (torch.float32,), None).numel()
    check_tensor("adam_update: grad", grad, _GRAD_DTYPES, n)
    check_tensor("adam_update: exp_avg", exp_avg, (torch.float32,), n)
    check_tensor("adam_update: exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if half_out is not None:
        check_tensor("adam_update: half_out", half_out, _HALF_DTYPES, n)
    if count is None:
        count = n - offset
    if offset < 0 or count < 0 or offset + count > n:
        raise ValueError(
            f"adam_update: offset={offset}, count={count} is outside the {n} elements of param")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"adam_update: step must be an int, got {step!r}") from None
    if step < 1:
        raise ValueError(f"adam_update: step must be >= 1, got {step}")
    check_hyper_params(lr, beta1, beta2, eps, weight_decay)
    hyper = _adam.HyperParams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        grad_scale=grad_scale, step=step, adamw_mode=adamw_mode,
        bias_correction=bias_correction)
    run_update(updater or shared_updater(), hyper, param, grad, exp_avg, exp_avg_sq,
               half_out=half_out, offset=offset, count=count, num_threads=num_threads, simd=simd)


def run_update(updater: _adam.Updater, hyper: _adam.HyperParams, param: torch.Tensor,
               grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               half_out: torch.Tensor | None, offset: int, count: int,
               num_threads: int | None, simd: str | None) -> None:
    """The call into the kernel, on tensors already checked (see adam_update)."""
    job = kernel_job(hyper, param, grad, exp_avg, exp_avg_sq, half_out=half_out, offset=offset,
                     count=count)
    updater.update_many([job], num_threads=num_threads or torch.get_num_threads(), simd=simd or "")


def kernel_job(hyper: _adam.HyperParams, param: torch.Tensor, grad: torch.Tensor,
               exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, half_out: torch.Tensor | None,
               offset: int, count: int) -> _adam.Job:
    """Elements [offset, offset + count) of tensors already checked (see adam_update), as one
    job of `Updater.update_many`."""
    half_ptr, half_dtype = 0, _adam.DType.none
    if half_out is not None:
        half_ptr = half_out.data_ptr() + 2 * offset
        half_dtype = _HALF_DTYPES[half_out.dtype]
    return _adam.Job(
        hyper,
        param.data_ptr() + 4 * offset,
        grad.data_ptr() + grad.element_size() * offset,
        exp_avg.data_ptr() + 4 * offset,
        exp_avg_sq.data_ptr() + 4 * offset,
        count,
        _GRAD_DTYPES[grad.dtype],
        half_out=half_ptr,
        half_dtype=half_dtype,
    )
