"""The functional entry of the CPU optimizers: one call updates one flat fp32 shard, or a range
of it, by one rule (Adam/AdamW, Adagrad, Lion).

This is what the engine calls per unit shard (`adam_step`, `adagrad_step`, `lion_step`);
`CPUAdam.step` and its siblings pass all their parameters to the kernel in one call instead, as
`kernel_job`s ([Note: one step, one kernel call] in kernel_optimizer.py). It checks every tensor
(device, dtype, contiguity, length) and hyper-parameter before a pointer crosses into
`infinity._adam`, which trusts what it is given.

[Note: what one call does]
For the elements [offset, offset + count) of the flat views of the tensors, in one pass over
memory: grad * grad_scale, the rule's step on param and its moments in place, and, when
`half_out` is given, the new param rounded to nearest even into `half_out` (the copy that goes
back to the accelerator or to NVMe). The moments are all fp32 or all bf16 ([Note: bf16
moments] in csrc/adam/adam.h), or, with moment_format="8bit", all in the 8-bit block format,
passed as their stored bytes ([Note: 8-bit moments] below); param is fp32. The result is the
same on every SIMD path, bit for bit: for Adam it equals torch.optim.AdamW's (or Adam's, with L2 weight decay) fused CPU
kernel on the same fp32 values ([Note: exact parity with torch] in csrc/adam/adam.h), for
Adagrad torch.optim.Adagrad's fused CPU kernel, and Lion follows the order of [Note: Adagrad
and Lion arithmetic] in csrc/adam/adam.h.
"""

from __future__ import annotations

import functools
import operator
import os
from typing import NamedTuple

import torch

from infinity._native import _adam
from infinity.optim.formats import BLOCK, FORMATS

__all__ = ["AdagradHyper", "AdamHyper", "LionHyper", "adagrad_step", "adagrad_update", "adam_step", "adam_update",
           "available_simd_paths", "lion_step", "lion_update", "simd_path"]

_GRAD_DTYPES = {
    torch.float32: _adam.DType.float32,
    torch.bfloat16: _adam.DType.bfloat16,
    torch.float16: _adam.DType.float16,
}
_HALF_DTYPES = {torch.bfloat16: _adam.DType.bfloat16, torch.float16: _adam.DType.float16}
_MOMENT_DTYPES = {torch.float32: _adam.DType.float32, torch.bfloat16: _adam.DType.bfloat16}
_BLOCK8 = FORMATS["8bit"]

# [Note: 8-bit moments]
# With moment_format="8bit" each moment is the stored form of formats.py's "8bit" format for the
# n values of param: a uint8 tensor of FORMATS["8bit"].nbytes(n) bytes (codes, padding, a scale a
# block of BLOCK values), what the tiers keep in memory and on NVMe. The kernel decodes, updates
# and encodes each block in one pass, with the bits of formats.py's decode, the fp32 kernel and
# its encode ([Note: 8-bit moments in the kernels] in csrc/adam/adam.h). Blocks are counted from
# param's first element and a block's scale depends on all of its values, so offset must be a
# multiple of BLOCK and offset + count one too, or n.

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


PREFETCH_ENV = "INFINITY_PREFETCH_BYTES"
MAX_PREFETCH_BYTES = 1 << 16


def prefetch_distance(bytes_ahead: int | None = None) -> int:
    """The update kernels' software prefetch distance, in bytes of an fp32 stream (0: none):
    process-wide, sets it first when given. The default is the distance measured in [Note:
    memory traffic] (csrc/adam/adam.h), or $INFINITY_PREFETCH_BYTES when set; the best one
    depends on the host (`bench/bench_cpu_optim.py --prefetch-bytes ...` compares them). The
    results are the same bits at every distance."""
    if bytes_ahead is not None:
        _adam.set_prefetch_bytes(_checked_prefetch("bytes_ahead", bytes_ahead))
    return _adam.prefetch_bytes()


def _checked_prefetch(name: str, value: object) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PREFETCH_BYTES
            and value % 4 == 0):
        raise ValueError(f"{name} must be a whole number of bytes, a multiple of 4 from 0 to "
                         f"{MAX_PREFETCH_BYTES}, got {value!r}")
    return value


if os.environ.get(PREFETCH_ENV):
    _env = os.environ[PREFETCH_ENV]
    _adam.set_prefetch_bytes(_checked_prefetch(PREFETCH_ENV, int(_env) if _env.strip().isdigit() else _env))


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


def check_range(where: str, name: str, value: float, low: float, high: float | None = None, *,
                high_open: bool = False) -> None:
    """Raises ValueError naming `name` unless low <= value (and value <= high, or < high when
    `high_open`); NaN is never in range."""
    above = high is not None and (value >= high if high_open else value > high)
    if not low <= value or above:
        expected = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{where}invalid {name}: {value} (expected {expected})")


