"""The NVMe step with gradient clipping against the same step without, and against its floors,
interleaved in one process (issue [7/7] section 2).

    python bench/bench_clip.py                       # 134M GPT, bf16, batch 2x256, 6 rounds
    python bench/bench_clip.py --layers 8 --dim 256 --vocab 4096 --micro 4 --seq 64   # 7.4M

Engines, all with the same knobs (params and optimizer state on NVMe, offload_param.max_in_cpu
0, 8 MiB aio blocks, queue depth 32; stage3_prefetch_bucket_size, sub_group_size and buffer
counts as bench_train.py gives infinity):
  * nvme, clip 1.0 and nvme, clip 0;
  * the compute floor: the same engine with params and optimizer state in CPU memory, clip 1.0;
  * plain PyTorch, clip 1.0: the fp32 module under bf16 autocast, clip_grad_norm_ and
    torch.optim.AdamW(fused=True) (the usual mixed-precision step: a reference, not a floor).
The I/O floor is the bytes a step must move (from the model's size: see main) over
the read and write GB/s of our handle with the same block size and queue depth, measured in the
same run before and after the rounds; the bytes the engine reports moving are printed beside it. Rounds interleave
the engines, each round starting with a different one; the first step of each is a warm-up.
Reports medians with min-max, and writes a timeline of one step of each NVMe engine with
--trace-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_train import batch, handle_gbps, load_gpt  # noqa: E402


def engine_config(work: str, args, *, place: str, clip: float) -> dict:
    offload = lambda extra: ({"device": "nvme", "nvme_path": work, **extra} if place == "nvme"  # noqa: E731
                             else {"device": "cpu"})
    return {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 5e8, "sub_group_size": 2.5e7, "tile_size": args.tile_size,
            "offload_param": offload({"buffer_count": 8, "max_in_cpu": 0, "buffer_size": 1e8}),
            "offload_optimizer": offload({"buffer_count": 48, "max_grad_in_cpu": args.max_grad_in_cpu}),
        },
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
    }


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=64000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block-size", type=int, default=8 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--max-grad-in-cpu", type=float, default=1e9)
    p.add_argument("--tile-size", type=int, default=1 << 25, help="zero_optimization.tile_size (0: no tiling)")
    p.add_argument("--nvme-path", default="/work")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--output")
    return p.parse_args()


ENGINES = (("nvme clip 1.0", "nvme", 1.0), ("nvme clip 0", "nvme", 0.0), ("cpu clip 1.0", "cpu", 1.0),
           ("torch clip 1.0", "torch", 1.0))


class PlainTorch:
    """The step in plain PyTorch, with the engine's calling convention."""

    def __init__(self, model: torch.nn.Module, clip: float):
        self.model, self.clip = model, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        self.report = type("Report", (), {"last": {"waits": {}, "compute_wait_s": 0.0}})()

    def __call__(self, idx, tgt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(idx, tgt)

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self):
        pass


def run_rounds(args, gpt, cfg, work: str) -> dict:
    """Interleaved steps of every engine: per engine, its step times, bytes moved, waits, losses."""
    import infinity
    from infinity.device.timeline import TIMELINE

    engines = {}
    runs = {name: {"times": [], "moved_bytes": [], "waits": [], "losses": []} for name, _, _ in ENGINES}
    try:
        for name, place, clip in ENGINES:
            torch.manual_seed(0)
            if place == "torch":
                engines[name] = PlainTorch(gpt.GPT(cfg), clip)
                continue
            sub = os.path.join(work, name.replace(" ", "_"))
            os.makedirs(sub)
            engines[name], *_ = infinity.initialize(model=gpt.GPT(cfg),
                                                   config=engine_config(sub, args, place=place, clip=clip))
        names = list(engines)
        for r in range(args.rounds + 1):  # round 0 records the order and warms up
            for n in names[r % len(names):] + names[:r % len(names)]:
                e, run = engines[n], runs[n]
                idx, tgt = batch(args.vocab, args.micro, args.seq, r)
                tracing = args.trace_dir and r == args.rounds and n.startswith("nvme")
                if tracing:
                    TIMELINE.start()
                t0 = time.perf_counter()
                loss = e(idx, tgt)
                e.backward(loss)
                e.step()
                dt = time.perf_counter() - t0
                if tracing:
                    TIMELINE.write(os.path.join(args.trace_dir, n.replace(" ", "_") + ".json"), TIMELINE.stop())
                rep = e.report.last
                run["losses"].append(round(loss.item(), 4))
                if r:
                    run["times"].append(dt)
                    run["moved_bytes"].append((rep.get("nvme_read_bytes", 0) + rep.get("optimizer_nvme_read_bytes", 0),
                                               rep.get("nvme_write_bytes", 0) + rep.get("optimizer_nvme_write_bytes", 0)))
                    run["waits"].append(rep["waits"])
                print(f"round {r} {n}: {dt:.3f} s, loss {loss.item():.4f}, waited {rep['compute_wait_s']:.3f} s",
                      flush=True)
    finally:
        for e in engines.values():
            e.close()
    return runs


