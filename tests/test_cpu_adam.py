"""CPU Adam (infinity.optim, infinity._adam): parity with torch, SIMD paths, half output, state.

"Relative difference" below is max|ours - torch| / max|torch| over a tensor.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from infinity.optim import CPUAdam, DeepSpeedCPUAdam, adam_update, available_simd_paths, simd_path

ALL_PATHS = ["scalar", "avx2", "avx512"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.fixture(params=ALL_PATHS)
def simd(request, monkeypatch):
    """Each SIMD path this machine has, forced through INFINITY_SIMD."""
    if request.param not in available_simd_paths():
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("INFINITY_SIMD", request.param)
    return request.param


def relative_difference(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# Lengths around every vector width (8, 16), the per-thread slice alignment (64) and the
# one-thread minimum (65536), as 1-D and 2-D parameters.
SHAPES = [(1,), (7,), (17,), (33,), (64,), (1000,), (4099,), (37, 53), (65536 + 5,)]


class Run:
    """Parameters of every shape in SHAPES in three param groups (the second and third with
    their own lr, weight decay, betas) and one fixed stream of random gradients."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        self.gen = torch.Generator().manual_seed(seed + 1)

    def groups(self) -> list[dict]:
        return [{"params": self.params[:3]},
                {"params": self.params[3:6], "lr": 3e-3, "weight_decay": 0.1},
                {"params": self.params[6:], "betas": (0.8, 0.99), "weight_decay": 0.0}]

    def steps(self, opt, num_steps: int, schedule=None) -> None:
        for _ in range(num_steps):
            for p in self.params:
                p.grad = torch.randn(p.shape, generator=self.gen)
            opt.step()
            if schedule is not None:
                schedule.step()

    def values(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]


def with_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))


@pytest.mark.parametrize("torch_cls,adamw_mode", [(torch.optim.AdamW, True),
                                                  (torch.optim.Adam, False)])
