"""Adam step throughput on this CPU: infinity's CPUAdam against torch and DeepSpeed.

    python bench/bench_adam.py            # 100M and 500M params, 1 and 2 threads (~25 min)
    python bench/bench_adam.py --quick    # 32M params, a smoke run (~1 min)

DeepSpeed's DeepSpeedCPUAdam is timed in a second interpreter that has it (default
/work/venv-ds/bin/python, made with `python3 -m venv /work/venv-ds &&
/work/venv-ds/bin/pip install torch==2.13.0 deepspeed==0.19.8`), spawned on this same file with
DS_ACCELERATOR=cpu; it is skipped, and said so, when that interpreter is missing.

[Note: what is measured]
Parameters are fp32 tensors of about 16M elements (DESIGN: one unit shard is of that order).
Every optimizer in a process updates the same param, grad, exp_avg and exp_avg_sq tensors (their
states are pointed at one pair of moment tensors), so no method runs on warmer memory than
another, and 500M parameters fit: 4 x 2 GB plus 1 GB of bf16 copies.
- plain step: CPUAdam, torch.optim.AdamW(foreach=True), AdamW(fused=True), DeepSpeedCPUAdam.
  28 bytes move per parameter: param, exp_avg, exp_avg_sq read and written, grad read.
- public API side by side: CPUAdam.step and AdamW(fused=True).step alone, strictly alternated
  (each step starts right after the other's), as one would compare them by hand. This is the
  comparison that counts: torch's OpenMP threads spin for about 10 ms after each of its
  parallel regions, and a step that starts in that window shares the cores with them ([Note:
  torch's OpenMP team] in csrc/adam/openmp_team.h). In the rotation below, CPUAdam mostly
  runs right after the stream method, not after torch.
- stream: the memory-bandwidth figure of this run, the same access pattern with no Adam: four
  fp32 streams read and three written back in place, one add each, same SIMD width, prefetch
  and threads as ours (infinity._adam.Updater.stream_inplace); 28 bytes a parameter. On this
  machine the Adam kernel can beat it: the arithmetic between a vector's loads and its stores
  seems to suit the memory system better than back-to-back read-modify-writes do.
- engine update, what a ZeRO-offload step does after backward: unscale/clip the gradient,
  Adam, write the bf16 copy of the new param. Ours is one pass (adam_update with grad_scale and
  half_out: 30 bytes a parameter). The way DeepSpeed's ZeRO and torch do it is three: grad.mul_,
  the optimizer step, bf16.copy_(param): 8 + 28 + 6 (+2 for the write-allocate) bytes.
Each timing is one optimizer step over all tensors. Methods run interleaved, round after round,
each round starting one method later, so that load from other processes and the after-effects
of one method on the next hit all of them alike. After a warm-up round, times are medians of
the timed rounds and ratios medians of per-round ratios, each with its spread (quartiles and
extremes; every round is in the JSON beside the report, with the git commit that ran). The
machine is shared: a round during which other processes kept more than BUSY_LIMIT of a core
busy (read from /proc/stat) is redone, for up to --patience seconds, and the report says how
many were redone and how busy the kept ones were.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

ELEMENTS_PER_TENSOR = 1 << 24  # "tensors of about 16M elements"
BYTES_PLAIN = 28
BYTES_ENGINE_ONE_PASS = 30
BYTES_ENGINE_THREE_PASS = 44
BUSY_LIMIT = 0.15  # cores other processes may keep busy during a kept round
GRAD_SCALE = 1.0 + 2.0**-20  # any multiplier; this one keeps values where they are
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DEFAULT_DS_PYTHON = "/work/venv-ds/bin/python"
SIDE_BY_SIDE = "infinity / torch_fused (public API, side by side)"


@dataclass(kw_only=True, slots=True)
class Config:
    """One benchmark configuration."""

    num_params: int
    """Total fp32 parameters, split into tensors of about ELEMENTS_PER_TENSOR."""
    num_threads: int
    """Threads for every method: torch.set_num_threads, OMP_NUM_THREADS, CPUAdam's pool."""
    rounds: int
    """Timed rounds after one warm-up round (twice as many for the side-by-side pair)."""
    patience: float
    """Seconds to keep redoing rounds that other processes disturbed (see time_methods)."""


@dataclass(slots=True)
class Timings:
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, t: float) -> None:
        self.seconds.setdefault(name, []).append(t)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])


# ---------------------------------------------------------------------------------------------
# Shared tensors and the methods that update them


