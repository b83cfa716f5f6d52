"""LAMB's SIMD kernels (infinity.optim.lamb_kernel, csrc/adam/lamb.h): every path gives the scalar
path's bits, the sums are the defined ones on every path and thread count, and the update is the
torch-op order of [Note: LAMB arithmetic], bit for bit.

Torch's CPU sqrt is MKL's, off by one ulp on some elements (in double too), so the references
here take a correctly rounded fp32 square root (`sqrt_rn`), the one the kernels and an
accelerator compute. Every other op is torch's own, each correctly rounded.
"""

from __future__ import annotations

import math

import pytest
import torch

from infinity._native import _adam
from infinity.optim import available_simd_paths
from infinity.optim.cpu_lamb import CPULamb
from infinity.optim.lamb_kernel import lamb_apply, lamb_norms
from infinity.optim.rules import LambHyper, LambRule

HYPER = LambHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, ratio=0.75)
CHUNK, LANES = 4096, 16  # [Note: LAMB's sums]
PATHS = available_simd_paths()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def random_case(n: int, seed: int, grad_dtype=torch.float32, moment_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype),
            (torch.randn(n, generator=gen) * 0.1).to(moment_dtype),
            (torch.rand(n, generator=gen) * 0.01).to(moment_dtype))


# ---- the definition, in torch ops ---------------------------------------------------------------


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of fp32 x: torch's, within an ulp, then moved to the
    neighbour whose rounding interval holds x. The midpoints between floats have 25 significant
    bits, so they and their squares are exact in double and the comparisons decide exactly."""
    root = torch.sqrt(x.double()).float()
    inf = torch.tensor(float("inf"))
    up, down = torch.nextafter(root, inf), torch.nextafter(root, -inf)
    wide, mid_up, mid_down = x.double(), (root.double() + up.double()) / 2, (root.double() + down.double()) / 2
    fixed = torch.where(wide > mid_up * mid_up, up, torch.where(wide < mid_down * mid_down, down, root))
    return torch.where((x > 0) & x.isfinite(), fixed, root)


def direction(p, g, m, v, h, grad_scale):
    """m', v', u of [Note: LAMB arithmetic]: one torch op per kernel operation."""
    g = g.float() * grad_scale
    m2 = m.float().mul(h.beta1).add_(g.mul(1 - h.beta1))
    v2 = v.float().mul(h.beta2).add_(g.mul(g).mul_(1 - h.beta2))
    u = m2.div(sqrt_rn(v2).add_(h.eps)).add_(p.mul(h.weight_decay))
    return m2, v2, u


def applied(p, g, m, v, h, step, grad_scale):
    """The new p, m', v' of pass 2 (fp32)."""
    m2, v2, u = direction(p, g, m, v, h, grad_scale)
    return p.sub(u.mul(LambRule.step_size(h, step) * h.ratio)), m2, v2


def defined_sum(x: torch.Tensor) -> float:
    """sum x^2 in [Note: LAMB's sums]' order: chunks of 4096, 16 lanes added in index order,
    the lanes' tree, the chunks in order. Each term is exact in double; each add is one torch add."""
    terms = x.double() * x.double()
    num_chunks = -(-x.numel() // CHUNK)
    padded = torch.zeros(num_chunks * CHUNK, dtype=torch.float64)
    padded[:x.numel()] = terms  # +0 in lanes without a term adds nothing
    rows = padded.view(num_chunks, CHUNK // LANES, LANES)
    lanes = torch.zeros(num_chunks, LANES, dtype=torch.float64)
    for r in range(CHUNK // LANES):
        lanes = lanes + rows[:, r]
    width = LANES // 2
    while width:
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
        width //= 2
    total = 0.0
    for chunk in lanes[:, 0].tolist():
        total += chunk
    return total


# ---- every path, every thread count --------------------------------------------------------------

DTYPES = [(g, m, h) for g in (torch.float32, torch.bfloat16, torch.float16)
          for m in (torch.float32, torch.bfloat16) for h in (None, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 4095, 4097, 2 * 65536 + 4103])
@pytest.mark.parametrize("grad_dtype,moment_dtype,half_dtype", DTYPES,
                         ids=lambda d: str(d).removeprefix("torch."))
def test_every_path_gives_the_scalar_bits(n, grad_dtype, moment_dtype, half_dtype):
    results = {}
    for path in PATHS:
        p, g, m, v = random_case(n, 3, grad_dtype, moment_dtype)
        h = None if half_dtype is None else torch.empty(n, dtype=half_dtype)
        sums = lamb_norms(p, g, m, v, HYPER, grad_scale=0.5, simd=path, num_threads=2)
        lamb_apply(p, g, m, v, HYPER, step=3, grad_scale=0.5, half_out=h, simd=path, num_threads=2)
        results[path] = (sums, [bits(t) for t in (p, m, v, h) if t is not None])
    for path, (sums, tensors) in results.items():
        assert sums == results["scalar"][0], path
        for ours, ref in zip(tensors, results["scalar"][1]):
            assert torch.equal(ours, ref), path


@pytest.mark.parametrize("n", [1, 17, 4096, 4097, 3 * 65536 + 777])
def test_sums_are_the_defined_ones_on_every_path_and_thread_count(n):
    p, g, m, v = random_case(n, 5, torch.bfloat16)
    _, _, u = direction(p, g, m, v, HYPER, 0.25)
    expected = (defined_sum(p), defined_sum(u))
    for path in PATHS:
        for threads in (1, 2):
            assert lamb_norms(p, g, m, v, HYPER, grad_scale=0.25, simd=path, num_threads=threads) == expected, \
                (path, threads)


def test_thread_count_does_not_change_the_update():
    n = 3 * 65536 + 777
    results = []
    for threads in (1, 2):
        p, g, m, v = random_case(n, 9)
        h = torch.empty(n, dtype=torch.bfloat16)
        lamb_apply(p, g, m, v, HYPER, step=2, half_out=h, num_threads=threads)
        results.append([bits(t) for t in (p, m, v, h)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("borrow_openmp_team", [False, True])
def test_updaters_own_threads_or_torch_s_team_give_the_same_bits(borrow_openmp_team):
    n = 2 * 65536 + 5
    updater = _adam.Updater(borrow_openmp_team=borrow_openmp_team)
    p, g, m, v = random_case(n, 17)
    assert lamb_norms(p, g, m, v, HYPER, num_threads=2, updater=updater) == lamb_norms(p, g, m, v, HYPER,
                                                                                      num_threads=1)
    expected = p.clone()
    lamb_apply(expected, g, m.clone(), v.clone(), HYPER, step=1, num_threads=1)
    lamb_apply(p, g, m, v, HYPER, step=1, num_threads=2, updater=updater)
    assert torch.equal(bits(p), bits(expected))


def test_every_start_offset_gives_the_same_bits():
    """Views starting at every element of a 32-byte line (the half copy's streaming stores start
    at the next aligned vector)."""
    for offset in range(16):
        results = {}
        for path in PATHS:
            p, g, m, v = random_case(300, 13)
            h = torch.empty(300, dtype=torch.float16)
            lamb_apply(p[offset:], g[offset:], m[offset:], v[offset:], HYPER, step=1, half_out=h[offset:],
                       simd=path)
            results[path] = [bits(t) for t in (p, m, v, h[offset:])]
        for path, tensors in results.items():
            for ours, ref in zip(tensors, results["scalar"]):
                assert torch.equal(ours, ref), (offset, path)


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, denormals) plus zeros of both signs and extremes."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edge = torch.tensor([0.0, -0.0, 1e-39, -1e-39, float("inf"), -float("inf"), float("nan"), 3.4e38, 65520.0])
    out[:edge.numel()] = edge
    return out


def same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaN payloads may differ: the compiler may swap the operands of a commutative operation.
    return bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_paths_agree_on_special_values(eps):
    """Every bit pattern in p, g and the moments (NaNs, infinities, denormals, both zeros)."""
    n = 4099
    hyper = HYPER._replace(eps=eps)
    results = {}
    for path in PATHS:
        p, g = special_floats(n, 1), special_floats(n, 2)
        m, v = special_floats(n, 3), special_floats(n, 4).abs()
        h = torch.empty(n, dtype=torch.bfloat16)
        sums = torch.tensor(lamb_norms(p, g, m, v, hyper, simd=path), dtype=torch.float64)
        lamb_apply(p, g, m, v, hyper, step=1, half_out=h, simd=path)
        results[path] = (sums, p, m, v, h)
    for path, tensors in results.items():
        sums, ref_sums = tensors[0], results["scalar"][0]
        assert bool(((sums == ref_sums) | (sums.isnan() & ref_sums.isnan())).all()), path
        for ours, expected in zip(tensors[1:], results["scalar"][1:]):
            assert same_bits_or_both_nan(ours, expected), path


def test_eps_zero_short_tail_sums_only_real_elements():
    # u = 0 / (0 + 0) = NaN would appear in the lanes past the end if they were summed.
    n = 17
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = HYPER._replace(eps=0.0)
    _, _, u = direction(p, g, m, v, hyper, 1.0)
    for path in PATHS:
        assert lamb_norms(p, g, m, v, hyper, simd=path) == (defined_sum(p), defined_sum(u)), path


# ---- the torch-op order ----------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_update_is_the_torch_op_order_bit_for_bit(grad_dtype, moment_dtype, bias_correction):
    """Three steps; bf16 moments are widened, go through fp32 ops and are rounded to nearest even
    (torch's .to(bfloat16)); the half copies are torch's conversions of the new p."""
    n = 70001
    p, g, m, v = random_case(n, 21, grad_dtype, moment_dtype)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    for step in (1, 2, 3):
        hyper = HYPER._replace(ratio=0.5 + step / 7, bias_correction=bias_correction)
        halves = {dt: torch.empty(n, dtype=dt) for dt in (torch.bfloat16, torch.float16)}
        lamb_apply(p, g, m, v, hyper, step=step, grad_scale=0.7, half_out=halves[torch.bfloat16])
        new_p, new_m, new_v = applied(ref_p, g, ref_m, ref_v, hyper, step, 0.7)
        ref_p, ref_m, ref_v = new_p, new_m.to(moment_dtype), new_v.to(moment_dtype)
        assert torch.equal(bits(p), bits(ref_p)), step
        assert torch.equal(bits(m), bits(ref_m)) and torch.equal(bits(v), bits(ref_v)), step
        assert torch.equal(bits(halves[torch.bfloat16]), bits(ref_p.to(torch.bfloat16)))
    h = torch.empty(n, dtype=torch.float16)
    lamb_apply(p.clone(), g, m.clone(), v.clone(), HYPER, step=4, half_out=h)
    assert torch.equal(bits(h), bits(applied(p, g, m, v, HYPER, 4, 1.0)[0].to(torch.float16)))


def test_lamb_rule_torch_path_is_the_kernel_order(monkeypatch):
    """LambRule's torch ops (run on an accelerator) give the kernels' bits once the square root is
    correctly rounded, as an accelerator's is; the rule runs the kernels on CPU tensors."""
    n = 9000
    rule = LambRule(fmt="bf16")
    p, g, m, v = random_case(n, 31, torch.bfloat16, torch.bfloat16)
    kernel_state = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    torch_state = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    kernel_p, torch_p = p.clone(), p.clone()
    assert rule.norm_terms(kernel_p, g, kernel_state, HYPER, step=2, grad_scale=0.5) == lamb_norms(
        p, g, m, v, HYPER, grad_scale=0.5)
    rule.kernel(kernel_p, g, kernel_state, HYPER, step=2, grad_scale=0.5, half_out=None)
    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt_rn)
    rule.reference(torch_p, g, torch_state, HYPER, step=2, grad_scale=0.5)
    assert torch.equal(bits(kernel_p), bits(torch_p))
    for k in kernel_state:
        assert torch.equal(bits(kernel_state[k]), bits(torch_state[k])), k


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_lamb_rule_on_cuda_gives_the_kernel_bits(grad_dtype):
    """CUDA's division and square root are correctly rounded, so LambRule's torch ops there are
    the kernels' order exactly (checked on an H100, torch 2.11: 4M elements, every dtype)."""
    n = 70001
    rule = LambRule(fmt="bf16")
    p, g, m, v = random_case(n, 37, grad_dtype, torch.bfloat16)
    state = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    cuda_p, cuda_state = p.cuda(), {k: t.cuda() for k, t in state.items()}
    sums = rule.norm_terms(p, g, state, HYPER, step=2, grad_scale=0.5)
    assert sums == pytest.approx(rule.norm_terms(cuda_p, g.cuda(), cuda_state, HYPER, step=2, grad_scale=0.5),
                                 rel=1e-12)  # torch's reduction order is its own
    rule.kernel(p, g, state, HYPER, step=2, grad_scale=0.5, half_out=None)
    rule.reference(cuda_p, g.cuda(), cuda_state, HYPER, step=2, grad_scale=0.5)
    assert torch.equal(bits(p), bits(cuda_p.cpu()))
    for k in state:
        assert torch.equal(bits(state[k]), bits(cuda_state[k].cpu())), k


def test_cpu_lamb_step_is_the_two_kernel_passes():
    p = torch.nn.Parameter(torch.randn(5000))
    p.grad = torch.randn(5000)
    opt = CPULamb([p], lr=1e-2, eps=1e-6, weight_decay=0.01)
    expected, m, v = p.detach().clone(), torch.zeros(5000), torch.zeros(5000)
    hyper = LambHyper(1e-2, 0.9, 0.999, 1e-6, 0.01)
    w_sq, u_sq = lamb_norms(expected, p.grad, m, v, hyper)
    ratio = min(max(math.sqrt(w_sq) / math.sqrt(u_sq), 0.01), 10.0)
    lamb_apply(expected, p.grad, m, v, hyper._replace(ratio=ratio), step=1)
    opt.step()
    assert torch.equal(bits(p.detach()), bits(expected))
    assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_empty_call():
    empty = torch.zeros(0)
    assert lamb_norms(empty, empty, empty, empty, HYPER) == (0.0, 0.0)
    lamb_apply(empty, empty, empty, empty, HYPER, step=1)


# ---- the tests would catch a broken kernel ----------------------------------------------------------


def test_plausible_mistakes_change_the_bits():
    """Each comparison above is bit for bit, and these plausible variants of the order differ
    from the kernel's bits on the data of the tests, each where it would show: in the stored
    moment, in the sum of u^2 (an error in u hardly moves p, scaled by the step size), in p."""
    n = 70001
    p, g, m, v = random_case(n, 21)
    new_p, new_m = p.clone(), m.clone()
    _, u_sq = lamb_norms(p, g, m, v, HYPER)
    lamb_apply(new_p, g, new_m, v.clone(), HYPER, step=3)
    m2, v2, u = direction(p, g, m, v, HYPER, 1.0)
    beta1 = torch.tensor(HYPER.beta1).float().item()
    fused_m = (m.double() * beta1 + g.mul(1 - HYPER.beta1).double()).float()  # fma(m, beta1, g (1 - beta1))
    assert not torch.equal(bits(new_m), bits(fused_m))
    d = sqrt_rn(v2).add_(HYPER.eps)
    for name, wrong_u in {"fused u": m2.div(d).add_(p, alpha=HYPER.weight_decay),  # fma(wd, p, m' / d) on the CPU
                          "torch's sqrt": m2.div(v2.sqrt().add_(HYPER.eps)).add_(p.mul(HYPER.weight_decay)),
                          "reciprocal": m2.mul(d.reciprocal()).add_(p.mul(HYPER.weight_decay))}.items():
        assert u_sq != defined_sum(wrong_u), name
    size = LambRule.step_size(HYPER, 3)
    rounded_apart = p.sub(u.mul(torch.tensor(size).float().item()).mul(HYPER.ratio))  # float(size) * u * ratio
    assert not torch.equal(bits(new_p), bits(rounded_apart))
    sequential = 0.0
    for x in (p.double() * p.double()).tolist():
        sequential += x
    assert lamb_norms(p, g, m, v, HYPER)[0] != sequential  # one accumulator in index order


# ---- arguments ----------------------------------------------------------------------------------------


def call_args(n: int = 100) -> dict:
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize("name,value,error,match", [
    ("param", torch.zeros(100, dtype=torch.bfloat16), TypeError, "lamb_apply: param must have dtype"),
    ("param", torch.zeros(100, device="meta"), TypeError, "param must be a CPU tensor"),
    ("grad", torch.zeros(200)[::2], ValueError, "grad must be contiguous"),
    ("grad", torch.zeros(100, dtype=torch.float64), TypeError, "grad must have dtype"),
    ("exp_avg", torch.zeros(100, dtype=torch.float16), TypeError, "exp_avg must have dtype"),
    ("exp_avg", torch.zeros(100, dtype=torch.bfloat16), TypeError, "moments must share one dtype"),
    ("exp_avg_sq", torch.zeros(99), ValueError, "exp_avg_sq has 99 elements"),
    ("exp_avg_sq", [0.0] * 100, TypeError, "exp_avg_sq must be a torch.Tensor"),
    ("half_out", torch.zeros(100), TypeError, "half_out must have dtype"),
    ("half_out", torch.zeros(101, dtype=torch.bfloat16), ValueError, "half_out has 101"),
])
def test_bad_tensor_names_the_argument(name, value, error, match):
    args = call_args()
    args[name] = value
    with pytest.raises(error, match=match):
        lamb_apply(**args, hyper=HYPER, step=1)
    if name != "half_out":
        args.pop("half_out", None)
        with pytest.raises(error, match=match.replace("lamb_apply", "lamb_norms")):
            lamb_norms(**args, hyper=HYPER)


@pytest.mark.parametrize("change,match", [
    (dict(lr=-1.0), "lamb_apply: invalid lr"),
    (dict(beta1=1.0), r"invalid beta1 \(betas\[0\]\)"),
    (dict(beta2=-0.1), r"invalid beta2 \(betas\[1\]\)"),
    (dict(eps=-1e-8), "invalid eps"),
    (dict(weight_decay=float("nan")), "invalid weight_decay"),
    (dict(ratio=-1.0), "invalid ratio"),
])
def test_bad_hyper_parameter_names_it(change, match):
    with pytest.raises(ValueError, match=match):
        lamb_apply(**call_args(), hyper=HYPER._replace(**change), step=1)


@pytest.mark.parametrize("step,error", [(0, ValueError), (1.5, TypeError)])
def test_bad_step(step, error):
    with pytest.raises(error, match="lamb_apply: step must"):
        lamb_apply(**call_args(), hyper=HYPER, step=step)


def test_unknown_simd_path_and_null_buffers_raise():
    with pytest.raises(ValueError, match="simd=sse9: unknown SIMD path"):
        lamb_norms(**call_args(), hyper=HYPER, simd="sse9")
    updater = _adam.Updater()
    with pytest.raises(ValueError, match="lamb: param, grad, exp_avg and exp_avg_sq are required"):
        _adam.lamb_norms(updater, 0, 0, 0, 0, 10, _adam.DType.float32, beta1=0.9, beta2=0.999, eps=1e-6,
                         weight_decay=0.0)
    p = torch.zeros(10)
    with pytest.raises(ValueError, match="lamb: half_out is required"):
        _adam.lamb_apply(updater, *(p.data_ptr(),) * 4, 10, _adam.DType.float32, half_dtype=_adam.DType.bfloat16,
                         lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)