def test_matches_torch_100_steps(simd, torch_cls, adamw_mode):
    ours, ref = Run(), Run()
    ours_opt = CPUAdam(ours.groups(), lr=1e-2, weight_decay=0.01, adamw_mode=adamw_mode)
    ours.steps(ours_opt, 100, with_schedule(ours_opt))
    ref_opt = torch_cls(ref.groups(), lr=1e-2, weight_decay=0.01)
    ref.steps(ref_opt, 100, with_schedule(ref_opt))
    for a, b in zip(ours.values(), ref.values()):
        assert relative_difference(a, b) <= 1e-6
    for a, b in zip(ours.params, ref.params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert relative_difference(ours_opt.state[a][key], ref_opt.state[b][key]) <= 1e-6
        assert ours_opt.state[a]["step"].item() == ref_opt.state[b]["step"].item() == 100


def test_bit_exact_with_torch_fused_kernel(simd):
    # torch's fused CPU Adam rounds its sqrt correctly, as we do; its default path takes sqrt
    # from MKL, within an ulp. On whole vectors the fused kernel's bits are ours.
    for torch_cls, adamw_mode in [(torch.optim.AdamW, True), (torch.optim.Adam, False)]:
        gen = torch.Generator().manual_seed(3)
        a = torch.nn.Parameter(torch.randn(1 << 16, generator=gen))
        b = torch.nn.Parameter(a.detach().clone())
        ours = CPUAdam([a], lr=1e-2, weight_decay=0.05, adamw_mode=adamw_mode)
        ref = torch_cls([b], lr=1e-2, weight_decay=0.05, fused=True)
        for _ in range(20):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
            ours.step()
            ref.step()
        assert torch.equal(bits(a.detach()), bits(b.detach()))


def reference_step(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, bias_correction):
    """AdamW in torch ops, with bias correction optional (torch has no switch for it)."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    p.addcdiv_(m, (v.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_bias_correction_switch(simd, bias_correction):
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(4099, generator=gen)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in range(1, 101):
        g = torch.randn(p.shape, generator=gen)
        adam_update(p, g, m, v, step=step, bias_correction=bias_correction, **HYPER)
        reference_step(rp, g, rm, rv, step, bias_correction=bias_correction, **HYPER)
    assert relative_difference(p, rp) <= 1e-6
    assert relative_difference(m, rm) <= 1e-6
    assert relative_difference(v, rv) <= 1e-6
    # CPUAdam's switch reaches the kernel.
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(torch.randn(4099, generator=gen))
    opt = CPUAdam([param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                  bias_correction=bias_correction)
    for _ in range(100):
        param.grad = torch.randn(param.shape, generator=gen)
        opt.step()
    assert torch.equal(bits(param.detach()), bits(p))


def random_case(n: int, seed: int, grad_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype),
            torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 70001])
@pytest.mark.parametrize("grad_dtype,half_dtype,adamw_mode,betas", [
    (torch.float32, None, True, (0.9, 0.999)),
    (torch.bfloat16, torch.bfloat16, False, (0.9, 0.999)),
    (torch.float16, torch.float16, True, (0.3, 0.99)),   # lerp's other branch (1 - beta1 >= 0.5)
    (torch.float32, torch.bfloat16, False, (0.0, 0.5)),
])
def test_simd_paths_bit_identical(n, grad_dtype, half_dtype, adamw_mode, betas):
    results = {}
    for path in available_simd_paths():
        p, g, m, v = random_case(n, 7, grad_dtype)
        h = None if half_dtype is None else torch.empty(n, dtype=half_dtype)
        for step in (1, 2, 3):
            adam_update(p, g, m, v, step=step, lr=1e-2, beta1=betas[0], beta2=betas[1],
                        eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode, grad_scale=0.5,
                        half_out=h, simd=path, num_threads=2)
        results[path] = [bits(t) for t in (p, m, v, h) if t is not None]
    for path, tensors in results.items():
        for ours, ref in zip(tensors, results["scalar"]):
            assert torch.equal(ours, ref), path


def same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaN payloads may differ: the compiler may swap the operands of a commutative operation.
    both_nan = a.isnan() & b.isnan()
    return bool(((bits(a) == bits(b)) | both_nan).all())


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_simd_paths_agree_on_special_values(grad_dtype):
    # Gradients and params of every bit pattern: infinities, NaNs, denormals, in each dtype.
    n = 4099
    gen = torch.Generator().manual_seed(41)
    raw_grad = torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int32)
    if grad_dtype == torch.float32:
        grad = special_floats(n, 43)
    else:
        grad = raw_grad.to(torch.int16).view(grad_dtype)
    results = {}
    for path in available_simd_paths():
        p, m, v = special_floats(n, 47), torch.zeros(n), torch.zeros(n)
        h = torch.empty(n, dtype=torch.float16)
        adam_update(p, grad, m, v, step=1, half_out=h, simd=path, **HYPER)
        results[path] = (p, m, v, h)
    for path, tensors in results.items():
        for ours, ref in zip(tensors, results["scalar"]):
            assert same_bits_or_both_nan(ours, ref), path


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_half_gradient_is_its_exact_float_value(simd, grad_dtype):
    p, g, m, v = random_case(4099, 11, grad_dtype)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    adam_update(p, g, m, v, step=4, **HYPER)
    adam_update(p2, g.float(), m2, v2, step=4, **HYPER)
    for a, b in [(p, p2), (m, m2), (v, v2)]:
        assert torch.equal(bits(a), bits(b))


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, denormals included) plus the hard cases."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    edge = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 1.1754942e-38, 3e-40, float("inf"),
                         -float("inf"), float("nan"), 3.4e38, 3.3961776e38, 1.0000001,
                         1.00390625, 1.01171875,  # bf16 ties: to even down, to even up
                         65504.0, 65519.0, 65520.0, 6e-8, 2.9802322e-8, 3e-8, 6.1e-5])
    out = raw.view(torch.float32)
    out[: edge.numel()] = edge
    return out


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_half_output_is_torch_conversion(simd, half_dtype):
    # lr = 0 and zero gradients leave every param as it is, NaN and infinity included, so the
    # half output is the conversion of arbitrary floats.
    p = special_floats(10007, 13)
    g, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    h = torch.empty(p.numel(), dtype=half_dtype)
    adam_update(p, g, m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, half_out=h)
    assert torch.equal(bits(h), bits(p.to(half_dtype)))
    # And after a real update, of the new param.
    p, g, m, v = random_case(10007, 17, torch.float32)
    adam_update(p, g, m, v, step=1, half_out=h, **HYPER)
    assert torch.equal(bits(h), bits(p.to(half_dtype)))


def test_fused_grad_scale_equals_separate_unscale(simd):
    # The engine's update (unscale/clip, Adam, bf16 copy) in one pass against the three passes.
    p, g, m, v = random_case(70001, 19, torch.float32)
    p2, g2, m2, v2 = p.clone(), g.clone(), m.clone(), v.clone()
    h = torch.empty(p.numel(), dtype=torch.bfloat16)
    adam_update(p, g, m, v, step=3, grad_scale=0.37, half_out=h, **HYPER)
    g2.mul_(0.37)
    adam_update(p2, g2, m2, v2, step=3, **HYPER)
    for a, b in [(p, p2), (m, m2), (v, v2), (h, p2.to(torch.bfloat16))]:
        assert torch.equal(bits(a), bits(b))


def test_offset_count_updates_only_that_range():
    p, g, m, v = random_case(200003, 23, torch.bfloat16)
    whole = [t.clone() for t in (p, m, v)]
    h, h_whole = torch.zeros(p.numel(), dtype=torch.float16), torch.zeros(p.numel(),
                                                                          dtype=torch.float16)
    adam_update(whole[0], g, whole[1], whole[2], step=2, half_out=h_whole, **HYPER)
    before = [t.clone() for t in (p, m, v)]
    k = 70001
    adam_update(p, g, m, v, step=2, half_out=h, offset=k, count=1000, **HYPER)
    for a, b, old in zip((p, m, v), whole, before):
        assert torch.equal(a[k:k + 1000], b[k:k + 1000])
        assert torch.equal(a[:k], old[:k]) and torch.equal(a[k + 1000:], old[k + 1000:])
    assert not h[:k].any() and not h[k + 1000:].any()
    adam_update(p, g, m, v, step=2, half_out=h, offset=0, count=k, **HYPER)
    adam_update(p, g, m, v, step=2, half_out=h, offset=k + 1000, **HYPER)
    for a, b in [(p, whole[0]), (m, whole[1]), (v, whole[2]), (h, h_whole)]:
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_every_start_offset_gives_the_same_bits(half_dtype):
    # The SIMD paths write the half copy with aligned streaming stores after a few elements
    # that reach the alignment; any start offset must give the scalar path's bits.
    n = 4099
    for offset in range(0, 33):
        results = {}
        for path in available_simd_paths():
            p, g, m, v = random_case(n, 53, torch.float32)
            h = torch.zeros(n, dtype=half_dtype)
            adam_update(p, g, m, v, step=1, half_out=h, offset=offset, simd=path, **HYPER)
            results[path] = [bits(t) for t in (p, m, v, h)]
        for path, tensors in results.items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, results["scalar"])), (path,
                                                                                        offset)


def test_thread_count_does_not_change_bits():
    outs = []
    for threads in (1, 2, 3, 8):
        p, g, m, v = random_case(1_000_003, 29, torch.float32)
        adam_update(p, g, m, v, step=1, num_threads=threads, **HYPER)
        outs.append(bits(p))
    assert all(torch.equal(o, outs[0]) for o in outs)


# Lengths around the chunk edges of a batch (multiples of 64 and not), an empty tensor, and
# enough elements in all for several threads.
BATCH_LENGTHS = [0, 1, 63, 65536 + 5, 200_003, 131_072, 7, 70_001]


@pytest.mark.parametrize("borrow_openmp_team", [False, True])
@pytest.mark.parametrize("num_threads", [2, 3])
def test_one_batch_equals_one_call_per_tensor(borrow_openmp_team, num_threads):
    """update_many cuts chunks across tensors laid end to end; every element still gets the
    bits of its own tensor's update, with its own step and hyper-parameters."""
    from infinity import _adam
    from infinity.optim.functional import kernel_job

    def cases():
        for i, n in enumerate(BATCH_LENGTHS):
            p, g, m, v = random_case(n, 40 + i, torch.bfloat16 if i % 2 else torch.float32)
            yield p, g, m, v, (torch.empty(n, dtype=torch.bfloat16) if i % 3 == 0 else None), i + 1

    expected = []
    for p, g, m, v, h, step in cases():
        adam_update(p, g, m, v, step=step, half_out=h, num_threads=1, **HYPER)
        expected.append([bits(t) for t in (p, m, v, h) if t is not None])
    batch = list(cases())
    hyper = dict(HYPER)
    jobs = [kernel_job(_adam.HyperParams(**hyper, step=step), p, g, m, v, half_out=h, offset=0,
                       count=p.numel()) for p, g, m, v, h, step in batch]
    _adam.Updater(borrow_openmp_team=borrow_openmp_team).update_many(jobs, num_threads=num_threads)
    for (p, _, m, v, h, _), want in zip(batch, expected):
        got = [bits(t) for t in (p, m, v, h) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_many_tensors_on_many_threads_match_torch_fused_bits():
    # Lengths that are whole vectors (torch's fused kernel rounds its scalar tail otherwise),
    # long enough for every thread to take chunks of several tensors.
    gen = torch.Generator().manual_seed(11)
    ours_params = [torch.nn.Parameter(torch.randn(n, generator=gen))
                   for n in (300_032, 131_072, 64, 1_000_000)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = CPUAdam(ours_params, lr=1e-2, weight_decay=0.05, num_threads=2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, fused=True)
    for _ in range(3):
        for a, b in zip(ours_params, ref_params):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_params, ref_params):
        assert torch.equal(bits(a.detach()), bits(b.detach()))


def test_a_bad_gradient_leaves_every_parameter_and_step_count_as_it_was():
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(3)]
    opt = CPUAdam(params)
    for p in params:
        p.grad = torch.randn(1000)
    opt.step()
    before = [p.detach().clone() for p in params]
    params[1].grad = torch.randn(2000)[::2]
    with pytest.raises(ValueError, match="param.grad must be contiguous"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [opt.state[p]["step"].item() for p in params] == [1.0, 1.0, 1.0]


def test_step_from_another_thread_gives_the_same_bits():
    # Off the main thread the update runs on the optimizer's own pool, never on a second
    # OpenMP team ([Note: torch's OpenMP team] in csrc/adam/openmp_team.h).
    import threading

    results = []
    for in_thread in (False, True):
        p = torch.nn.Parameter(torch.randn(500_000, generator=torch.Generator().manual_seed(2)))
        p.grad = torch.randn(500_000, generator=torch.Generator().manual_seed(3))
        opt = CPUAdam([p], num_threads=2)
        if in_thread:
            t = threading.Thread(target=opt.step)
            t.start()
            t.join()
        else:
            opt.step()
        results.append(bits(p.detach()))
    assert torch.equal(results[0], results[1])


def test_step_starts_no_threads_where_torch_runs_on_openmp():
    """CPUAdam borrows torch's OpenMP threads, which are already there after one torch op."""
    import os

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to borrow")
    p = torch.nn.Parameter(torch.randn(1 << 20))
    p.grad = torch.randn(1 << 20)
    opt = CPUAdam([p])
    torch.zeros_like(p).add_(1)  # torch's team is up
    num_threads = len(os.listdir("/proc/self/task"))
    opt.step()
    assert len(os.listdir("/proc/self/task")) == num_threads


def save_and_load(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def ours(groups):
    return CPUAdam(groups, lr=1e-2, weight_decay=0.01)


def theirs(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("first,second", [(ours, theirs), (theirs, ours), (ours, ours)])
def test_state_dict_resume(first, second):
    # `first` for 30 steps, saved, loaded into a fresh `second`, 30 more steps; against
    # `second` all the way. Ours resumed from ours is the same bits.
    straight = Run()
    straight.steps(second(straight.groups()), 60)
    resumed = Run()
    opt = first(resumed.groups())
    resumed.steps(opt, 30)
    state = save_and_load(opt.state_dict())
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["state"][0]["step"].dtype == torch.float32
    opt = second(resumed.groups())
    opt.load_state_dict(state)
    resumed.steps(opt, 30)
    for a, b in zip(resumed.values(), straight.values()):
        if first is second:
            assert torch.equal(bits(a), bits(b))
        else:
            assert relative_difference(a, b) <= 1e-6


def test_loaded_torch_state_keeps_adam_mode():
    # A state dict of torch.optim.Adam (L2 decay) resumes CPUAdam as Adam, not AdamW.
    run = Run()
    opt = torch.optim.Adam(run.groups(), lr=1e-2, weight_decay=0.01)
    run.steps(opt, 2)
    ours_opt = CPUAdam(Run().groups())
    ours_opt.load_state_dict(opt.state_dict())
    assert [g["adamw_mode"] for g in ours_opt.param_groups] == [False] * 3


def test_amsgrad_and_maximize_raise():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam(params, amsgrad=True)
    opt = CPUAdam(params)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    assert len(opt.param_groups) == 1
    state = torch.optim.AdamW(params, maximize=True).state_dict()
    with pytest.raises(ValueError, match="maximize"):
        opt.load_state_dict(state)


def test_optimizer_pickles():
    run = Run()
    opt = CPUAdam(run.groups(), lr=1e-2)
    run.steps(opt, 2)
    copy = pickle.loads(pickle.dumps(opt))
    for group in copy.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    copy.step()  # the unpickled optimizer has a thread pool again
    assert copy.state[copy.param_groups[0]["params"][0]]["step"].item() == 3


def test_deepspeed_alias_takes_deepspeed_arguments():
    a, b = Run(), Run()
    # DeepSpeed's order: model_params, lr, bias_correction, betas, eps, weight_decay, ...
    ds = DeepSpeedCPUAdam(a.groups(), 1e-2, True, (0.9, 0.999), 1e-8, 0.01, False,
                          adamw_mode=True, fp32_optimizer_states=True)
    a.steps(ds, 5)
    b.steps(CPUAdam(b.groups(), lr=1e-2, weight_decay=0.01), 5)
    for x, y in zip(a.values(), b.values()):
        assert torch.equal(bits(x), bits(y))


def test_params_must_be_float_cpu():
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\].*dtype"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2)),
                 torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    built_later = torch.nn.Parameter(torch.zeros(2, device="meta"))  # under infinity.Init: taken, never stepped
    built_later.grad = torch.zeros(2, device="meta")
    with pytest.raises(TypeError, match="CPU tensor"):
        CPUAdam([built_later]).step()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\].*dtype"):  # not yet built, wrong dtype
        CPUAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64, device="meta"))])


