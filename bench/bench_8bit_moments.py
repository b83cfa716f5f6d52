"""One Adam update with 8-bit moments: the fused kernel (moment_format="8bit") against the torch-op
path the tiers took before it (formats.py's decode into fp32 scratch, the fp32 kernel, its
encode).

    python bench/bench_8bit_moments.py                  # 16M values, 5 rounds
    python bench/bench_8bit_moments.py --values 1e6 --rounds 2
    python bench/bench_8bit_moments.py --simd avx2      # a machine without AVX-512's path

Both update the same tensors (param, gradient, the two stored moments), one after the other in
every round, the order turning each round, after a warm-up round; reported are each method's
median and min-max and the median of the per-round ratio torch-op time / fused time (> 1: the
fused kernel is faster). The fp32 kernel alone on fp32 moments (what the torch-op path spends in
the kernel) is timed in the same rounds for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infinity.optim import adam_update, available_simd_paths
from infinity.optim.functional import simd_path
from infinity.optim.formats import FORMATS

F = FORMATS["8bit"]
HYPER = dict(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=float, default=16 * 2 ** 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--simd", choices=available_simd_paths(), default=None,
                        help="the kernels' instruction set (default: the best this CPU has)")
    args = parser.parse_args()
    simd = simd_path(args.simd)
    n = int(args.values)
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    m = F.encode(torch.randn(n, generator=gen) * 1e-3, "exp_avg")
    v = F.encode(torch.rand(n, generator=gen) * 1e-6, "exp_avg_sq")
    scratch = {"exp_avg": torch.empty(n), "exp_avg_sq": torch.empty(n)}  # as the NVMe tier keeps it
    m32, v32 = torch.zeros(n), torch.zeros(n)
    step = [0]

    def fused():
        adam_update(p, g, m, v, step=step[0], **HYPER, moment_format="8bit", simd=simd)

    def torch_ops():
        values = {k: F.decode(s, n, k, out=scratch[k]) for k, s in (("exp_avg", m), ("exp_avg_sq", v))}
        adam_update(p, g, values["exp_avg"], values["exp_avg_sq"], step=step[0], **HYPER, simd=simd)
        F.encode(values["exp_avg"], "exp_avg", out=m)
        F.encode(values["exp_avg_sq"], "exp_avg_sq", out=v)

    def fp32_kernel():
        adam_update(p, g, m32, v32, step=step[0], **HYPER, simd=simd)

    methods = {"fused": fused, "torch_ops": torch_ops, "fp32_kernel": fp32_kernel}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(args.rounds + 1):
        names = list(methods)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            step[0] += 1
            start = time.perf_counter()
            methods[name]()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    print(f"Adam, {n} values, 8-bit moments, {simd}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:12s} median {statistics.median(ts) * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f}, "
              f"max {max(ts) * 1e3:.1f})")
    ratios = [t / f for t, f in zip(times["torch_ops"], times["fused"])]
    print(f"  torch_ops / fused: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