class Shard:
    """param / grad / exp_avg / exp_avg_sq (fp32) and a bf16 copy, as lists of tensors."""

    def __init__(self, num_params: int) -> None:
        num_tensors = max(1, round(num_params / ELEMENTS_PER_TENSOR))
        sizes = [num_params // num_tensors + (i < num_params % num_tensors)
                 for i in range(num_tensors)]
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        self.exp_avg = [torch.full_like(p, 1e-4) for p in self.params]
        self.exp_avg_sq = [torch.full_like(p, 1e-6) for p in self.params]
        self.half = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in self.params]

    def share_state(self, opt: torch.optim.Optimizer, step) -> torch.optim.Optimizer:
        """Points the optimizer's state at the shared moments (torch's layout)."""
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            opt.state[p] = {"step": step(), "exp_avg": m, "exp_avg_sq": v}
        return opt

    def unscale(self) -> None:
        for p in self.params:
            p.grad.mul_(GRAD_SCALE)

    def copy_to_half(self) -> None:
        for h, p in zip(self.half, self.params):
            h.copy_(p.detach())


def torch_methods(shard: Shard) -> dict:
    def torch_step():
        return torch.tensor(1.0)

    foreach = shard.share_state(torch.optim.AdamW(shard.params, foreach=True, **HYPER),
                                torch_step)
    fused = shard.share_state(torch.optim.AdamW(shard.params, fused=True, **HYPER), torch_step)

    def fused_three_pass():
        shard.unscale()
        fused.step()
        shard.copy_to_half()

    return {"torch_foreach": foreach.step, "torch_fused": fused.step,
            "engine_torch_three_pass": fused_three_pass}


def infinity_methods(shard: Shard, num_threads: int) -> dict:
    from infinity.optim import CPUAdam, adam_update
    from infinity.optim.functional import torch_thread_updater

    ours = shard.share_state(CPUAdam(shard.params, num_threads=num_threads, **HYPER),
                             lambda: torch.tensor(1.0))
    updater = torch_thread_updater()  # the threads CPUAdam runs on
    beta1, beta2 = HYPER["betas"]

    def stream():
        for p, m, v in zip(shard.params, shard.exp_avg, shard.exp_avg_sq):
            updater.stream_inplace(p.data_ptr(), p.grad.data_ptr(), m.data_ptr(), v.data_ptr(),
                                   p.numel(), num_threads)

    def engine_one_pass():
        for p, m, v, h in zip(shard.params, shard.exp_avg, shard.exp_avg_sq, shard.half):
            adam_update(p.detach(), p.grad, m, v, step=2, lr=HYPER["lr"], beta1=beta1,
                        beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                        grad_scale=GRAD_SCALE, half_out=h, num_threads=num_threads,
                        updater=updater)

    return {"stream": stream, "infinity": ours.step, "engine_infinity_one_pass":
            engine_one_pass}


def deepspeed_methods(shard: Shard) -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    ds = shard.share_state(DeepSpeedCPUAdam(shard.params, **HYPER), lambda: 1)
    fused = shard.share_state(torch.optim.AdamW(shard.params, fused=True, **HYPER),
                              lambda: torch.tensor(1.0))

    def ds_three_pass():
        shard.unscale()
        ds.step()
        shard.copy_to_half()

    return {"deepspeed": ds.step, "torch_fused": fused.step,
            "engine_deepspeed_three_pass": ds_three_pass}


def time_methods(methods: dict, rounds: int, patience: float,
                 rotate: bool = True) -> tuple[Timings, dict]:
    """Times every method once per round, `rounds` rounds after a warm-up one; each round starts
    one method later when `rotate`, else all run in the same order every round.

    A round during which other processes kept more than BUSY_LIMIT of a core busy is thrown
    away and run again, for up to `patience` seconds; after that rounds are kept as they come
    (the report says how busy the machine was).
    """
    for fn in methods.values():  # warm-up: page faults, lazily started threads
        fn()
    timings, busy_kept, rejected = Timings({name: [] for name in methods}), [], 0
    deadline = time.monotonic() + patience
    names = list(methods)
    while len(busy_kept) < rounds:
        # Each round starts one method later, so that none always follows the same one.
        start = (len(busy_kept) + rejected) % len(names) if rotate else 0
        order = names[start:] + names[:start]
        seconds, busy = run_watching_others(lambda: {name: timed(methods[name]) for name in order})
        if busy > BUSY_LIMIT and time.monotonic() < deadline:
            rejected += 1
            time.sleep(1.0)
            continue
        busy_kept.append(busy)
        for name, t in seconds.items():
            timings.add(name, t)
    return timings, {"rounds_rejected": rejected, "others_busy_max": max(busy_kept)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Machine state


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]  # all, idle + iowait