def update_args(n: int = 100) -> dict:
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize("name,value,error,match", [
    ("param", torch.zeros(100, device="meta"), TypeError, "param must be a CPU tensor"),
    ("grad", torch.zeros(200)[::2], ValueError, "grad must be contiguous"),
    ("grad", torch.zeros(100, dtype=torch.float64), TypeError, "grad must have dtype"),
    ("exp_avg", torch.zeros(100, dtype=torch.float16), TypeError, "exp_avg must have dtype"),
    ("exp_avg", torch.zeros(100, dtype=torch.bfloat16), TypeError, "moments must share one dtype"),
    ("exp_avg_sq", torch.zeros(99), ValueError, "exp_avg_sq has 99 elements"),
    ("half_out", torch.zeros(100), TypeError, "half_out must have dtype"),
    ("half_out", torch.zeros(101, dtype=torch.bfloat16), ValueError, "half_out has 101"),
    ("exp_avg", [0.0] * 100, TypeError, "exp_avg must be a torch.Tensor"),
])
def test_bad_tensor_names_the_argument(name, value, error, match):
    args = update_args()
    args[name] = value
    with pytest.raises(error, match=match):
        adam_update(**args, step=1, **HYPER)


@pytest.mark.parametrize("kwargs,match", [
    (dict(offset=50, count=51), "offset=50, count=51"),
    (dict(offset=-1), "offset=-1"),
    (dict(step=0), "step must be"),
    (dict(lr=-1.0), "lr"),
    (dict(beta2=1.0), "beta2"),
])
def test_bad_range_or_hyper_parameter(kwargs, match):
    args = {**update_args(), "step": 1, **HYPER, **kwargs}
    with pytest.raises(ValueError, match=match):
        adam_update(**args)


