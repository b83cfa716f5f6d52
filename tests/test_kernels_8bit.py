"""8-bit moments updated by the kernels in one pass (moment_format="8bit": [Note: 8-bit moments in
the kernels] in csrc/adam/adam.h).

The reference is the composition the tiers ran before: formats.py's decode, the fp32 kernel, and
formats.py's encode. Every comparison is of bits (codes, scales, param, half copy), on every SIMD
path and rule. The update's new moments are steered where the format has edges (a block's top at
448 * 2^k or 224 * 2^k, ties between codes, subnormal codes, values that underflow, zeros, NaN and
infinity) by steps that copy the gradient into the moment (beta1 = 0, beta2 = 0); a second,
independent statement of the format (`spec_encode`) agrees with both, and each mutation of it
(another tie rule, a strict bound for the scale, no clamp of the roots; torch's float sqrt, on
sums made for it) disagrees on these data, so a kernel with such a bug fails here.
"""

from __future__ import annotations

import math

import pytest
import torch

from infinity.optim import adagrad_update, adam_update, available_simd_paths, formats, lion_update
from infinity.optim.formats import BLOCK, FORMATS

F = FORMATS["8bit"]
KINDS = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("exp_avg_sq",), "lion": ("exp_avg",)}
HYPER = {"adam": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
         "adagrad": dict(lr=0.1, eps=1e-10, weight_decay=0.1, lr_decay=0.01),
         "lion": dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)}
# Hyper-parameters whose step leaves the gradient in the moments: exp_avg = g, exp_avg_sq = g * g.
COPY = {"adam": dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0),
        "adagrad": dict(lr=0.1, eps=1e-10, weight_decay=0.0),
        "lion": dict(lr=1e-3, beta1=0.5, beta2=0.0, weight_decay=0.0)}
RULES = list(KINDS)


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request):
    if request.param not in available_simd_paths():
        pytest.skip(f"this CPU has no {request.param}")
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(xs, ys) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(xs, ys, strict=True))


def update(rule: str, p, g, moments, *, hyper=None, step: int = 1, **kw) -> None:
    h = dict(HYPER[rule] if hyper is None else hyper)
    if rule == "adam":
        adam_update(p, g, *moments, step=step, **h, **kw)
    elif rule == "adagrad":
        adagrad_update(p, g, *moments, step=step, **h, **kw)
    else:
        lion_update(p, g, *moments, **h, **kw)


def composed(rule: str, p, g, stored, **kw) -> None:
    """The tiers' former path: decode, the fp32 kernel, encode (in place on `stored`)."""
    n = p.numel()
    values = [F.decode(s, n, k) for s, k in zip(stored, KINDS[rule])]
    update(rule, p, g, values, **kw)
    for v, s, k in zip(values, stored, KINDS[rule]):
        F.encode(v, k, out=s)


def both(rule: str, p, g, stored, **kw) -> tuple[list, list]:
    """(fused, composed) results of one update from the same state: param, moments, half copy."""
    half = kw.pop("half_out", None)
    out = []
    for fused in (True, False):
        p2, s2 = p.clone(), [s.clone() for s in stored]
        h2 = None if half is None else torch.zeros_like(half)
        if fused:
            update(rule, p2, g, s2, half_out=h2, moment_format="8bit", **kw)
        else:
            composed(rule, p2, g, s2, half_out=h2, **kw)
        out.append([p2, *s2] + ([] if h2 is None else [h2]))
    return out[0], out[1]