def run_watching_others(fn):
    """Runs fn(); returns its result and how many cores other processes kept busy meanwhile
    (all CPU time on the machine minus this process's, over the wall time)."""
    hz = os.sysconf("SC_CLK_TCK")
    total0, idle0 = _cpu_jiffies()
    own0, wall0 = sum(os.times()[:2]), time.perf_counter()
    out = fn()
    total1, idle1 = _cpu_jiffies()
    own1, wall1 = sum(os.times()[:2]), time.perf_counter()
    busy_all = ((total1 - total0) - (idle1 - idle0)) / hz
    return out, max(0.0, busy_all - (own1 - own0)) / (wall1 - wall0)


def machine_description() -> dict:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__}


def git_state() -> dict:
    """The commit this ran at, and which files that the measurement depends on differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return out.stdout if out.returncode == 0 else ""

    modified = git("status", "--porcelain", "--", "infinity/optim", "csrc/adam",
                   "bench/bench_adam.py")
    return {"commit": git("rev-parse", "HEAD").strip() or "unknown",
            "modified": [line[3:] for line in modified.splitlines()]}


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 2**20
    return 0.0


# ---------------------------------------------------------------------------------------------
# Runs


def run_in_process(config: Config) -> dict:
    """Ours and torch's methods on one shard, interleaved; then the public API side by side."""
    torch.set_num_threads(config.num_threads)
    shard = Shard(config.num_params)
    methods = {**infinity_methods(shard, config.num_threads), **torch_methods(shard)}
    timings, noise = time_methods(methods, config.rounds, config.patience)
    pair = {name: methods[name] for name in ("torch_fused", "infinity")}
    pair_timings, pair_noise = time_methods(pair, 2 * config.rounds, config.patience,
                                            rotate=False)
    del methods, pair, shard
    gc.collect()
    return {"noise": noise, "seconds": timings.seconds,
            "side_by_side": {"noise": pair_noise, "seconds": pair_timings.seconds}}


def run_deepspeed(config: Config, ds_python: str) -> dict | None:
    """DeepSpeed's methods in the interpreter that has it, on a shard of its own."""
    if not os.path.exists(ds_python):
        return None
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(config.num_threads))
    arg = json.dumps({"num_params": config.num_params, "num_threads": config.num_threads,
                      "rounds": config.rounds, "patience": config.patience})
    out = subprocess.run([ds_python, os.path.abspath(__file__), "--deepspeed-worker", arg],
                         env=env, capture_output=True, text=True, check=False)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"deepspeed worker failed (exit {out.returncode}):\n{out.stderr[-3000:]}",
          file=sys.stderr)
    return None


def deepspeed_worker(arg: str) -> None:
    config = Config(**json.loads(arg))
    torch.set_num_threads(config.num_threads)
    import deepspeed

    shard = Shard(config.num_params)
    methods = deepspeed_methods(shard)
    timings, noise = time_methods(methods, config.rounds, config.patience)
    print("RESULT " + json.dumps({"noise": noise, "seconds": timings.seconds,
                                  "deepspeed": deepspeed.__version__}))


# ---------------------------------------------------------------------------------------------
# Report


