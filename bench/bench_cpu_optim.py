"""CPU optimizer step throughput: infinity's CPUAdam, CPUAdagrad and CPULion against torch's
fastest CPU implementation of the same optimizer.

    python bench/bench_cpu_optim.py                          # 100M params, 7 rounds
    python bench/bench_cpu_optim.py --params 1e6 --rounds 2  # a smoke run

[Note: what the optimizer bench measures]
One optimizer step over all parameters (100M fp32 by default, in tensors of about 16M
elements), through the public API of each side:
- CPUAdam against torch.optim.AdamW(fused=True) and (foreach=True);
- CPUAdagrad against torch.optim.Adagrad(fused=True), which torch has on the CPU since 2.4
  (checked at run time; without it, foreach=True only), and (foreach=True);
- CPULion against a Lion written here with torch's foreach ops (torch has no Lion), in the
  arithmetic order of the kernel ([Note: Adagrad and Lion arithmetic] in csrc/adam/adam.h).
The optimizers of one rule share one set of tensors (param, grad and the rule's moments: their
states point at the same moment tensors), so none runs on warmer memory than another. Each
round runs every pair (torch's, ours) once, its two methods back to back, one pair later each
round and the two in the other order every other round (so that none always follows the same
one; torch's OpenMP threads spin for a while after each of its parallel regions), after a
warm-up round. Reported: per method the median and min-max of its times; per pair the median
and min-max of the per-round ratio torch time / ours (> 1: ours faster) of the two calls made
back to back, which cancels the drift of a VM's memory bandwidth (a method run once a round
and compared with the other's run of that round, many calls away, spread 0.25-3.3x in a
sweep on an EPYC VM, cpu_optim.md). With --bf16-moments, ours also runs with
fp32_optimizer_states=False (bf16 moments on tensors of their own). With --prefetch-bytes, each
of ours runs once per distance given ("CPUAdam @384B": the kernels' software prefetch distance,
`infinity.optim.functional.prefetch_distance`, set before each of its calls), in the same rounds,
and is compared with torch's at each; without it, at the process's distance (the default, or
$INFINITY_PREFETCH_BYTES). The JSON beside the report has every round, the command and the
commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ELEMENTS_PER_TENSOR = 1 << 24
LR = 1e-6  # small: the values stay where they are over many steps of every method


def torch_has_fused_adagrad() -> bool:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4)
    try:
        torch.optim.Adagrad([p], fused=True).step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


class Shard:
    """The parameters (with gradients) that every method steps, as a few fp32 tensors."""

    def __init__(self, num_params: int) -> None:
        num_tensors = max(1, round(num_params / ELEMENTS_PER_TENSOR))
        sizes = [num_params // num_tensors + (i < num_params % num_tensors) for i in range(num_tensors)]
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3

    def moments(self, value: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [torch.full_like(p, value, dtype=dtype) for p in self.params]

    def share(self, opt: torch.optim.Optimizer, **moments: list[torch.Tensor]) -> torch.optim.Optimizer:
        """Points opt's state at the shared moment tensors (torch's layout)."""
        for i, p in enumerate(self.params):
            opt.state[p] = {"step": torch.tensor(1.0), **{k: v[i] for k, v in moments.items()}}
        return opt


class ForeachLion:
    """Lion with torch's foreach ops, in the kernel's order: c = lerp(m, g, 1 - beta1),
    p = p * (1 - lr * wd) - lr * sign(c), m = lerp(m, g, 1 - beta2)."""

    def __init__(self, params, exp_avgs, lr, betas, weight_decay) -> None:
        self.params, self.exp_avgs = list(params), exp_avgs
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        direction = torch._foreach_lerp(self.exp_avgs, grads, 1 - self.betas[0])
        torch._foreach_sign_(direction)
        torch._foreach_mul_(self.params, 1 - self.lr * self.weight_decay)
        torch._foreach_add_(self.params, direction, alpha=-self.lr)
        torch._foreach_lerp_(self.exp_avgs, grads, 1 - self.betas[1])


def methods(shard: Shard, bf16_moments: bool) -> tuple[dict, list[tuple[str, str]]]:
    """The timed callables by name, and the (torch, ours) pairs to compare."""
    from infinity.optim import CPUAdagrad, CPUAdam, CPULion

    adam = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    m, v = shard.moments(1e-4), shard.moments(1e-6)
    fns = {"CPUAdam": shard.share(CPUAdam(shard.params, **adam), exp_avg=m, exp_avg_sq=v).step,
           "AdamW(fused)": shard.share(torch.optim.AdamW(shard.params, fused=True, **adam),
                                       exp_avg=m, exp_avg_sq=v).step,
           "AdamW(foreach)": shard.share(torch.optim.AdamW(shard.params, foreach=True, **adam),
                                         exp_avg=m, exp_avg_sq=v).step}
    pairs = [("AdamW(fused)", "CPUAdam"), ("AdamW(foreach)", "CPUAdam")]

    adagrad = dict(lr=LR, lr_decay=0.0, weight_decay=0.01, eps=1e-10)
    total = shard.moments(0.1)
    fns["CPUAdagrad"] = shard.share(CPUAdagrad(shard.params, **adagrad), sum=total).step
    if torch_has_fused_adagrad():
        fns["Adagrad(fused)"] = shard.share(torch.optim.Adagrad(shard.params, fused=True, **adagrad), sum=total).step
        pairs.append(("Adagrad(fused)", "CPUAdagrad"))
    fns["Adagrad(foreach)"] = shard.share(torch.optim.Adagrad(shard.params, foreach=True, **adagrad), sum=total).step
    pairs.append(("Adagrad(foreach)", "CPUAdagrad"))

    lion = dict(lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    momentum = shard.moments(1e-4)
    fns["CPULion"] = shard.share(CPULion(shard.params, **lion), exp_avg=momentum).step
    fns["Lion(foreach)"] = ForeachLion(shard.params, momentum, **lion).step
    pairs.append(("Lion(foreach)", "CPULion"))

    if bf16_moments:
        low = dict(fp32_optimizer_states=False)
        fns["CPUAdam bf16"] = shard.share(CPUAdam(shard.params, **adam, **low),
                                          exp_avg=shard.moments(1e-4, torch.bfloat16),
                                          exp_avg_sq=shard.moments(1e-6, torch.bfloat16)).step
        fns["CPUAdagrad bf16"] = shard.share(CPUAdagrad(shard.params, **adagrad, **low),
                                             sum=shard.moments(0.1, torch.bfloat16)).step
        fns["CPULion bf16"] = shard.share(CPULion(shard.params, **lion, **low),
                                          exp_avg=shard.moments(1e-4, torch.bfloat16)).step
        pairs += [("AdamW(fused)", "CPUAdam bf16"), ("Adagrad(fused)" if "Adagrad(fused)" in fns else
                                                     "Adagrad(foreach)", "CPUAdagrad bf16"),
                  ("Lion(foreach)", "CPULion bf16")]
    return fns, pairs


def at_distances(fns: dict, pairs: list[tuple[str, str]], distances: list[int]) -> tuple[dict, list]:
    """Each of ours (the second of a pair) once per prefetch distance, under a name that says it."""
    from infinity.optim.functional import prefetch_distance

    ours = {o for _, o in pairs}
    out = {name: fn for name, fn in fns.items() if name not in ours}

    def at(fn, d):
        def step():
            prefetch_distance(d)
            fn()
        return step

    for name in ours:
        for d in distances:
            out[f"{name} @{d}B"] = at(fns[name], d)
    return out, [(t, f"{o} @{d}B") for t, o in pairs for d in distances]


def time_pairs(fns: dict, pairs: list[tuple[str, str]], rounds: int) -> tuple[dict, dict]:
    """Each pair's two methods back to back, every pair once per round, each round starting one
    pair later and swapping which of the two goes first, after a warm-up. Returns every method's
    times and every pair's per-round ratio (torch's time / ours, from the same pair's run)."""
    for fn in fns.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    ratios: dict[str, list[float]] = {f"{t} / {o}": [] for t, o in pairs}
    for r in range(rounds):
        for theirs, ours in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
            took = {}
            for name in ((theirs, ours) if r % 2 == 0 else (ours, theirs)):
                start = time.perf_counter()
                fns[name]()
                took[name] = time.perf_counter() - start
                seconds[name].append(took[name])
            ratios[f"{theirs} / {ours}"].append(took[theirs] / took[ours])
    return seconds, ratios


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(seconds: dict[str, list[float]], ratios: dict[str, list[float]], num_params: int) -> dict:
    times = {name: {**spread(ts), "gparams_per_s": num_params / statistics.median(ts) / 1e9}
             for name, ts in seconds.items()}
    return {"seconds": times, "ratios": {name: spread(r) for name, r in ratios.items()}}