def main() -> int:
    args = parse_args()
    gpt = load_gpt()
    cfg = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers,
                        heads=max(1, args.dim // 64))
    work = tempfile.mkdtemp(prefix="bench-clip-", dir=args.nvme_path)
    try:
        gbps_before = [statistics.median(x) for x in handle_gbps(work, args.block_size, args.queue_depth)]
        runs = run_rounds(args, gpt, cfg, work)
        gbps_after = [statistics.median(x) for x in handle_gbps(work, args.block_size, args.queue_depth)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    read_gbps = statistics.median([gbps_before[0], gbps_after[0]])
    write_gbps = statistics.median([gbps_before[1], gbps_after[1]])
    n_params = cfg.num_params()
    # The I/O floor: the bytes a step must move, from the model, as issue [7/7] counts them: bf16
    # params read once (backward; max_in_cpu 0) and written once, fp32 master, exp_avg and
    # exp_avg_sq read and written, and gradients beyond max_grad_in_cpu spilled (written and
    # read; with clipping only). The same floor for both NVMe engines: the unclipped one also
    # reads the params in forward, which a better schedule need not.
    result = {"args": vars(args), "params": n_params, "date": datetime.datetime.now().isoformat(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE).stdout.strip(),
              "handle_gbps": {"read": [gbps_before[0], gbps_after[0]], "write": [gbps_before[1], gbps_after[1]]},
              "engines": runs, "io_floor_s": {}, "ratio_to_floors": {}}
    compute = runs["cpu clip 1.0"]["times"]
    print(f"\n{n_params / 1e6:.1f}M parameters; handle read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s")
    for n, run in runs.items():
        line = f"{n:>14}: step {spread(run['times'])} s"
        if n.startswith("nvme"):
            rb, wb = (statistics.median(x) for x in zip(*run["moved_bytes"]))
            spilled = max(0.0, n_params - args.max_grad_in_cpu) if "clip 1.0" in n else 0.0
            io_floor = ((14 * n_params + 4 * spilled) / read_gbps + (14 * n_params + 4 * spilled) / write_gbps) / 1e9
            ratios = [t / max(io_floor, c) for t, c in zip(run["times"], compute)]
            result["io_floor_s"][n], result["ratio_to_floors"][n] = io_floor, ratios
            line += (f" | moved {rb / 1e9:.2f} GB read, {wb / 1e9:.2f} GB written; I/O floor {io_floor:.3f} s"
                     f" | step / max(floors) {spread(ratios)}")
        print(line)
    clip_ratio = [a / b for a, b in zip(runs["nvme clip 1.0"]["times"], runs["nvme clip 0"]["times"])]
    result["clip_over_noclip"] = clip_ratio
    print(f"clipped / unclipped, per round: {spread(clip_ratio)}")
    for a, b in (("nvme clip 1.0", "cpu clip 1.0"), ("cpu clip 1.0", "torch clip 1.0"), ("nvme clip 1.0", "torch clip 1.0")):
        ratio = [x / y for x, y in zip(runs[a]["times"], runs[b]["times"])]
        result[f"{a} / {b}"] = ratio
        print(f"{a} / {b}, per round: {spread(ratio)}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0

if __name__ == "__main__":
    sys.exit(main())