def check_hyper_params(lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float) -> None:
    """Raises ValueError naming the first Adam hyper-parameter out of range (as torch.optim does)."""
    check_range("", "lr", lr, 0.0)
    check_range("", "beta1 (betas[0])", beta1, 0.0, 1.0, high_open=True)
    check_range("", "beta2 (betas[1])", beta2, 0.0, 1.0, high_open=True)
    check_range("", "eps", eps, 0.0)
    check_range("", "weight_decay", weight_decay, 0.0)


def check_adagrad_hyper(lr: float, eps: float, weight_decay: float, lr_decay: float, where: str = "") -> None:
    """Raises ValueError naming the first Adagrad hyper-parameter out of range (as torch's Adagrad)."""
    check_range(where, "lr", lr, 0.0)
    check_range(where, "eps", eps, 0.0)
    check_range(where, "weight_decay", weight_decay, 0.0)
    check_range(where, "lr_decay", lr_decay, 0.0)


def check_lion_hyper(lr: float, beta1: float, beta2: float, weight_decay: float, where: str = "") -> None:
    """Raises ValueError naming the first Lion hyper-parameter out of range."""
    check_range(where, "lr", lr, 0.0)
    check_range(where, "beta1 (betas[0])", beta1, 0.0, 1.0)
    check_range(where, "beta2 (betas[1])", beta2, 0.0, 1.0)
    check_range(where, "weight_decay", weight_decay, 0.0)


class AdamHyper(NamedTuple):
    """Hyper-parameters of one param group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool = True
    bias_correction: bool = True


class AdagradHyper(NamedTuple):
    """Adagrad's hyper-parameters of one param group (torch.optim.Adagrad's; L2 weight decay)."""

    lr: float
    eps: float
    weight_decay: float
    lr_decay: float = 0.0


class LionHyper(NamedTuple):
    """Lion's hyper-parameters of one param group (decoupled weight decay)."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              hyper: AdamHyper, *, step: int, grad_scale: float = 1.0, half_out: torch.Tensor | None = None,
              offset: int = 0, count: int | None = None, moment_format: str | None = None) -> None:
    """`adam_update` with one group's hyper-parameters as an `AdamHyper` (the engine's call)."""
    adam_update(param, grad, exp_avg, exp_avg_sq, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode,
                bias_correction=hyper.bias_correction, grad_scale=grad_scale, half_out=half_out, offset=offset,
                count=count, moment_format=moment_format)


def adagrad_step(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: AdagradHyper, *,
                 step: int, grad_scale: float = 1.0, half_out: torch.Tensor | None = None, offset: int = 0,
                 count: int | None = None, moment_format: str | None = None) -> None:
    """`adagrad_update` with one group's hyper-parameters as an `AdagradHyper` (the engine's call)."""
    adagrad_update(param, grad, exp_avg_sq, step=step, lr=hyper.lr, eps=hyper.eps,
                   weight_decay=hyper.weight_decay, lr_decay=hyper.lr_decay, grad_scale=grad_scale,
                   half_out=half_out, offset=offset, count=count, moment_format=moment_format)


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, hyper: LionHyper, *, step: int,
              grad_scale: float = 1.0, half_out: torch.Tensor | None = None, offset: int = 0,
              count: int | None = None, moment_format: str | None = None) -> None:
    """`lion_update` with one group's hyper-parameters as a `LionHyper` (the engine's call). Lion
    has no step count: `step` is checked (>= 1) and otherwise unused, so that every rule's step
    function takes the same arguments."""
    _check_step("lion_step", step)
    lion_update(param, grad, exp_avg, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                weight_decay=hyper.weight_decay, grad_scale=grad_scale, half_out=half_out, offset=offset,
                count=count, moment_format=moment_format)


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
    moment_format: str | None = None,
) -> None:
    """One Adam (adamw_mode=False: L2 decay) or AdamW step over a flat shard, in place.

    param: a contiguous fp32 CPU tensor (any shape: the update sees its flat view). exp_avg,
    exp_avg_sq: the same length, both fp32 or both bf16 ([Note: bf16 moments] in
    csrc/adam/adam.h). grad: the same length, fp32, bf16 or fp16. half_out: None, or the same
    length in bf16 or fp16, receives the updated param.
    step: the step number of this update, 1 on the first (torch's state["step"] after += 1).
    grad_scale: multiplies the gradient first (loss-scale unscale times clip coefficient).
    offset, count: update only elements [offset, offset + count) (count=None: to the end), so
    that one piece of a shard can be updated while the next is still being read.
    num_threads: None means torch.get_num_threads(). simd: None means $INFINITY_SIMD, else the
    best path. updater: the thread pool to run on (None: one shared by the process).
    moment_format: None (the moments' dtype says: fp32 or bf16), "fp32", "bf16", or "8bit": the
    moments are then uint8 tensors in the stored 8-bit form of param's n values, and offset and
    offset + count fall on blocks ([Note: 8-bit moments]).
    The GIL is released while the kernel runs.
    """
    count = check_update("adam_update", param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, half_out,
                         offset, count, moment_format)
    step = _check_step("adam_update", step)
    check_hyper_params(lr, beta1, beta2, eps, weight_decay)
    hyper = _adam.HyperParams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        grad_scale=grad_scale, step=step, adamw_mode=adamw_mode,
        bias_correction=bias_correction)
    run_update(updater or shared_updater(), hyper, param, grad, exp_avg, exp_avg_sq,
               half_out=half_out, offset=offset, count=count, num_threads=num_threads, simd=simd,
               moment_format=moment_format)