def test_simd_selection(monkeypatch):
    paths = available_simd_paths()
    assert paths[-1] == "scalar" and set(paths) <= set(ALL_PATHS)
    monkeypatch.delenv("INFINITY_SIMD", raising=False)
    assert simd_path() == paths[0]
    monkeypatch.setenv("INFINITY_SIMD", "scalar")
    assert simd_path() == "scalar"
    monkeypatch.setenv("INFINITY_SIMD", "sse9")
    with pytest.raises(ValueError, match="INFINITY_SIMD=sse9: unknown"):
        adam_update(**update_args(), step=1, **HYPER)
    for missing in set(ALL_PATHS) - set(paths):
        monkeypatch.setenv("INFINITY_SIMD", missing)
        with pytest.raises(ValueError, match="does not support"):
            adam_update(**update_args(), step=1, **HYPER)


def test_concurrent_callers_share_one_updater():
    # The engine may update one shard from a background thread while the main thread updates
    # another; calls on the shared thread pool are served one after the other.
    import threading

    cases = [random_case(300_001, seed, torch.float32) for seed in (31, 37)]
    expected = []
    for p, g, m, v in cases:
        p, m, v = p.clone(), m.clone(), v.clone()
        adam_update(p, g, m, v, step=1, num_threads=2, **HYPER)
        expected.append(p)

    def work(case):
        adam_update(*case, step=1, num_threads=2, **HYPER)

    threads = [threading.Thread(target=work, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (p, _, _, _), e in zip(cases, expected):
        assert torch.equal(bits(p), bits(e))


def run_in_forked_child(fn, what: str) -> None:
    """Runs fn() in a child made by fork(), as a DataLoader worker is, with torch on one thread
    (torch's OpenMP team does not survive fork()); fails if fn() is False or hangs."""
    import os
    import time

    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        os._exit(0 if fn() else 3)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise AssertionError(f"the forked child hung in {what}")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_update_in_a_forked_child():
    """A fork after the pool started: the child updates on two threads, exits, never hangs."""
    def one_update():
        p, g = torch.ones(1 << 17), torch.full((1 << 17,), 0.5)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        adam_update(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    num_threads=2)
        return p

    expected = one_update()  # starts the pool's worker threads in this process
    run_in_forked_child(lambda: torch.equal(one_update(), expected), "adam_update")


def test_cpu_adam_step_in_a_forked_child():
    """After the parent stepped on torch's OpenMP team, the child steps on the optimizer's own
    threads ([Note: torch's OpenMP team] in csrc/adam/openmp_team.h)."""
    p = torch.nn.Parameter(torch.ones(1 << 18))
    opt = CPUAdam([p], lr=0.1, num_threads=2)
    for _ in range(2):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    twice = p.detach().clone()
    with torch.no_grad():
        p.fill_(1.0)
    opt.state.clear()
    p.grad = torch.full_like(p, 0.5)
    opt.step()

    def second_step():
        opt.step()
        return torch.equal(p.detach(), twice)

    run_in_forked_child(second_step, "CPUAdam.step")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deepspeed_cpu_adam_updates_half_precision_parameters(dtype):
    """DeepSpeedCPUAdam takes bf16/fp16 parameters as DeepSpeed's does: fp32 state (moments and a
    master), and the parameter is the master rounded, matching fused AdamW run in fp32 from the
    same half-precision start."""
    from infinity.optim import DeepSpeedCPUAdam
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3000).to(dtype))
    ref = torch.nn.Parameter(p.detach().float())
    ours = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.01)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, fused=True)
    for _ in range(4):
        g = torch.randn(3000).to(dtype)
        p.grad, ref.grad = g, g.float()
        ours.step()
        torch_opt.step()
    state = ours.state[p]
    assert state["exp_avg"].dtype == torch.float32 and state["master"].dtype == torch.float32
    assert torch.equal(state["master"], ref.detach())
    assert torch.equal(p.detach(), ref.detach().to(dtype))