def git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                         check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "infinity/optim", "csrc/adam", "bench"],
                           cwd=root, capture_output=True, text=True, check=False).stdout.strip()
    return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"


def machine() -> dict:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    from infinity.optim import simd_path
    from infinity.optim.functional import prefetch_distance
    return {"cpu": model, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "simd": simd_path(),
            "prefetch_bytes": prefetch_distance()}


def report(result: dict) -> None:
    print(f"\n{result['num_params'] / 1e6:g}M params, {result['rounds']} rounds, {result['machine']['torch_threads']}"
          f" threads, commit {result['git']}")
    for name, s in result["seconds"].items():
        print(f"  {name:20s} {s['median'] * 1e3:9.2f} ms  [{s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f}]"
              f"  {s['gparams_per_s']:6.2f} Gparam/s")
    for name, r in result["ratios"].items():
        print(f"  {name:34s} {r['median']:6.2f}x  [{r['min']:.2f}-{r['max']:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="fp32 parameters in all (default 100e6)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds after the warm-up (default 7)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's)")
    parser.add_argument("--bf16-moments", action="store_true", help="also time ours with bf16 moments")
    parser.add_argument("--prefetch-bytes", type=int, nargs="+", default=None,
                        help="run ours at each of these prefetch distances (bytes of an fp32 stream, 0: none)")
    parser.add_argument("--out", default="", help="JSON path (default bench/results/cpu_optim.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_params = int(args.params)
    shard = Shard(num_params)
    info = machine()  # before a sweep changes the prefetch distance
    fns, pairs = methods(shard, args.bf16_moments)
    if args.prefetch_bytes:
        fns, pairs = at_distances(fns, pairs, args.prefetch_bytes)
    seconds, ratios = time_pairs(fns, pairs, args.rounds)
    result = {"command": " ".join(["python", "bench/bench_cpu_optim.py", *sys.argv[1:]]), "git": git_commit(),
              "machine": info, "num_params": num_params, "num_tensors": len(shard.params),
              "rounds": args.rounds, **summarize(seconds, ratios, num_params), "rounds_seconds": seconds,
              "rounds_ratios": ratios}
    report(result)
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results", "cpu_optim.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