def adagrad_update(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int, lr: float,
                   eps: float, weight_decay: float, lr_decay: float = 0.0, grad_scale: float = 1.0,
                   half_out: torch.Tensor | None = None, offset: int = 0, count: int | None = None,
                   num_threads: int | None = None, simd: str | None = None,
                   updater: _adam.Updater | None = None, moment_format: str | None = None) -> None:
    """One torch.optim.Adagrad step over a flat shard, in place: the bits of torch's fused CPU
    kernel ([Note: Adagrad and Lion arithmetic] in csrc/adam/adam.h).

    exp_avg_sq: the sum of squared gradients (torch's state["sum"]; DeepSpeed's CPU Adagrad
    names it exp_avg_sq), fp32, bf16 or 8-bit, starting at initial_accumulator_value. weight_decay is
    L2 (added to the gradient); the step size is lr / (1 + (step - 1) * lr_decay). The other
    arguments are adam_update's.
    """
    count = check_update("adagrad_update", param, grad, {"exp_avg_sq": exp_avg_sq}, half_out, offset, count,
                         moment_format)
    step = _check_step("adagrad_update", step)
    check_adagrad_hyper(lr, eps, weight_decay, lr_decay, "adagrad_update: ")
    hyper = _adam.HyperParams(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay, grad_scale=grad_scale,
                              step=step, rule=_adam.Rule.adagrad)
    run_update(updater or shared_updater(), hyper, param, grad, None, exp_avg_sq, half_out=half_out,
               offset=offset, count=count, num_threads=num_threads, simd=simd, moment_format=moment_format)


def lion_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
                beta2: float, weight_decay: float, grad_scale: float = 1.0, half_out: torch.Tensor | None = None,
                offset: int = 0, count: int | None = None, num_threads: int | None = None,
                simd: str | None = None, updater: _adam.Updater | None = None,
                moment_format: str | None = None) -> None:
    """One Lion step over a flat shard, in place ([Note: Adagrad and Lion arithmetic] in
    csrc/adam/adam.h): the direction sign(lerp(exp_avg, grad, 1 - beta1)), decoupled weight
    decay p * (1 - lr * weight_decay), then exp_avg = lerp(exp_avg, grad, 1 - beta2).

    exp_avg: fp32, bf16 or 8-bit. The other arguments are adam_update's.
    """
    count = check_update("lion_update", param, grad, {"exp_avg": exp_avg}, half_out, offset, count, moment_format)
    check_lion_hyper(lr, beta1, beta2, weight_decay, "lion_update: ")
    hyper = _adam.HyperParams(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, grad_scale=grad_scale,
                              rule=_adam.Rule.lion)
    run_update(updater or shared_updater(), hyper, param, grad, exp_avg, None, half_out=half_out,
               offset=offset, count=count, num_threads=num_threads, simd=simd, moment_format=moment_format)


def check_update(where: str, param: object, grad: object, moments: dict[str, object], half_out: object,
                 offset: int, count: int | None, moment_format: str | None = None) -> int:
    """Checks the tensors of one update (see adam_update) and returns its count; errors start
    with `where` and name the argument."""
    n = check_tensor(f"{where}: param", param, (torch.float32,), None).numel()
    check_tensor(f"{where}: grad", grad, _GRAD_DTYPES, n)
    if moment_format == "8bit":
        _check_8bit(where, moments, n)
    elif moment_format in (None, "fp32", "bf16"):
        _check_plain_moments(where, moments, n, moment_format)
    else:
        raise ValueError(f"{where}: moment_format must be None, 'fp32', 'bf16' or '8bit', got {moment_format!r}")
    if half_out is not None:
        check_tensor(f"{where}: half_out", half_out, _HALF_DTYPES, n)
    if count is None:
        count = n - offset
    if offset < 0 or count < 0 or offset + count > n:
        raise ValueError(f"{where}: offset={offset}, count={count} is outside the {n} elements of param")
    if moment_format == "8bit" and (offset % BLOCK or ((offset + count) % BLOCK and offset + count != n)):
        raise ValueError(f"{where}: offset={offset}, count={count}: with 8-bit moments an update starts on a block "
                         f"of {BLOCK} values and ends on one or at the end of param ({n} elements)")
    return count


