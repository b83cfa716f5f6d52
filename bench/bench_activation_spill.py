"""Checkpointed inputs spilled to NVMe (`activation_checkpointing.nvme_path`) against keeping them
in memory, at a long sequence: peak host memory and step time ([Note: checkpointed inputs on
NVMe] in infinity/offload/activations.py).

    python bench/bench_activation_spill.py --nvme-path /work      # both modes, each in a child
    MALLOC_MMAP_THRESHOLD_=65536 /usr/bin/time -v python bench/bench_activation_spill.py --mode nvme --nvme-path /work

The model: `--layers` residual blocks of LayerNorm -> Linear(hidden, bottleneck) -> GELU ->
Linear(bottleneck, hidden), each run through `infinity.checkpointing.checkpoint`, on one
sequence of `--tokens` tokens, fp32, on the CPU (INFINITY_DEVICE=cpu). What a checkpoint keeps
is its input, tokens x hidden x 4 bytes (32 MiB at 8192 x 1024), whatever the block computes;
the bottleneck keeps the compute of a step to seconds on a 2-core machine, which leaves the I/O
less compute to hide behind than a real layer would (a pessimistic case for the step time).
A step is forward, backward and an AdamW step. Modes:
  * memory: the checkpoints keep their inputs (DeepSpeed's default, and torch's checkpoint);
  * nvme: `nvme_path` set, `nvme_min_bytes` 1 MiB: every block's input is written to a file
    after its forward and read back ahead of its recompute.
Each mode runs in a process of its own (`--mode both` starts them one after the other), so that
the peak resident set (ru_maxrss) is that mode's; the first step is a warm-up (it allocates the
files and the buffers). Run it with glibc's MALLOC_MMAP_THRESHOLD_=65536 (`--mode both` sets it
for its children): every large tensor is then its own mapping, given back when freed, whatever
glibc's dynamic threshold would have become, so that the peak RSS follows the tensors alive.
Prints one JSON line per mode: wall and CPU time of each
step (the CPU time tells a slow step from a machine shared with other work), peak RSS, and for
nvme the bytes this process wrote to storage (/proc/self/io write_bytes) per timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _run(args: argparse.Namespace) -> dict:
    os.environ["INFINITY_DEVICE"] = "cpu"
    import torch
    from torch import nn

    from infinity import checkpointing

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(args.hidden), nn.Linear(args.hidden, args.bottleneck), nn.GELU(),
                                         nn.Linear(args.bottleneck, args.hidden)) for _ in range(args.layers))
    optimizer = torch.optim.AdamW(blocks.parameters(), lr=1e-4)
    section = {"nvme_path": args.nvme_path, "nvme_min_bytes": 1 << 20} if args.mode == "nvme" else {}
    checkpointing.configure(deepspeed_config={"activation_checkpointing": section})
    x = torch.randn(args.tokens, args.hidden)
    times, cpu_times, written, losses = [], [], 0, []
    for step in range(args.steps + 1):
        before = _written_bytes()
        start, cpu_start = time.perf_counter(), time.process_time()
        h = x
        for block in blocks:
            h = h + checkpointing.checkpoint(block, h)
        loss = h.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del h
        if step:  # the first step allocates files and buffers
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            written += _written_bytes() - before
        losses.append(loss.item())
    input_bytes = args.tokens * args.hidden * 4
    return {"mode": args.mode, "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
            "checkpointed_bytes_per_step": input_bytes * args.layers,
            "step_s": times, "step_s_median": statistics.median(times), "step_cpu_s": cpu_times,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "written_bytes_per_step": written // len(times), "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["memory", "nvme", "both"], default="both")
    p.add_argument("--nvme-path", default=None, help="a directory on the NVMe drive (default: a temporary one)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--bottleneck", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="timed steps, after one warm-up step")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.nvme_path is None:
        args.nvme_path = tempfile.mkdtemp(prefix="spill-", dir=os.getcwd())
    if args.mode != "both":
        print(json.dumps(_run(args)), flush=True)
        return
    results = []
    for mode in ("memory", "nvme"):
        argv = [sys.executable, os.path.abspath(__file__), "--mode", mode]
        for name in ("nvme_path", "tokens", "hidden", "bottleneck", "layers", "steps", "threads"):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(out.strip().splitlines()[-1], flush=True)
    memory, nvme = results
    print(json.dumps({"peak_rss_saved_bytes": memory["peak_rss_bytes"] - nvme["peak_rss_bytes"],
                      "step_time_ratio": nvme["step_s_median"] / memory["step_s_median"],
                      "same_losses": memory["losses"] == nvme["losses"]}))


if __name__ == "__main__":
    main()