def test_state_saved_by_deepspeeds_cpu_adam_loads_and_steps():
    """DeepSpeedCPUAdam keeps `step` as a Python int; loading such a state must keep counting."""
    from infinity.optim import DeepSpeedCPUAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    ref = torch.nn.Parameter(p.detach().clone())
    ours, torch_adam = DeepSpeedCPUAdam([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, weight_decay=0)
    for param, opt in ((p, ours), (ref, torch_adam)):
        for _ in range(3):
            param.grad = torch.ones(64)
            opt.step()
    state = ours.state_dict()
    state["state"][0]["step"] = int(state["state"][0]["step"])
    ours.load_state_dict(state)
    for param, opt in ((p, ours), (ref, torch_adam)):
        param.grad = torch.full((64,), 0.5)
        opt.step()
    assert int(ours.state[p]["step"]) == 4
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)


def _superoffload_call(opt, method, subgroup_id, flat, grad):
    """How DeepSpeed's SuperOffload worker calls the optimizer: the sub-group's flat partition is
    put as the only parameter of group 0, with its gradient, for one call."""
    p = torch.nn.Parameter(flat)
    p.grad = grad
    opt.param_groups[0]["params"] = [p]
    getattr(opt, method)(subgroup_id)
    opt.param_groups[0]["params"] = []


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_step_subgroup_keeps_one_state_per_subgroup_and_matches_torch(adamw_mode):
    """Two partitions stepped through one DeepSpeedCPUAdam by sub-group id each match their own
    torch Adam/AdamW (fused, same arithmetic: bit-identical), and the state is DeepSpeed's."""
    torch.manual_seed(0)
    flats = [torch.randn(1000), torch.randn(777)]
    refs = [torch.nn.Parameter(f.clone()) for f in flats]
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_opts = [torch_cls([r], lr=1e-2, weight_decay=0.05, fused=True) for r in refs]
    ours = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-2, weight_decay=0.05,
                            adamw_mode=adamw_mode)
    for _ in range(3):
        for sub, (flat, ref, topt) in enumerate(zip(flats, refs, torch_opts)):
            g = torch.randn_like(flat)
            _superoffload_call(ours, "step_subgroup", sub, flat, g)
            ref.grad = g.clone()
            topt.step()
    for sub, (flat, ref) in enumerate(zip(flats, refs)):
        assert torch.equal(flat, ref.detach())
        assert ours.state[sub]["step"] == 3 and isinstance(ours.state[sub]["step"], int)
        for key in ("exp_avg", "exp_avg_sq"):  # moments: torch rounds them in another order
            torch.testing.assert_close(ours.state[sub][key], torch_opts[sub].state[ref][key], rtol=1e-6, atol=0)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_rollback_subgroup_undoes_the_last_step(adamw_mode):
    """step, step, rollback with the second step's gradient gives back the values after the first
    step (to float rounding) and the step count 1; a next step then matches torch stepping once
    more from there."""
    torch.manual_seed(1)
    flat = torch.randn(4096)
    ours = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-2, weight_decay=0.1,
                            adamw_mode=adamw_mode)
    g1, g2 = torch.randn(4096), torch.randn(4096)
    _superoffload_call(ours, "step_subgroup", 7, flat, g1)
    after_one = {k: v.clone() for k, v in ours.state[7].items() if torch.is_tensor(v)}
    param_after_one = flat.clone()
    _superoffload_call(ours, "step_subgroup", 7, flat, g2)
    assert not torch.allclose(flat, param_after_one, rtol=0, atol=1e-5)  # the step moved it
    _superoffload_call(ours, "rollback_subgroup", 7, flat, g2)
    assert ours.state[7]["step"] == 1
    torch.testing.assert_close(flat, param_after_one, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.state[7][key], after_one[key], rtol=1e-4, atol=1e-7)