def wide(n: int, gen: torch.Generator, low: int = -40, high: int = 4) -> torch.Tensor:
    """Values from 2^low to 2^high in one tensor (blocks wider than e4m3's range), a twentieth of
    them zero, then an all-zero block and a block of fp32 subnormals when there is room."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(low, high + 1, (n,), generator=gen).float())
    x[torch.rand(n, generator=gen) < 0.05] = 0.0
    if n >= 3 * BLOCK:
        x[BLOCK:2 * BLOCK] = 0.0
        x[2 * BLOCK:3 * BLOCK] = torch.randint(-2 ** 20, 2 ** 20, (BLOCK,), generator=gen).float() * 2.0 ** -149
    return x


def state(rule: str, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Stored moments: encoded wide values, and some blocks of raw random codes (no NaN code) and
    scales, which no encode gives (a top below the top octave) but decode must take."""
    out = []
    for kind in KINDS[rule]:
        x = wide(n, gen, -30, 2)
        stored = F.encode(x * x if kind == "exp_avg_sq" else x, kind)
        codes, scales = stored[:n], stored[F.scales_offset(n):].view(torch.float32)
        raw = torch.randint(0, 0x7F, (n,), dtype=torch.uint8, generator=gen)
        raw |= torch.randint(0, 2, (n,), dtype=torch.uint8, generator=gen) << 7
        chosen = torch.arange(n) // BLOCK % 3 == 2
        codes[chosen] = raw[chosen]
        scales[2::3] = torch.exp2(torch.randint(-60, 8, scales[2::3].shape, generator=gen).float())
        out.append(stored)
    return out


# --- the fused update is the composition ------------------------------------------------------

