"""CPU Adagrad and Lion, and bf16 moments for every rule (infinity.optim, infinity._adam).

References: torch.optim.Adagrad(fused=True) for Adagrad (the path whose arithmetic the kernel
has, [Note: Adagrad and Lion arithmetic] in csrc/adam/adam.h), torch ops in the Note's order
for Lion, and for bf16 moments the same references run on `moment.float()` and rounded back
with `.to(torch.bfloat16)`. All comparisons are of bits unless a test says why not.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from infinity import _adam
from infinity.optim import (CPUAdagrad, CPUAdam, CPULion, DeepSpeedCPUAdagrad, DeepSpeedCPULion, adagrad_update,
                            adam_update, available_simd_paths, lion_update)
from infinity.optim.cpu_lamb import CPULamb
from infinity.optim.formats import FORMATS
from infinity.optim.functional import AdagradHyper, LionHyper, adagrad_step, kernel_job, lion_step, prefetch_distance

ALL_PATHS = ["scalar", "avx2", "avx512"]
ADAGRAD = dict(lr=0.1, eps=1e-10, weight_decay=0.1, lr_decay=0.01)
LION = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Around the vector widths (8, 16), a slice alignment (64) and the one-thread minimum (65536).
LENGTHS = [1, 7, 17, 4099, 65536 + 5]


@pytest.fixture(params=ALL_PATHS)
def simd(request, monkeypatch):
    """Each SIMD path this machine has, forced through INFINITY_SIMD."""
    if request.param not in available_simd_paths():
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("INFINITY_SIMD", request.param)
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a.detach()), bits(b.detach()))


def all_same_bits(xs, ys) -> bool:
    return all(same_bits(x, y) for x, y in zip(xs, ys, strict=True))


def randn(n: int, gen: torch.Generator, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(n, generator=gen) * scale).to(dtype)


# --- references --------------------------------------------------------------------------------

def torch_adagrad(p, g, s, *, step, lr, eps, weight_decay, lr_decay):
    """torch.optim.Adagrad(fused=True)'s step `step` on p and s in place (s upcast and rounded
    back when bf16)."""
    wide = s.float()
    param = torch.nn.Parameter(p)  # shares p's memory
    opt = torch.optim.Adagrad([param], lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay, fused=True)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "sum": wide}
    param.grad = g.float()
    opt.step()
    s.copy_(wide)


def lion_reference(p, g, m, *, lr, beta1, beta2, weight_decay):
    """Lion in torch ops, in the order of [Note: Adagrad and Lion arithmetic]; m upcast and
    rounded back when bf16."""
    wide, g = m.float(), g.float()
    c = wide.lerp(g, 1 - beta1)
    p.mul_(1 - lr * weight_decay).add_(c.sign(), alpha=-lr)
    wide.lerp_(g, 1 - beta2)
    m.copy_(wide)


def lion_reference_moment_first(p, g, m, *, lr, beta1, beta2, weight_decay):
    """A wrong order (momentum first), to show that the tests tell orders apart."""
    m.lerp_(g, 1 - beta2)
    p.mul_(1 - lr * weight_decay).add_(m.lerp(g, 1 - beta1).sign(), alpha=-lr)


# --- Adagrad -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("weight_decay,lr_decay", [(0.0, 0.0), (0.1, 0.01)])
def test_adagrad_is_torch_fused_bit_for_bit(simd, n, weight_decay, lr_decay):
    gen = torch.Generator().manual_seed(n)
    hyper = dict(ADAGRAD, weight_decay=weight_decay, lr_decay=lr_decay)
    p = randn(n, gen)
    s = torch.full((n,), 0.1)
    rp, rs = p.clone(), s.clone()
    for step in range(1, 6):
        g = randn(n, gen)
        adagrad_update(p, g, s, step=step, num_threads=2, **hyper)
        torch_adagrad(rp, g, rs, step=step, **hyper)
    assert same_bits(p, rp) and same_bits(s, rs)


def test_adagrad_is_within_the_last_bit_of_torchs_default_path():
    """torch's default (single-tensor) path takes its sqrt from MKL, not correctly rounded: after
    20 steps params differ by at most one ulp of the largest param, sums by one ulp each."""
    gen = torch.Generator().manual_seed(3)
    p = randn(65536, gen)
    ref = torch.nn.Parameter(p.clone())
    s = torch.zeros_like(p)
    opt = torch.optim.Adagrad([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(1, 21):
        g = randn(65536, gen)
        adagrad_update(p, g, s, step=step, lr=1e-2, eps=1e-10, weight_decay=0.01)
        ref.grad = g
        opt.step()
    assert (p - ref.detach()).abs().max() <= 2**-23 * ref.detach().abs().max()
    torch.testing.assert_close(s, opt.state[ref]["sum"], rtol=2**-23, atol=0)


# --- Lion --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.3, 0.6)])  # lerp's two branches (1 - beta < 0.5 or not)
def test_lion_is_its_torch_ops_reference(simd, n, betas):
    gen = torch.Generator().manual_seed(n)
    hyper = dict(LION, beta1=betas[0], beta2=betas[1])
    p, m = randn(n, gen), randn(n, gen, 0.1)
    m[::5] = 0.0  # zero directions where the gradient is zero too: sign(0) = 0
    rp, rm, wp, wm = p.clone(), m.clone(), p.clone(), m.clone()
    for _ in range(3):
        g = randn(n, gen)
        g[::5] = 0.0
        lion_update(p, g, m, num_threads=2, **hyper)
        lion_reference(rp, g, rm, **hyper)
        lion_reference_moment_first(wp, g, wm, **hyper)
    assert same_bits(p, rp) and same_bits(m, rm)
    if n > 100:  # the reference is sharp: another order gives other bits
        assert not same_bits(p, wp)


def test_lion_sign_of_zero_and_nan_is_zero():
    """Zero and NaN directions leave the param as it is (as torch.sign: 0); NaN stays in exp_avg."""
    p = torch.tensor([1.5, -2.0, 0.0, -0.0, 3.0] * 4)
    m = torch.zeros(20)
    g = torch.tensor([0.0, -0.0, 0.0, 0.0, float("nan")] * 4)
    before = p.clone()
    lion_update(p, g, m, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0)
    assert same_bits(p, before)
    assert m[4::5].isnan().all() and not m[:4].isnan().any()


def test_step_functions_take_the_hyper_tuples():  # the engine's calls
    gen = torch.Generator().manual_seed(5)
    p, g, m = randn(1000, gen), randn(1000, gen), randn(1000, gen).abs()
    p2, m2 = p.clone(), m.clone()
    adagrad_step(p, g, m, AdagradHyper(0.1, 1e-10, 0.1, 0.01), step=3, grad_scale=0.5)
    adagrad_update(p2, g, m2, step=3, grad_scale=0.5, **ADAGRAD)
    lion_step(p, g, m, LionHyper(1e-2, 0.9, 0.99, 0.1), step=7, grad_scale=0.25)
    lion_update(p2, g, m2, grad_scale=0.25, **LION)
    assert same_bits(p, p2) and same_bits(m, m2)
    with pytest.raises(ValueError, match="lion_step: step must be >= 1"):
        lion_step(p, g, m, LionHyper(1e-2, 0.9, 0.99, 0.1), step=0)


# --- what every rule shares: SIMD paths, gradient dtypes, half output, ranges, grad_scale -------

def run_rule(rule: str, p, g, moments, **kw):
    if rule == "adam":
        adam_update(p, g, *moments, step=kw.pop("step", 3), **ADAM, **kw)
    elif rule == "adagrad":
        adagrad_update(p, g, *moments, step=kw.pop("step", 3), **ADAGRAD, **kw)
    else:
        kw.pop("step", None)
        lion_update(p, g, *moments, **LION, **kw)


def rule_case(rule: str, n: int, seed: int, grad_dtype=torch.float32, moment_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p, g = randn(n, gen), randn(n, gen, dtype=grad_dtype)
    if rule == "adam":
        moments = [randn(n, gen, 0.1), torch.rand(n, generator=gen) * 0.01]
    elif rule == "adagrad":
        moments = [torch.rand(n, generator=gen)]
    else:
        moments = [randn(n, gen, 0.1)]
    return p, g, [m.to(moment_dtype) for m in moments]


RULES = ["adam", "adagrad", "lion"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("grad_dtype,half_dtype,moment_dtype", [
    (torch.float32, None, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.float32),
    (torch.float32, torch.bfloat16, torch.bfloat16),
])
def test_simd_paths_give_the_same_bits(rule, grad_dtype, half_dtype, moment_dtype):
    for n in (17, 4099):
        results = {}
        for path in available_simd_paths():
            p, g, moments = rule_case(rule, n, 7, grad_dtype, moment_dtype)
            h = None if half_dtype is None else torch.empty(n, dtype=half_dtype)
            for step in (1, 2):
                run_rule(rule, p, g, moments, step=step, half_out=h, grad_scale=0.5, simd=path, num_threads=2)
            results[path] = [bits(t) for t in [p, *moments, h] if t is not None]
        for path, tensors in results.items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, results["scalar"])), (path, n)


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, denormals) and the bf16 rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edge = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 3e-40, float("inf"), -float("inf"), float("nan"), 3.4e38,
                         1.00390625, 1.01171875, 1.0000001])
    out[:edge.numel()] = edge
    return out


@pytest.mark.parametrize("rule", RULES)
def test_simd_paths_agree_on_special_values_with_bf16_moments(rule):
    n = 4099
    results = {}
    for path in available_simd_paths():
        p = special_floats(n, 11)
        moments = [special_floats(n, 13 + i).to(torch.bfloat16) for i in range(2 if rule == "adam" else 1)]
        if rule != "lion":  # a second moment is a sum of squares: keep its sign bit clear
            moments[-1] = moments[-1].abs()
        h = torch.empty(n, dtype=torch.bfloat16)
        run_rule(rule, p, special_floats(n, 17), moments, half_out=h, simd=path)
        results[path] = [p, *moments, h]
    for path, tensors in results.items():
        for ours, ref in zip(tensors, results["scalar"]):
            both_nan = ours.float().isnan() & ref.float().isnan()  # payloads may differ
            assert bool(((bits(ours) == bits(ref)) | both_nan).all()), path


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("grad_dtype,half_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                                   (torch.float16, torch.bfloat16)])
def test_half_gradient_grad_scale_and_half_copy_in_one_pass(simd, rule, grad_dtype, half_dtype):
    """The engine's update (a half gradient widened exactly, unscaled, the step, the half copy)
    in one pass against separate passes."""
    p, g, moments = rule_case(rule, 70001, 23, grad_dtype)
    p2, moments2 = p.clone(), [m.clone() for m in moments]
    h = torch.empty(p.numel(), dtype=half_dtype)
    run_rule(rule, p, g, moments, grad_scale=0.37, half_out=h)
    run_rule(rule, p2, g.float() * 0.37, moments2)
    assert all_same_bits([p, *moments, h], [p2, *moments2, p2.to(half_dtype)])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_offset_count_updates_only_that_range(rule, moment_dtype):
    """Ranges that start anywhere (the moments' element size is 2 or 4 bytes) give the bits of
    one call over the whole, and touch nothing outside."""
    n, k = 200003, 70001
    p, g, moments = rule_case(rule, n, 29, torch.bfloat16, moment_dtype)
    whole_p, whole_m = p.clone(), [m.clone() for m in moments]
    h, whole_h = torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.float16)
    run_rule(rule, whole_p, g, whole_m, half_out=whole_h)
    before = [t.clone() for t in [p, *moments]]
    run_rule(rule, p, g, moments, half_out=h, offset=k, count=1000)
    for now, old, whole in zip([p, *moments], before, [whole_p, *whole_m]):
        assert same_bits(now[k:k + 1000], whole[k:k + 1000])
        assert same_bits(now[:k], old[:k]) and same_bits(now[k + 1000:], old[k + 1000:])
    run_rule(rule, p, g, moments, half_out=h, offset=0, count=k)
    run_rule(rule, p, g, moments, half_out=h, offset=k + 1000)
    assert all_same_bits([p, *moments, h], [whole_p, *whole_m, whole_h])


@pytest.mark.parametrize("num_threads", [1, 3])
def test_one_batch_of_every_rule_equals_one_call_per_tensor(num_threads):
    """update_many takes jobs of different rules and moment dtypes in one parallel region; each
    element gets the bits of its own job."""
    hypers = {"adam": _adam.HyperParams(**ADAM, step=2),
              "adagrad": _adam.HyperParams(**ADAGRAD, step=2, rule=_adam.Rule.adagrad),
              "lion": _adam.HyperParams(**LION, rule=_adam.Rule.lion)}
    cases = [(rule, *rule_case(rule, n, 50 + i, torch.bfloat16, dtype))
             for i, (rule, n, dtype) in enumerate([("adam", 70001, torch.bfloat16), ("lion", 63, torch.float32),
                                                   ("adagrad", 131072, torch.bfloat16), ("lion", 65541, torch.bfloat16),
                                                   ("adagrad", 0, torch.float32)])]
    expected = []
    for rule, p, g, moments in cases:
        p, moments = p.clone(), [m.clone() for m in moments]
        run_rule(rule, p, g, moments, step=2, num_threads=1)
        expected.append([p, *moments])
    jobs = []
    for rule, p, g, moments in cases:
        exp_avg = None if rule == "adagrad" else moments[0]
        exp_avg_sq = {"adam": moments[-1], "adagrad": moments[0], "lion": None}[rule]
        jobs.append(kernel_job(hypers[rule], p, g, exp_avg, exp_avg_sq, half_out=None, offset=0, count=p.numel()))
    _adam.Updater().update_many(jobs, num_threads=num_threads)
    for (rule, p, g, moments), want in zip(cases, expected):
        assert all_same_bits([p, *moments], want), rule


# --- bf16 moments ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [16, 4099, 65536 + 5])
def test_bf16_moments_are_the_upcast_reference_rounded(simd, n):
    """Each rule with bf16 moments against its reference run on moment.float() and rounded back
    by torch; Adam's reference is torch's fused AdamW, whose scalar tail rounds differently
    ([Note: exact parity with torch] in csrc/adam/adam.h), so Adam's length is whole vectors."""
    gen = torch.Generator().manual_seed(n)
    p, s = randn(n, gen), torch.rand(n, generator=gen).to(torch.bfloat16)
    rp, rs = p.clone(), s.clone()
    for step in range(1, 4):
        g = randn(n, gen)
        adagrad_update(p, g, s, step=step, **ADAGRAD)
        torch_adagrad(rp, g, rs, step=step, **ADAGRAD)
    assert same_bits(p, rp) and same_bits(s, rs)

    p, m = randn(n, gen), randn(n, gen, 0.1, torch.bfloat16)
    rp, rm, unrounded = p.clone(), m.clone(), m.float()
    for _ in range(3):
        g = randn(n, gen)
        lion_update(p, g, m, **LION)
        lion_reference(rp, g, rm, **LION)
    assert same_bits(p, rp) and same_bits(m, rm)
    lion_reference(torch.zeros(n), g, unrounded, **LION)  # the reference is sharp: no rounding
    assert not same_bits(m.float(), unrounded)

    n16 = n - n % 16
    p = torch.nn.Parameter(randn(n16, gen))
    m, v = randn(n16, gen, 0.1, torch.bfloat16), (torch.rand(n16, generator=gen) * 0.01).to(torch.bfloat16)
    ref = torch.nn.Parameter(p.detach().clone())
    wide = {"step": torch.tensor(0.0), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    opt = torch.optim.AdamW([ref], lr=ADAM["lr"], weight_decay=ADAM["weight_decay"], fused=True)
    opt.state[ref] = wide
    for step in range(1, 4):
        ref.grad = randn(n16, gen)
        adam_update(p.detach(), ref.grad, m, v, step=step, **ADAM)
        opt.step()
        for key in ("exp_avg", "exp_avg_sq"):  # the state the kernel keeps between steps
            wide[key].copy_(wide[key].to(torch.bfloat16))
    assert all_same_bits([p, m, v], [ref, wide["exp_avg"].to(torch.bfloat16), wide["exp_avg_sq"].to(torch.bfloat16)])


@pytest.mark.parametrize("rule", RULES)
def test_bf16_moments_are_the_fp32_kernel_rounded_on_special_values(simd, rule):
    """On any bits (NaN, infinities, denormals, bf16 rounding ties), a bf16-moment update is the
    fp32-moment update of the widened moments, rounded as torch's .to(torch.bfloat16) rounds."""
    n = 4099
    p = special_floats(n, 31)
    g = special_floats(n, 37)
    moments = [special_floats(n, 41 + i).to(torch.bfloat16) for i in range(2 if rule == "adam" else 1)]
    p2, moments2 = p.clone(), [m.float() for m in moments]
    run_rule(rule, p, g, moments)
    run_rule(rule, p2, g, moments2)
    both_nan = p.isnan() & p2.isnan()
    assert bool(((bits(p) == bits(p2)) | both_nan).all())
    for ours, wide in zip(moments, moments2):
        assert same_bits(ours, wide.to(torch.bfloat16))


# --- optimizer classes -------------------------------------------------------------------------

SHAPES = [(1,), (17,), (4099,), (37, 53)]


class Run:
    """Parameters of SHAPES in two param groups and one fixed stream of gradients."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        self.gen = torch.Generator().manual_seed(seed + 1)

    def groups(self, **second) -> list[dict]:
        return [{"params": self.params[:2]}, {"params": self.params[2:], **second}]

    def steps(self, opt, num_steps: int) -> None:
        for _ in range(num_steps):
            for p in self.params:
                p.grad = torch.randn(p.shape, generator=self.gen)
            opt.step()


def save_and_load(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


ADAGRAD_ARGS = dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)
SECOND_GROUP = dict(lr=0.02, lr_decay=0.0, weight_decay=0.0, eps=1e-8)


def test_cpu_adagrad_steps_as_torch_adagrad_fused():
    ours, ref = Run(), Run()
    opt = CPUAdagrad(ours.groups(**SECOND_GROUP), **ADAGRAD_ARGS)
    ref_opt = torch.optim.Adagrad(ref.groups(**SECOND_GROUP), **ADAGRAD_ARGS, fused=True)
    ours.steps(opt, 10)
    ref.steps(ref_opt, 10)
    assert all_same_bits(ours.params, ref.params)
    assert all_same_bits([opt.state[a]["sum"] for a in ours.params], [ref_opt.state[b]["sum"] for b in ref.params])
    assert opt.state[ours.params[0]]["step"].item() == 10.0


def test_a_groups_own_initial_accumulator_value_starts_its_sum():
    """torch's Adagrad starts every group's sum at the constructor's value; ours at the group's."""
    run = Run()
    opt = CPUAdagrad(run.groups(initial_accumulator_value=0.5), initial_accumulator_value=0.1)
    run.steps(opt, 1)
    sums = [opt.state[p]["sum"] - p.grad * p.grad for p in run.params]
    torch.testing.assert_close(sums[0], torch.full_like(sums[0], 0.1))
    torch.testing.assert_close(sums[-1], torch.full_like(sums[-1], 0.5))


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_cpu_adagrad_state_dict_moves_to_and_from_torch(direction):
    """5 steps with one, the state dict saved and loaded into the other, 5 more: the bits of 10
    steps of torch's fused Adagrad."""
    straight, resumed = Run(), Run()
    straight.steps(torch.optim.Adagrad(straight.groups(**SECOND_GROUP), **ADAGRAD_ARGS, fused=True), 10)
    ours = CPUAdagrad(resumed.groups(**SECOND_GROUP), **ADAGRAD_ARGS)
    theirs = torch.optim.Adagrad(resumed.groups(**SECOND_GROUP), **ADAGRAD_ARGS, fused=True)
    first, second = (ours, theirs) if direction == "ours_to_torch" else (theirs, ours)
    resumed.steps(first, 5)
    state = save_and_load(first.state_dict())
    assert set(state["state"][0]) == {"step", "sum"}
    second.load_state_dict(state)
    for group in second.param_groups:
        group["fused"] = True  # a group saved by ours has no "fused" key: torch would take its default path
    resumed.steps(second, 5)
    assert all_same_bits(resumed.params, straight.params)


def test_deepspeed_cpu_adagrad_takes_deepspeeds_arguments_and_state():
    a, b = Run(), Run()
    # DeepSpeed's order: model_params, lr, eps, weight_decay, amsgrad, fp32_optimizer_states
    ds = DeepSpeedCPUAdagrad(a.groups(), 0.05, 1e-10, 0.01, False, True)
    ours = CPUAdagrad(b.groups(), lr=0.05, weight_decay=0.01)
    a.steps(ds, 3)
    b.steps(ours, 3)
    assert all_same_bits(a.params, b.params)
    # A state as DeepSpeed saves it: the sum named exp_avg_sq, an int step.
    state = ds.state_dict()
    for s in state["state"].values():
        s["exp_avg_sq"], s["step"] = s.pop("sum"), int(s["step"])
    ds.load_state_dict(state)
    a.steps(ds, 2)
    b.steps(ours, 2)
    assert all_same_bits(a.params, b.params)
    assert ds.state[a.params[0]]["step"].item() == 5.0


def lion_run_reference(run: Run, num_steps: int, groups: list[dict], moment_dtype=torch.float32) -> None:
    moments = {p: torch.zeros(p.shape, dtype=moment_dtype) for p in run.params}
    for _ in range(num_steps):
        for p in run.params:
            p.grad = torch.randn(p.shape, generator=run.gen)
        for group in groups:
            hyper = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                         weight_decay=group["weight_decay"])
            for p in group["params"]:
                lion_reference(p.detach().view(-1), p.grad.view(-1), moments[p].view(-1), **hyper)


@pytest.mark.parametrize("fp32_optimizer_states", [True, False])
def test_cpu_lion_steps_as_its_reference(fp32_optimizer_states):
    ours, ref = Run(), Run()
    second = dict(lr=3e-3, betas=(0.5, 0.9), weight_decay=0.0)
    opt = CPULion(ours.groups(**second), lr=1e-2, weight_decay=0.1, fp32_optimizer_states=fp32_optimizer_states)
    ours.steps(opt, 5)
    dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
    lion_run_reference(ref, 5, [dict(params=ref.params[:2], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
                                dict(params=ref.params[2:], **second)], dtype)
    assert all_same_bits(ours.params, ref.params)
    assert {opt.state[p]["exp_avg"].dtype for p in ours.params} == {dtype}


def test_deepspeed_cpu_lion_takes_deepspeeds_arguments():
    a, b = Run(), Run()
    ds = DeepSpeedCPULion(a.groups(), 1e-3, (0.9, 0.999), 0.01, True)  # DeepSpeed's order
    a.steps(ds, 3)
    b.steps(CPULion(b.groups(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), 3)
    assert all_same_bits(a.params, b.params)
    assert DeepSpeedCPULion(a.params).defaults["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("cls,kwargs,keys", [
    (CPUAdam, dict(lr=1e-2, weight_decay=0.01), ("exp_avg", "exp_avg_sq")),
    (CPUAdagrad, ADAGRAD_ARGS, ("sum",)),
    (CPULion, dict(lr=1e-3), ("exp_avg",)),
])
def test_bf16_state_resumes_exactly(cls, kwargs, keys):
    """fp32_optimizer_states=False: bf16 moments, in the optimizer and its state dict. torch's
    load_state_dict casts them to the parameter's dtype (fp32); they go back to bf16, exactly, at
    the next step, so 3 + 3 steps are the bits of 6."""
    straight, resumed = Run(), Run()
    straight.steps(cls(straight.groups(), **kwargs, fp32_optimizer_states=False), 6)
    opt = cls(resumed.groups(), **kwargs, fp32_optimizer_states=False)
    resumed.steps(opt, 3)
    state = save_and_load(opt.state_dict())
    assert all(state["state"][0][k].dtype == torch.bfloat16 for k in keys)
    opt = cls(resumed.groups(), **kwargs, fp32_optimizer_states=False)
    opt.load_state_dict(state)
    assert opt.state[resumed.params[0]][keys[0]].dtype == torch.float32  # torch's cast
    resumed.steps(opt, 3)
    assert opt.state[resumed.params[0]][keys[0]].dtype == torch.bfloat16
    assert all_same_bits(resumed.params, straight.params)


def test_cpu_adam_with_bf16_moments_is_adam_update_with_bf16_moments():
    run = Run()
    opt = CPUAdam(run.groups(), lr=1e-2, weight_decay=0.01, fp32_optimizer_states=False)
    assert opt.defaults["fp32_optimizer_states"] is False and not opt.fp32_optimizer_states
    starts = [p.detach().clone().view(-1) for p in run.params]
    run.steps(opt, 1)
    for p, start in zip(run.params, starts):
        m, v = torch.zeros_like(start, dtype=torch.bfloat16), torch.zeros_like(start, dtype=torch.bfloat16)
        adam_update(start, p.grad.view(-1), m, v, step=1, **ADAM)
        assert all_same_bits([p.view(-1), opt.state[p]["exp_avg"].view(-1), opt.state[p]["exp_avg_sq"].view(-1)],
                             [start, m, v])


# --- errors ------------------------------------------------------------------------------------

def update_args(rule: str, n: int = 100) -> dict:
    names = {"adagrad": ["exp_avg_sq"], "lion": ["exp_avg"]}[rule]
    return dict(param=torch.zeros(n), grad=torch.zeros(n), **{name: torch.zeros(n) for name in names})


def call(rule: str, args: dict, **kw) -> None:
    if rule == "adagrad":
        adagrad_update(**args, **{"step": 1, **ADAGRAD, **kw})
    else:
        lion_update(**args, **{**LION, **kw})


@pytest.mark.parametrize("rule", ["adagrad", "lion"])
@pytest.mark.parametrize("name,value,error,match", [
    ("param", torch.zeros(100, dtype=torch.bfloat16), TypeError, "must have dtype"),
    ("grad", torch.zeros(200)[::2], ValueError, "must be contiguous"),
    ("moment", torch.zeros(100, dtype=torch.float16), TypeError, "must have dtype"),
    ("moment", torch.zeros(99), ValueError, "has 99 elements"),
    ("half_out", torch.zeros(100), TypeError, "must have dtype"),
    ("grad", [0.0] * 100, TypeError, "must be a torch.Tensor"),
])
def test_bad_tensor_names_the_argument(rule, name, value, error, match):
    args = update_args(rule)
    key = next(k for k in args if k.startswith("exp_avg")) if name == "moment" else name
    args[key] = value
    with pytest.raises(error, match=f"{rule}_update: {key} {match}"):
        call(rule, args)


@pytest.mark.parametrize("rule,kwargs,match", [
    ("adagrad", dict(lr=-1.0), "adagrad_update: invalid lr"),
    ("adagrad", dict(lr_decay=-0.1), "invalid lr_decay"),
    ("adagrad", dict(eps=-1.0), "invalid eps"),
    ("adagrad", dict(weight_decay=float("nan")), "invalid weight_decay"),
    ("adagrad", dict(step=0), "step must be >= 1"),
    ("adagrad", dict(offset=50, count=51), "offset=50, count=51"),
    ("lion", dict(beta1=1.5), "lion_update: invalid beta1"),
    ("lion", dict(beta2=-0.1), "invalid beta2"),
    ("lion", dict(weight_decay=-1.0), "invalid weight_decay"),
    ("lion", dict(offset=-1), "offset=-1"),
])
def test_bad_hyper_parameter_or_range_names_it(rule, kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(rule, update_args(rule), **kwargs)


@pytest.mark.parametrize("make,match", [
    (lambda ps: CPUAdagrad(ps, lr=-1.0), "CPUAdagrad: invalid lr"),
    (lambda ps: CPUAdagrad(ps, initial_accumulator_value=-1.0), "invalid initial_accumulator_value"),
    (lambda ps: CPUAdagrad(ps, lr_decay=-1.0), "invalid lr_decay"),
    (lambda ps: CPULion(ps, betas=(1.5, 0.9)), "CPULion: invalid beta1"),
    (lambda ps: CPULion(ps, betas=(0.9,)), "betas must be a pair"),
    (lambda ps: CPULion(ps, num_threads=0), "num_threads must be >= 1"),
    (lambda ps: DeepSpeedCPULion(ps, weight_decay=-1.0), "invalid weight_decay"),
])
def test_bad_constructor_argument_names_it(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.zeros(3))])


def test_maximize_from_a_torch_state_dict_raises():
    params = [torch.nn.Parameter(torch.zeros(3))]
    state = torch.optim.Adagrad(params, maximize=True).state_dict()
    with pytest.raises(ValueError, match="CPUAdagrad: maximize"):
        CPUAdagrad(params).load_state_dict(state)


def test_a_job_without_the_moment_its_rule_needs_raises():
    p = torch.zeros(8)
    lion = _adam.HyperParams(lr=1e-3, rule=_adam.Rule.lion)
    with pytest.raises(ValueError, match="this rule needs exp_avg"):
        _adam.Job(lion, p.data_ptr(), p.data_ptr(), 0, p.data_ptr(), 8, _adam.DType.float32)
    with pytest.raises(ValueError, match="moment_dtype must be float32, bfloat16 or e4m3_block"):
        _adam.Job(lion, p.data_ptr(), p.data_ptr(), p.data_ptr(), 0, 8, _adam.DType.float32,
                  moment_dtype=_adam.DType.float16)
    with pytest.raises(ValueError, match="e4m3_block moments need their scales"):
        _adam.Job(lion, p.data_ptr(), p.data_ptr(), p.data_ptr(), 0, 8, _adam.DType.float32,
                  moment_dtype=_adam.DType.e4m3_block)


# --- the prefetch distance -----------------------------------------------------------------------

DISTANCES = [0, 64, 384, 1536, 1 << 16]  # none, one line, the default, the former one, past any array


@pytest.fixture
def restore_prefetch_distance():
    before = prefetch_distance()
    yield
    prefetch_distance(before)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
def test_the_prefetch_distance_does_not_change_the_bits(simd, moments, restore_prefetch_distance):
    """Every rule's kernel, LAMB's two passes included, on every path, in each moment format
    (8-bit for the rules that have it): the same bits at every distance, 0 (no prefetch) too."""
    n = 3 * 65536 + 77  # several threads' chunks and a partial block at the end
    gen = torch.Generator().manual_seed(11)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    results = []
    for distance in DISTANCES:
        assert prefetch_distance(distance) == distance
        out = []
        for rule, update in (("adam", adam_update), ("adagrad", adagrad_update), ("lion", lion_update)):
            p, half = p0.clone(), torch.empty(n, dtype=torch.bfloat16)
            kinds = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("exp_avg_sq",), "lion": ("exp_avg",)}[rule]
            if moments == "8bit":
                stored = [FORMATS["8bit"].encode(torch.full((n,), 1e-3), kind) for kind in kinds]
                kw = dict(moment_format="8bit")
            else:
                dtype = torch.float32 if moments == "fp32" else torch.bfloat16
                stored, kw = [torch.full((n,), 1e-3, dtype=dtype) for _ in kinds], {}
            hyper = {"adam": ADAM, "adagrad": ADAGRAD, "lion": LION}[rule]
            for step in (1, 2):
                update(p, g, *stored, half_out=half, num_threads=2, **({"step": step} if rule != "lion" else {}),
                       **hyper, **kw)
            if moments == "8bit":  # codes and scales; the padding between them is never written
                stored = [part for x in stored for part in (x[:n], x[FORMATS["8bit"].scales_offset(n):])]
            out += [p, half, *stored]
        if moments != "8bit":
            lamb = CPULamb([torch.nn.Parameter(p0.clone())], lr=1e-2, weight_decay=0.01,
                           fp32_optimizer_states=moments == "fp32")
            lamb.param_groups[0]["params"][0].grad = g.float()
            lamb.step()
            lamb.step()
            out.append(lamb.param_groups[0]["params"][0].detach())
        results.append(out)
    for distance, out in zip(DISTANCES[1:], results[1:]):
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(out, results[0])), distance


def test_a_bad_prefetch_distance_names_itself(restore_prefetch_distance):
    for bad in (-4, 3, (1 << 16) + 4, "384", 1.5, True):
        with pytest.raises(ValueError, match="bytes_ahead must be a whole number of bytes"):
            prefetch_distance(bad)
    assert prefetch_distance(256) == 256


@pytest.mark.parametrize("value,expected", [("1024", "1024"), ("0", "0"), ("12x", "INFINITY_PREFETCH_BYTES must be")])
def test_the_prefetch_distance_from_the_environment(value, expected, tmp_path):
    out = subprocess.run([sys.executable, "-c", "from infinity.optim.functional import prefetch_distance as d; print(d())"],
                         env={**os.environ, "INFINITY_PREFETCH_BYTES": value}, capture_output=True, text=True,
                         cwd=tmp_path, check=False)
    assert expected in out.stdout + out.stderr