def test_rollback_subgroup_refuses_what_it_cannot_undo():
    ours = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    flat = torch.randn(16)
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 3"):
        _superoffload_call(ours, "rollback_subgroup", 3, flat, torch.ones(16))
    _superoffload_call(ours, "step_subgroup", 3, flat, torch.ones(16))
    _superoffload_call(ours, "rollback_subgroup", 3, flat, torch.ones(16))
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 3: step count is 0"):
        _superoffload_call(ours, "rollback_subgroup", 3, flat, torch.ones(16))
    two = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    for p in two:
        p.grad = torch.ones(4)
    shared = DeepSpeedCPUAdam(two, lr=1e-2)
    with pytest.raises(ValueError, match="expected exactly one parameter with a gradient"):
        shared.step_subgroup(0)


def _threads_named(name: str) -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    tids.append(int(tid))
        except FileNotFoundError:  # the thread ended
            pass
    return tids


# Stops one thread of the process (argv[1], a thread id) with ptrace, says "stopped", and lets it
# go when its stdin ends a line (or when it exits).
STOP_THREAD = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
tid = int(sys.argv[1])
if libc.ptrace(0x4206, tid, None, None) != 0 or libc.ptrace(0x4207, tid, None, None) != 0:  # SEIZE, INTERRUPT
    print("cannot", ctypes.get_errno(), flush=True)
    sys.exit(0)