def summarize(config: Config, ours: dict, ds: dict | None) -> dict:
    n = config.num_params
    t = Timings(dict(ours["seconds"]))
    rows = {name: t.median(name) for name in t.seconds}
    if ds is not None:
        td = Timings(dict(ds["seconds"]))
        for name in ("deepspeed", "engine_deepspeed_three_pass"):
            rows[name] = td.median(name)
        rows["torch_fused (deepspeed process)"] = td.median("torch_fused")
    bytes_per = {"engine_infinity_one_pass": BYTES_ENGINE_ONE_PASS,
                 "engine_torch_three_pass": BYTES_ENGINE_THREE_PASS,
                 "engine_deepspeed_three_pass": BYTES_ENGINE_THREE_PASS}
    table = {name: {"seconds": s, "gparams_per_s": n / s / 1e9,
                    "gb_per_s": n * bytes_per.get(name, BYTES_PLAIN) / s / 1e9}
             for name, s in rows.items()}
    # Ratios are medians of per-round ratios (both methods timed in the same round, seconds
    # apart), which cancels the slow drift of this machine's memory bandwidth.
    spreads = {}

    def paired(seconds: dict, slow: str, fast: str, name: str | None = None) -> float:
        per_round = [a / b for a, b in zip(seconds[slow], seconds[fast])]
        if name is not None:
            spreads[name] = spread(per_round)
        return statistics.median(per_round)

    ts, pair = ours["seconds"], ours["side_by_side"]["seconds"]
    side_by_side = {"rounds": len(pair["infinity"]), "noise": ours["side_by_side"]["noise"],
                    "torch_fused_seconds": spread(pair["torch_fused"]),
                    "infinity_seconds": spread(pair["infinity"])}
    ratios = {name: paired(seconds, slow, fast, name) for name, seconds, slow, fast in [
        (SIDE_BY_SIDE, pair, "torch_fused", "infinity"),
        ("infinity / torch_fused", ts, "torch_fused", "infinity"),
        ("infinity / torch_foreach", ts, "torch_foreach", "infinity"),
        ("infinity / stream", ts, "stream", "infinity"),
        ("engine one pass / torch three pass", ts, "engine_torch_three_pass",
         "engine_infinity_one_pass"),
    ]}
    if ds is not None:
        # DeepSpeed ran in another process, minutes apart: compared directly, and through
        # torch_fused, which both processes timed in their rounds (the steadier figure).
        td = ds["seconds"]
        ratios["infinity / deepspeed (direct)"] = rows["deepspeed"] / rows["infinity"]
        ratios["infinity / deepspeed (via torch_fused)"] = (
            ratios["infinity / torch_fused"] * paired(td, "deepspeed", "torch_fused"))
        ratios["engine one pass / deepspeed three pass (direct)"] = (
            rows["engine_deepspeed_three_pass"] / rows["engine_infinity_one_pass"])
        ratios["engine one pass / deepspeed three pass (via torch_fused)"] = (
            paired(ts, "torch_fused", "engine_infinity_one_pass")
            * paired(td, "engine_deepspeed_three_pass", "torch_fused"))
    return {"num_params": n, "num_threads": config.num_threads, "table": table,
            "ratios": ratios, "ratio_spreads": spreads, "side_by_side": side_by_side,
            "noise": [ours["noise"]] + ([] if ds is None else [ds["noise"]]),
            "rounds_seconds": {**ours["seconds"], **({} if ds is None else {
                f"{name} (deepspeed process)": t for name, t in ds["seconds"].items()})}}