def _check_plain_moments(where: str, moments: dict[str, object], n: int, moment_format: str | None) -> None:
    """fp32 or bf16 moments of n values, all of one dtype (`moment_format`'s, when given)."""
    first = None
    for name, moment in moments.items():
        if isinstance(moment, torch.Tensor) and moment.dtype == torch.uint8 and moment_format is None:
            raise TypeError(f"{where}: {name} has dtype torch.uint8: pass moment_format='8bit' for 8-bit moments")
        check_tensor(f"{where}: {name}", moment, _MOMENT_DTYPES, n)
        if moment_format is not None and moment.dtype != FORMATS[moment_format].kernel_dtype:
            raise TypeError(f"{where}: {name} has dtype {moment.dtype}, moment_format {moment_format!r} "
                            f"takes {FORMATS[moment_format].kernel_dtype}")
        if first is None:
            first = name
        elif moment.dtype != moments[first].dtype:
            raise TypeError(f"{where}: {name} has dtype {moment.dtype} and {first} {moments[first].dtype}: "
                            "the moments must share one dtype (float32 or bfloat16)")


def _check_8bit(where: str, moments: dict[str, object], n: int) -> None:
    """Moments in the stored 8-bit form of n values ([Note: 8-bit moments])."""
    for name, moment in moments.items():
        check_tensor(f"{where}: {name}", moment, (torch.uint8,), None)
        if moment.numel() != _BLOCK8.nbytes(n):
            raise ValueError(f"{where}: {name} has {moment.numel()} bytes; 8-bit moments of the {n} values of param "
                             f"take {_BLOCK8.nbytes(n)} (formats.FORMATS['8bit'].nbytes({n}))")


def _check_step(where: str, step: object) -> int:
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"{where}: step must be an int, got {step!r}") from None
    if step < 1:
        raise ValueError(f"{where}: step must be >= 1, got {step}")
    return step


def run_update(updater: _adam.Updater, hyper: _adam.HyperParams, param: torch.Tensor,
               grad: torch.Tensor, exp_avg: torch.Tensor | None, exp_avg_sq: torch.Tensor | None, *,
               half_out: torch.Tensor | None, offset: int, count: int,
               num_threads: int | None, simd: str | None, moment_format: str | None = None) -> None:
    """The call into the kernel, on tensors already checked (see check_update)."""
    job = kernel_job(hyper, param, grad, exp_avg, exp_avg_sq, half_out=half_out, offset=offset,
                     count=count, moment_format=moment_format)
    updater.update_many([job], num_threads=num_threads or torch.get_num_threads(), simd=simd or "")


def kernel_job(hyper: _adam.HyperParams, param: torch.Tensor, grad: torch.Tensor,
               exp_avg: torch.Tensor | None, exp_avg_sq: torch.Tensor | None, *,
               half_out: torch.Tensor | None, offset: int, count: int,
               moment_format: str | None = None) -> _adam.Job:
    """Elements [offset, offset + count) of tensors already checked (see check_update), as one
    job of `Updater.update_many`. A moment the rule does not use is None."""
    half_ptr, half_dtype = 0, _adam.DType.none
    if half_out is not None:
        half_ptr = half_out.data_ptr() + 2 * offset
        half_dtype = _HALF_DTYPES[half_out.dtype]

    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr() + t.element_size() * offset

    scales = {}
    if moment_format == "8bit":  # codes at `offset` (a byte each), scales from its block on
        moment_dtype = _adam.DType.e4m3_block
        first_scale = _BLOCK8.scales_offset(param.numel()) + 4 * (offset // BLOCK)
        scales = {f"{name}_scales": 0 if t is None else t.data_ptr() + first_scale
                  for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))}
    else:
        moments = [m for m in (exp_avg, exp_avg_sq) if m is not None]
        moment_dtype = _MOMENT_DTYPES[moments[0].dtype] if moments else _adam.DType.float32
    return _adam.Job(
        hyper,
        address(param),
        address(grad),
        address(exp_avg),
        address(exp_avg_sq),
        count,
        _GRAD_DTYPES[grad.dtype],
        half_out=half_ptr,
        half_dtype=half_dtype,
        moment_dtype=moment_dtype,
        **scales,
    )