os.waitpid(tid, 0x40000000)  # __WALL: until the thread has stopped
print("stopped", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's ptrace")
def test_an_update_does_not_wait_for_a_worker_that_cannot_run():
    """[Note: late workers are not waited for]: with the pool's worker stopped (ptrace, from a
    helper process) the way a busy core stalls it, updates still finish, on the caller's thread,
    with the right bits; before, each waited for the worker to run again."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    reference = p0.clone()
    adam_update(reference, g, torch.zeros(n), torch.zeros(n), **hyper, num_threads=1)
    adam_update(p0.clone(), g, torch.zeros(n), torch.zeros(n), **hyper, num_threads=2)  # starts the worker
    deadline = time.monotonic() + 10
    while not (workers := _threads_named("infinity-adam")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread names itself once it first runs
    assert workers
    import ctypes
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2 ** 64 - 1), 0, 0, 0)  # PR_SET_PTRACER_ANY (Yama)
    tracers = [subprocess.Popen([sys.executable, "-c", STOP_THREAD, str(tid)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for tid in workers]
    results = []
    try:
        said = [t.stdout.readline().strip() for t in tracers]
        if any(s != "stopped" for s in said):
            pytest.skip(f"cannot stop a thread with ptrace here: {said}")

        def updates():
            for _ in range(5):
                p = p0.clone()
                adam_update(p, g, torch.zeros(n), torch.zeros(n), **hyper, num_threads=2)
                results.append(p)

        caller = threading.Thread(target=updates, daemon=True)
        caller.start()
        caller.join(timeout=20)
        finished = not caller.is_alive()
    finally:
        for t in tracers:
            t.stdin.close()  # the worker runs again
            t.wait()
            t.stdout.close()
    caller.join()
    assert finished, "the updates waited for the stopped worker"
    assert len(results) == 5 and all(torch.equal(p, reference) for p in results)


def test_the_built_kernels_prefetch():
    """The module holds software prefetches ([Note: prefetches are always inlined] in
    csrc/adam/prefetch.h): a build whose compiler dropped them as dead code still gave the right
    bits, only slower. Counted in the shared object's bytes: PREFETCHT0 is 0F 18 with a ModRM
    whose reg field is 1 (every memory form), which no other instruction starts with."""
    import infinity._adam as module

    with open(module.__file__, "rb") as f:
        code = f.read()
    prefetches = len(re.findall(rb"\x0f\x18[\x08-\x0f\x48-\x4f\x88-\x8f]", code))
    assert prefetches >= 200, f"{prefetches} PREFETCHT0 in {module.__file__}"