CONFIGS = {
    "fp32": dict(grad_dtype=torch.float32, half=None, kw={}),
    "bf16-grad-half-scaled": dict(grad_dtype=torch.bfloat16, half=torch.bfloat16, kw=dict(grad_scale=0.37)),
    "fp16-l2-no-bias-correction": dict(grad_dtype=torch.float16, half=torch.float16,
                                       kw=dict(adamw_mode=False, bias_correction=False)),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n", [1, 8, 24, 255, 256, 257, 288, 296, 504, 4099])
def test_fused_update_is_decode_kernel_encode(simd, rule, config, n):
    c = CONFIGS[config]
    kw = dict(c["kw"])
    if rule != "adam":
        kw = {k: v for k, v in kw.items() if k == "grad_scale"}
    gen = torch.Generator().manual_seed(n)
    p, stored = torch.randn(n, generator=gen), state(rule, n, gen)
    half = None if c["half"] is None else torch.zeros(n, dtype=c["half"])
    for step in (1, 2, 3):  # each step from the fused result
        g = wide(n, gen, -30, 3).to(c["grad_dtype"])
        fused, ref = both(rule, p, g, stored, step=step, half_out=half, simd=simd, **kw)
        assert same(fused, ref), (rule, config, n, step)
        p, stored = fused[0], fused[1:1 + len(stored)]


@pytest.mark.parametrize("rule", RULES)
def test_a_half_copy_off_its_vector_alignment(simd, rule):
    """The half copy one element past an aligned address, so that none of its vectors may take a
    streaming store, and a last block of whole vectors short of a block (the encode's remainder):
    the composition's bits."""
    n = 4 * BLOCK + 40
    gen = torch.Generator().manual_seed(7)
    p, stored = torch.randn(n, generator=gen), state(rule, n, gen)
    g = wide(n, gen, -30, 3).to(torch.bfloat16)
    out = []
    for fused in (True, False):
        p2, s2 = p.clone(), [s.clone() for s in stored]
        h2 = torch.zeros(n + 1, dtype=torch.bfloat16)[1:]
        if fused:
            update(rule, p2, g, s2, half_out=h2, moment_format="8bit", simd=simd, step=2)
        else:
            composed(rule, p2, g, s2, half_out=h2, simd=simd, step=2)
        out.append([p2, *s2, h2])
    assert same(*out)


def coded(rule: str, n: int, codes: dict[int, int]) -> list[torch.Tensor]:
    """Stored moments of n values at scale 1, all code 0x38 (1.0) but `codes` (position -> code)."""
    out = []
    for kind in KINDS[rule]:
        stored = F.empty(n, 0.0, kind)
        stored[:n] = 0x38
        for i, code in codes.items():
            stored[i] = code
        stored[F.scales_offset(n):].view(torch.float32).fill_(1.0)
        out.append(stored)
    return out


SUBNORMAL_CODES = [*range(1, 8), *range(0x81, 0x88), 0x00, 0x80]  # m * 2^-9 of either sign, and both zeros


@pytest.mark.parametrize("rule", RULES)
def test_nan_codes_beside_subnormal_ones_decode_as_the_composition(simd, rule):
    """Blocks whose stored codes hold a NaN code (0x7F, 0xFF), one in the short last block, between
    blocks of subnormal codes without one: each block decodes as formats.py does ([Note: decoding
    a block without NaN codes] in csrc/adam/kernels_avx512.cpp: a NaN read as 240 would not)."""
    n = 5 * BLOCK + 9
    codes = {BLOCK + 3: 0x7F, 3 * BLOCK + 200: 0xFF, n - 2: 0x7F}
    codes.update({2 * BLOCK + k: c for k, c in enumerate(SUBNORMAL_CODES)})
    codes.update({BLOCK + 20 + k: c for k, c in enumerate(SUBNORMAL_CODES)})
    gen = torch.Generator().manual_seed(11)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    fused, ref = both(rule, p, g, coded(rule, n, codes), step=2, simd=simd)
    assert same(fused, ref)
    new_codes = fused[1][:n] & 0x7F  # the NaN stays one; the subnormal block gains none
    assert new_codes[BLOCK + 3] == 0x7F and not (new_codes[2 * BLOCK:3 * BLOCK] == 0x7F).any()


@pytest.mark.parametrize("rule", RULES)
def test_subnormal_codes_decode_the_same_where_denormals_read_as_zero(simd, rule):
    """torch.set_flush_denormal(True) sets MXCSR's DAZ on its thread: fp32 subnormal inputs read as
    zeros there, so the decode that reads an e4m3 subnormal code as one must not run (one thread,
    the caller's). The values are normal in fp32 throughout, so DAZ changes nothing else."""
    n = 2 * BLOCK
    codes = {k: c for k, c in enumerate(SUBNORMAL_CODES * 8)}
    gen = torch.Generator().manual_seed(12)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    fused, ref = both(rule, p, g, coded(rule, n, codes), step=2, simd=simd, num_threads=1)
    assert same(fused, ref)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        daz, _ = both(rule, p, g, coded(rule, n, codes), step=2, simd=simd, num_threads=1)
    finally:
        torch.set_flush_denormal(False)
    assert same(daz, fused)


@pytest.mark.parametrize("rule", RULES)
def test_threads_and_paths_give_the_same_bits(rule):
    """Several threads (each owns whole blocks) and every SIMD path: the composition's bits."""
    n = 3 * 65536 + 77
    gen = torch.Generator().manual_seed(5)
    p, stored, g = torch.randn(n, generator=gen), state(rule, n, gen), wide(n, gen)
    _, ref = both(rule, p, g, stored, step=4, num_threads=1)
    for path in available_simd_paths():
        fused, _ = both(rule, p, g, stored, step=4, num_threads=3, simd=path)
        assert same(fused, ref), path


# --- the format's edges, reached by the update -----------------------------------------------

def e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def edge_gradients() -> torch.Tensor:
    """Blocks of gradients (copied into the moments by COPY's step) at the format's edges, then a
    short last block."""
    e4m3 = e4m3_values()
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # ties between neighbouring codes, at scale 1
    ulp = torch.nextafter(mids, torch.tensor(math.inf)) - mids
    near = torch.cat([mids + k * ulp for k in range(-3, 4)] + [e4m3])  # roots of their squares, too
    blocks = []
    for chunk in near.split(BLOCK // 2 - 1):  # scale 1: 448 tops each block
        for sign in (1.0, -1.0):
            blocks.append(torch.cat([torch.tensor([448.0]), sign * chunk]))
    gen = torch.Generator().manual_seed(3)
    for k in range(-60, 40, 7):  # tops exactly 448 * 2^k and 224 * 2^k, and a hair on either side
        for top in (448.0 * 2.0 ** k, 224.0 * 2.0 ** k):
            for t in (top, math.nextafter(top, math.inf), math.nextafter(top, 0.0)):
                rest = (torch.rand(BLOCK - 1, generator=gen) * 2 - 1) * t
                blocks.append(torch.cat([torch.tensor([t]), rest]))
    tiny = 2.0 ** -149
    blocks += [torch.tensor([224 * tiny, tiny, -3 * tiny]),  # top / 448 rounds to 0: formats.py keeps scale 1
               torch.tensor([225 * tiny, 7 * tiny, -tiny]),
               torch.tensor([448.0 * 2 ** 20, 2.0 ** -140, 3 * tiny, 2.0 ** -100]),  # underflow in the division
               torch.tensor([math.nan, 1000.0, 470.0, 464.0, 465.0, 448.5, -1e30, math.inf, -2.0 ** -12]),  # scale 1
               torch.tensor([math.inf, 1.0, -2.0, 0.0, -0.0]),  # an infinite scale
               -torch.zeros(7), torch.zeros(BLOCK)]
    x = torch.cat([torch.nn.functional.pad(b, (0, BLOCK - b.numel())) for b in blocks])
    return torch.cat([x, torch.tensor([0.75, -300.0, 2.0 ** -9, 5e-3])])  # a short last block


@pytest.mark.parametrize("rule", RULES)
def test_edges_of_the_format_through_the_update(simd, rule):
    g = edge_gradients()
    n = g.numel()
    stored = [F.empty(n, 0.0, kind) for kind in KINDS[rule]]
    p = torch.zeros(n)
    fused, ref = both(rule, p, g, stored, hyper=COPY[rule], simd=simd)
    assert same(fused, ref)
    for kind, values, got in zip(KINDS[rule], new_moments(rule, g), fused[1:]):
        assert torch.equal(got, spec_encode(values, kind)), kind  # the spec as written down below


def new_moments(rule: str, g: torch.Tensor, stored=None) -> list[torch.Tensor]:
    """The fp32 moments COPY's step makes from `stored` (zeros: g and g * g, NaN where g - 0 is
    infinite)."""
    n = g.numel()
    moments = [torch.zeros(n) if stored is None else F.decode(s, n, k) for s, k in zip(stored or KINDS[rule],
                                                                                   KINDS[rule])]
    update(rule, torch.zeros(n), g, moments, hyper=COPY[rule])
    return moments


def test_roots_are_correctly_rounded(simd):
    """exp_avg_sq is stored as its correctly rounded root (the hardware's sqrt; formats.py takes it
    in double). Adagrad's sums here have roots half an ulp from a tie between two codes, where a
    root off by an ulp (torch's float sqrt, which formats.py used to take) may pick the other."""
    e4m3 = e4m3_values()
    mids = ((e4m3[1:] + e4m3[:-1]) / 2)[e4m3[1:] > 2]
    ulp = torch.nextafter(mids, torch.tensor(math.inf)) - mids
    targets = torch.cat([(mids.double() + f * ulp.double()) ** 2 for f in (-0.5, 0.5)])
    g = (targets - 1).sqrt().float()  # sum = 1 + g * g: 1 is what the stored sums decode to
    blocks = [torch.cat([torch.zeros(1), chunk]) for chunk in g.split(BLOCK - 1)]
    g = torch.cat([torch.nn.functional.pad(b, (0, BLOCK - b.numel())) for b in blocks])
    old = torch.where(torch.arange(g.numel()) % BLOCK == 0, 448.0 ** 2, 1.0)  # 448 tops every block: scale 1
    stored = [F.encode(old, "exp_avg_sq")]
    fused, ref = both("adagrad", torch.zeros(g.numel()), g, stored, hyper=COPY["adagrad"], simd=simd)
    assert same(fused, ref)
    (sums,) = new_moments("adagrad", g, stored)
    assert torch.equal(fused[1], spec_encode(sums, "exp_avg_sq"))
    if torch.equal(sums.sqrt(), sums.double().sqrt().float()):
        pytest.skip("torch's float sqrt is correctly rounded on this CPU")
    assert not torch.equal(fused[1], spec_encode(sums, "exp_avg_sq", float_sqrt=True))


# An independent statement of the 8-bit encode ([Note: moment formats] in formats.py), in integer
# arithmetic where formats.py uses log2 and torch's conversion; each keyword a mutation of it.

def e4m3_codes(y: torch.Tensor, ties: str) -> torch.Tensor:
    u = y.view(torch.int32).long() & 0xFFFFFFFF
    a, sign = u & 0x7FFFFFFF, (u >> 31) << 7
    lsb = (a >> 20) & 1
    add = {"even": 0x7FFFF + lsb, "away": 0x80000, "down": 0}[ties]
    normal = (a - (120 << 23) + add) >> 20
    units = y.double().abs() * 2.0 ** 9  # below 2^-6: units of e4m3's least subnormal, exact in double
    low, frac = units.floor(), units - units.floor()
    up = {"even": (frac > 0.5) | ((frac == 0.5) & (low % 2 == 1)), "away": frac >= 0.5, "down": frac < 0}[ties]
    code = torch.where(a < (121 << 23), (low + up.double()).long(), normal)
    code = torch.where(a >= 0x43E80001, 0x7E, code)
    code = torch.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(torch.uint8)


def spec_scales(top: torch.Tensor, nan: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """The scales of blocks whose largest magnitude, NaN aside, has the bits `top` (int64)."""
    # smallest e with top <= 448 * 2^e (448 = 1.75 * 2^8), at least -126 (strict: top < 448 * 2^e)
    above = (top & 0x7FFFFF) >= 0x600000 if strict else (top & 0x7FFFFF) > 0x600000
    e = ((top >> 23) - 135 + above.long()).clamp(min=-126)
    scale_bits = torch.where(nan | (top <= 224), 127 << 23, (e + 127) << 23)  # 224 * 2^-149: formats.py's 1
    scale_bits = torch.where(~nan & (top == 0x7F800000), 0x7F800000, scale_bits)
    return scale_bits.int().view(torch.float32)


def spec_encode(values: torch.Tensor, kind: str, *, ties: str = "even", strict: bool = False,
                float_sqrt: bool = False, clamp: bool = True) -> torch.Tensor:
    n, square = values.numel(), kind == "exp_avg_sq"
    x = values.float()
    if square:
        x = x.sqrt() if float_sqrt else x.double().sqrt().float()
    blocks = math.ceil(n / BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    top = torch.where(padded.isnan(), 0.0, padded.abs()).amax(1).view(torch.int32).long()
    scales = spec_scales(top, padded.isnan().any(1), strict)
    y = padded * (1 / scales)[:, None]
    if square and clamp:
        y = torch.where(y > 0, y.clamp(min=2.0 ** -9), y)
    out = torch.zeros(F.nbytes(n), dtype=torch.uint8)
    out[:n] = e4m3_codes(y.reshape(-1)[:n], ties)
    out[F.scales_offset(n):] = scales.view(torch.uint8)
    return out


def float_patterns(chunk: int) -> torch.Tensor:
    """The floats whose bits are [chunk * 2^24, (chunk + 1) * 2^24), chunk < 256."""
    u = torch.arange(chunk << 24, (chunk + 1) << 24, dtype=torch.int64)
    return torch.where(u >= 1 << 31, u - (1 << 32), u).int().view(torch.float32)


@pytest.mark.slow
def test_formats_chooses_the_spec_s_scale_for_every_float_top(monkeypatch):
    """formats.py's log2 and correction loop pick, for every non-negative float and NaN top, the
    scale read off its bits (each value its own block, BLOCK set to 1)."""
    monkeypatch.setattr(formats, "BLOCK", 1)
    for chunk in range(128):
        for top in float_patterns(chunk).split(1 << 21):  # pieces small enough for malloc to reuse
            got = F.encode(top, "exp_avg")[F.scales_offset(top.numel()):].view(torch.float32)
            assert torch.equal(bits(got), bits(spec_scales(top.view(torch.int32).long(), top.isnan()))), chunk


@pytest.mark.slow
def test_the_kernel_s_codes_are_torch_s_for_every_float():
    """Every float pattern, 255 to a block beside a NaN (so the scale is 1), copied into exp_avg by
    Lion's COPY step on each SIMD path: the codes are torch's `.to(torch.float8_e4m3fn)` of the
    moment (in which an infinite gradient is NaN: lerp's 0 * inf)."""
    rows = (1 << 24) // (BLOCK - 1) + 1
    g = torch.full((rows, BLOCK), math.nan)
    n = g.numel()
    p, moment, zeros = torch.zeros(n), torch.zeros(n), F.empty(n, 0.0, "exp_avg")
    stored = zeros.clone()
    patterns = torch.zeros(rows * (BLOCK - 1))  # the last block's tail: zeros
    for chunk in range(256):
        patterns[:1 << 24] = float_patterns(chunk)
        g[:, 1:] = patterns.view(rows, BLOCK - 1)
        update("lion", p, g.view(-1), [moment.zero_()], hyper=COPY["lion"])
        want = moment.to(torch.float8_e4m3fn).view(torch.uint8)
        for path in available_simd_paths():
            update("lion", p, g.view(-1), [stored.copy_(zeros)], hyper=COPY["lion"], moment_format="8bit", simd=path)
            assert torch.equal(stored[:n], want), (chunk, path)


def test_the_spec_is_formats_encode_on_the_edges():
    g = edge_gradients()
    for kind, values in (("exp_avg", g), ("exp_avg_sq", g * g), ("exp_avg_sq", g.abs())):
        assert torch.equal(F.encode(values, kind), spec_encode(values, kind)), kind


@pytest.mark.parametrize("mutation", [dict(ties="away"), dict(ties="down"), dict(strict=True), dict(clamp=False)],
                         ids=["ties-away", "ties-down", "strict-scale-bound", "roots-unclamped"])
def test_a_wrong_rounding_would_be_caught(mutation):
    """What the edge test checks the kernel against differs from each mutation of the spec: a
    kernel that rounded, scaled, took roots or clamped that way would fail it."""
    g = edge_gradients()
    p = torch.zeros(g.numel())
    stored = [F.empty(g.numel(), 0.0, kind) for kind in KINDS["adam"]]
    update("adam", p, g, stored, hyper=COPY["adam"], moment_format="8bit")
    wrong = [spec_encode(v, kind, **mutation) for v, kind in zip(new_moments("adam", g), KINDS["adam"])]
    assert not same(stored, wrong)


# --- ranges and arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("rule", RULES)
def test_a_range_of_whole_blocks_updates_only_those_blocks(rule):
    n, offset, count = 10 * BLOCK + 100, 3 * BLOCK, 4 * BLOCK
    gen = torch.Generator().manual_seed(8)
    p, stored, g = torch.randn(n, generator=gen), state(rule, n, gen), wide(n, gen)
    p2, stored2 = p.clone(), [s.clone() for s in stored]
    update(rule, p2, g, stored2, moment_format="8bit", offset=offset, count=count)
    # the reference: the range's blocks decoded, updated, encoded; every other byte as it was
    sl, blocks = slice(offset, offset + count), (offset // BLOCK, (offset + count) // BLOCK)
    values = [F.decode_blocks(s, n, k, *blocks) for s, k in zip(stored, KINDS[rule])]
    update(rule, p[sl], g[sl], values)
    for v, s, k in zip(values, stored, KINDS[rule]):
        F.encode_blocks(v, k, s, n, blocks[0])
    assert same([p2, *stored2], [p, *stored])
    p3, stored3 = p2.clone(), [s.clone() for s in stored2]  # and the last block's range ends at n
    update(rule, p2, g, stored2, moment_format="8bit", offset=9 * BLOCK)
    values = [F.decode_blocks(s, n, k, 9, 11) for s, k in zip(stored3, KINDS[rule])]
    update(rule, p3[9 * BLOCK:], g[9 * BLOCK:], values)
    for v, s, k in zip(values, stored3, KINDS[rule]):
        F.encode_blocks(v, k, s, n, 9)
    assert same([p2, *stored2], [p3, *stored3])


def test_bad_8bit_arguments_are_refused():
    n = 1000
    p, g = torch.zeros(n), torch.zeros(n)
    m, v = F.empty(n, 0.0, "exp_avg"), F.empty(n, 0.0, "exp_avg_sq")
    hyper = HYPER["adam"]
    for offset, count in ((1, None), (100, 156), (0, 300), (BLOCK, BLOCK + 1)):
        with pytest.raises(ValueError, match="starts on a block of 256 values"):
            adam_update(p, g, m, v, step=1, **hyper, moment_format="8bit", offset=offset, count=count)
    with pytest.raises(ValueError, match=f"take {F.nbytes(n)}"):
        adam_update(p, g, m[:-4], v, step=1, **hyper, moment_format="8bit")
    with pytest.raises(TypeError, match="moment_format='8bit'"):
        adam_update(p, g, m, v, step=1, **hyper)
    with pytest.raises(TypeError, match="torch.uint8"):
        adam_update(p, g, torch.zeros(n), torch.zeros(n), step=1, **hyper, moment_format="8bit")
    with pytest.raises(TypeError, match="moment_format 'bf16' takes torch.bfloat16"):
        adam_update(p, g, torch.zeros(n), torch.zeros(n), step=1, **hyper, moment_format="bf16")
    with pytest.raises(ValueError, match="moment_format must be"):
        adam_update(p, g, m, v, step=1, **hyper, moment_format="int8")
    adam_update(p, g, m, v, step=1, **hyper, moment_format="8bit", offset=3 * BLOCK, count=n - 3 * BLOCK)


# --- a tier's piece: runs of param groups over blocks ([Note: 8-bit updates of a piece]) -----------

GROUPS = {"adam": [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
                   dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, adamw_mode=False)],
          "adagrad": [dict(lr=0.1, eps=1e-10, weight_decay=0.1, lr_decay=0.01),
                      dict(lr=0.2, eps=1e-8, weight_decay=0.0)],
          "lion": [dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
                   dict(lr=1e-3, betas=(0.5, 0.9), weight_decay=0.0)]}
N = 5 * BLOCK + 40
LAYOUTS = {"one run": [(0, N)], "the padding after it": [(0, N - 300)], "two runs share a block": [(0, 700), (700, N)],
           "runs on blocks": [(0, 512), (512, 1024), (1024, N)], "inside one block": [(10, 100)],
           "a gap": [(0, 300), (600, N - 1)]}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_piece_updates_as_decode_kernel_encode_over_all_of_it(rule, layout):
    """Rule.update_stored (what both tiers call) with the fused kernel on the runs' whole blocks
    against the long way over the piece: the same bits, but that blocks no run touches keep their
    bytes (the long way encodes their decoded values again: the same values)."""
    from infinity.optim.rules import AdagradRule, AdamRule, LionRule
    make = {"adam": AdamRule, "adagrad": AdagradRule, "lion": LionRule}[rule]
    fused_rule, long_rule = make(fmt="8bit"), make(fmt="8bit")
    long_rule.packed_kernel = False
    hypers = fused_rule.hypers(GROUPS[rule] * 2)
    runs = [(lo, hi, hypers[i]) for i, (lo, hi) in enumerate(LAYOUTS[layout])]
    gen = torch.Generator().manual_seed(11)
    p, stored, g = torch.randn(N, generator=gen), state(rule, N, gen), wide(N, gen).to(torch.bfloat16)
    results = []
    for r in (fused_rule, long_rule):
        p2, h2 = p.clone(), torch.zeros(N, dtype=torch.bfloat16)
        s2 = {k: s.clone() for k, s in zip(KINDS[rule], stored)}
        r.update_stored(p2, g, s2, runs, step=3, grad_scale=0.5, half_out=h2)
        results.append((p2, s2, h2))
    (p_f, s_f, h_f), (p_l, s_l, h_l) = results
    assert same([p_f, h_f], [p_l, h_l])
    touched = torch.zeros(N, dtype=torch.bool)
    for lo, hi, _ in runs:
        touched[lo // BLOCK * BLOCK:-(-hi // BLOCK) * BLOCK] = True
    for (kind, old), fused, long in zip(zip(KINDS[rule], stored), s_f.values(), s_l.values()):
        assert same([F.decode(fused, N, kind)], [F.decode(long, N, kind)]), kind
        assert torch.equal(fused[:N][touched], long[:N][touched]), kind
        assert torch.equal(fused[:N][~touched], old[:N][~touched]), kind
        blocks = touched[::BLOCK]
        scales = [s[F.scales_offset(N):].view(torch.float32) for s in (fused, long, old)]
        assert torch.equal(scales[0][blocks], scales[1][blocks]) and torch.equal(scales[0][~blocks], scales[2][~blocks])