def spread(values: list[float]) -> dict:
    """Median, quartiles and extremes."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "p25": q1, "p75": q3, "min": min(values),
            "max": max(values)}


def print_summary(s: dict) -> None:
    print(f"\n== {s['num_params'] / 1e6:.0f}M params, {s['num_threads']} thread(s) ==")
    for name, row in s["table"].items():
        print(f"  {name:34s} {row['seconds'] * 1e3:9.1f} ms {row['gparams_per_s']:6.2f} Gparam/s"
              f" {row['gb_per_s']:6.1f} GB/s")
    for name, r in s["ratios"].items():
        sp = s["ratio_spreads"].get(name)
        quartiles = "" if sp is None else f"  [{sp['p25']:.2f}, {sp['p75']:.2f}]"
        print(f"  {name:58s} {r:5.2f}x{quartiles}")


def write_markdown(path: str, command: str, machine: dict, simd: str, ds_version: str | None,
                   git: dict, summaries: list[dict]) -> None:
    modified = (" (with changes to " + ", ".join(git["modified"]) + ")") if git["modified"] else ""
    lines = [f"# Adam benchmark, {datetime.date.today().isoformat()}", "",
             f"Command: `{command}`", "",
             f"Code: commit {git['commit']}{modified}.", "",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB;"
             f" Linux {machine['kernel']}; Python {machine['python']}; torch {machine['torch']};"
             f" DeepSpeed {ds_version or 'not run'}; infinity SIMD path {simd}.", "",
             "Times are medians over the timed rounds; ratios are medians of per-round ratios"
             " (how many times faster ours is), with their quartiles and extremes. GB/s counts"
             " 28 bytes a parameter for a plain step, 30 for the one-pass engine update, 44 for"
             " the three-pass one. A round during which other processes kept more than"
             f" {BUSY_LIMIT} of a core busy was redone.", ""]
    for s in summaries:
        noise = "; ".join(f"{n['rounds_rejected']} rounds redone, others kept at most"
                          f" {n['others_busy_max']:.2f} cores busy in a kept one"
                          for n in s["noise"])
        pair = s["side_by_side"]
        pair_noise = (f"{pair['noise']['rounds_rejected']} rounds redone, others kept at most"
                      f" {pair['noise']['others_busy_max']:.2f} cores busy in a kept one")
        ratio = s["ratio_spreads"][SIDE_BY_SIDE]

        def ms(sp: dict) -> list[str]:
            return [f"{sp['median'] * 1e3:.1f}", f"{sp['p25'] * 1e3:.1f}-{sp['p75'] * 1e3:.1f}",
                    f"{sp['min'] * 1e3:.1f}-{sp['max'] * 1e3:.1f}"]

        lines += [f"## {s['num_params'] / 1e6:.0f}M params, {s['num_threads']} thread(s)", "",
                  f"Public API side by side, {pair['rounds']} rounds of `AdamW(fused=True).step()`"
                  f" then `CPUAdam.step()`, each right after the other ({pair_noise}):", "",
                  "| | median | quartiles | min-max |", "|---|---:|---:|---:|",
                  "| torch.optim.AdamW(fused=True).step, ms | "
                  + " | ".join(ms(pair["torch_fused_seconds"])) + " |",
                  "| infinity.optim.CPUAdam.step, ms | "
                  + " | ".join(ms(pair["infinity_seconds"])) + " |",
                  f"| ratio (fused time / CPUAdam time) | {ratio['median']:.3f} |"
                  f" {ratio['p25']:.3f}-{ratio['p75']:.3f} |"
                  f" {ratio['min']:.3f}-{ratio['max']:.3f} |", "",
                  "All methods, rotating order:", "",
                  f"Noise (this process; DeepSpeed's): {noise}.", "",
                  "| method | ms | Gparam/s | GB/s |", "|---|---:|---:|---:|"]
        for name, row in s["table"].items():
            lines.append(f"| {name} | {row['seconds'] * 1e3:.1f} | {row['gparams_per_s']:.2f} |"
                         f" {row['gb_per_s']:.1f} |")
        lines += ["", "| ratio | x | quartiles | min-max |", "|---|---:|---:|---:|"]
        for name, r in s["ratios"].items():
            sp = s["ratio_spreads"].get(name)
            extra = ("| |" if sp is None else
                     f"| {sp['p25']:.2f}-{sp['p75']:.2f} | {sp['min']:.2f}-{sp['max']:.2f} |")
            lines.append(f"| {name} | {r:.2f} {extra}")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32M params, 5 rounds")
    parser.add_argument("--sizes", default="100e6,500e6", help="parameter counts, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (0: by size)")
    parser.add_argument("--patience", type=float, default=-1.0,
                        help="seconds per configuration to redo rounds other processes"
                        " disturbed (default 600, 30 with --quick)")
    parser.add_argument("--ds-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter with deepspeed ('' to skip DeepSpeed)")
    parser.add_argument("--out", default="", help="markdown report (default: bench/results/"
                        "adam.md, adam_quick.md with --quick); the JSON goes beside it")
    parser.add_argument("--deepspeed-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.deepspeed_worker:
        deepspeed_worker(args.deepspeed_worker)
        return

    from infinity.optim import simd_path

    sizes = [32 << 20] if args.quick else [int(float(x)) for x in args.sizes.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    summaries, ds_version = [], None
    for num_params in sizes:
        need_gib = num_params * 22 / 2**30  # 4 fp32 arrays, bf16 copies, foreach temporaries
        if available_gib() < need_gib:
            print(f"skipping {num_params / 1e6:.0f}M params: {need_gib:.1f} GiB needed,"
                  f" {available_gib():.1f} available", file=sys.stderr)
            continue
        rounds = args.rounds or (5 if args.quick else 7 if num_params > 200e6 else 15)
        patience = args.patience if args.patience >= 0 else (30.0 if args.quick else 600.0)
        for num_threads in threads:
            config = Config(num_params=num_params, num_threads=num_threads, rounds=rounds,
                            patience=patience)
            ours = run_in_process(config)
            ds = run_deepspeed(config, args.ds_python) if args.ds_python else None
            if ds is not None:
                ds_version = ds["deepspeed"]
            summaries.append(summarize(config, ours, ds))
            print_summary(summaries[-1])

    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results", "adam_quick.md" if args.quick else "adam.md")
    command = "python bench/bench_adam.py " + " ".join(sys.argv[1:])
    machine, git = machine_description(), git_state()
    write_markdown(out, command.strip(), machine, simd_path(), ds_version, git, summaries)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"command": command.strip(), "git": git, "machine": machine,
                   "simd": simd_path(), "deepspeed": ds_version, "results": summaries}, f,
                  indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
