"""A model whose training state exceeds this machine's memory, through `infinity finetune`'s
built-in config, against its two floors (issue [3/7]):

    python bench/bench_3b.py --nvme-path /work --output bench/results/finetune_3b_floors.json
    python bench/bench_3b.py --clip 0 --nvme-path /work --output ...   # the built-in config, unclipped
    python bench/bench_3b.py --model llama-tiny --layers 2 4 --steps 3 --nvme-path /tmp  # a smoke run

The step: `infinity finetune --model MODEL --steps S --seq-len L --sample-tokens 0 --nvme-path DIR
--metrics M` (its built-in config: parameters and optimizer state on NVMe, gradient clipping 1.0,
batch 4), steps 2 and later (the first step's update runs inside the second step's forward).
Its bytes read and written and its waits are the engine's per-step report (`--metrics`).

The read + write floor: each step's bytes over the disk measured before and after the run, at
the faster of two measures of it (a floor is the least the disk allows): 1 GiB in one buffer
(bench_user_configs.disk_gbps, 8 MiB blocks at queue depth 32), and 8 GiB a file in 8 MiB
requests, 32 in flight each way, as a step that moves about 100 GB streams its pieces
(bench_user_configs.sustained_gbps; 5-20% slower on this machine's virtio disk). Reads at the read
rate plus writes at the write rate, or both at once, whichever is less.

The compute floor: the same engine with everything in CPU memory (`--offload cpu`), which the
whole model cannot have here. It is measured on the model's shapes with fewer layers (--layers,
two counts) and carried to the full count along the line through them (a step's compute is a
fixed part, embedding, head and loss, plus the same work per layer), from the median of steps 2
and later over --floor-rounds runs of each count, interleaved. Carrying 2 and 4 layers to 28
multiplies the noise of their difference by 13: single runs an hour apart gave 89 and 121 s for
llama-3b (finetune_3b.md).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_user_configs as user  # noqa: E402

# Runs `infinity finetune` (argv: preset, layers, clipping, the rest) on a preset with its layer
# count replaced (layers > 0) and the built-in config's gradient clipping replaced (clipping >= 0).
PATCHED = """
import sys
import infinity.apps.finetune as finetune
from infinity.apps.cli import main
from infinity.apps.models.presets import PRESETS
name, layers, clip = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if layers > 0:
    name = f"{name}@{layers}"
    PRESETS[name] = dict(PRESETS[sys.argv[1]], num_hidden_layers=layers)
if clip >= 0:
    built_in = finetune._default_config
    def with_clip(*a, **k):
        config, chose = built_in(*a, **k)
        return {**config, "gradient_clipping": clip}, chose + f"; gradient_clipping {clip} (bench_3b.py --clip)"
    finetune._default_config = with_clip
sys.exit(main(["finetune", "--model", name, *sys.argv[4:]]))
"""


def finetune(argv: list[str], metrics: str, model: str, layers: int = 0, clip: float = -1.0) -> dict:
    """One `infinity finetune` in its own process; its --metrics."""
    cmd = [sys.executable, "-c", PATCHED, model, str(layers), str(clip), *argv]
    shown = f"{model}@{layers}" if layers else model
    print(f"$ infinity finetune --model {shown} " + " ".join(argv) +
          (f"  # built-in config with gradient_clipping {clip}" if clip >= 0 else ""), flush=True)
    subprocess.run(cmd + ["--metrics", metrics], check=True, stdout=subprocess.DEVNULL)
    with open(metrics, encoding="utf-8") as f:
        return json.load(f)


def later(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 4], help="layer counts of the compute floor runs")
    parser.add_argument("--floor-rounds", type=int, default=2, help="runs of each layer count, interleaved")
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--disk-bytes", type=int, default=8 << 30, help="bytes a file of the sustained disk measure")
    parser.add_argument("--clip", type=float, default=-1.0,
                        help="replace the built-in config's gradient_clipping (1.0) by this (0: none)")
    parser.add_argument("--output")
    args = parser.parse_args()
    from infinity.apps.models.presets import param_count, preset

    cfg = preset(args.model)
    work = tempfile.mkdtemp(prefix="bench-3b-", dir=args.nvme_path)
    common = ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--sample-tokens", "0"]
    try:
        disks, bursts = [user.sustained_gbps(work, args.disk_bytes)], [user.disk_gbps(work, 1 << 30)]
        nvme = finetune(common + ["--nvme-path", work], os.path.join(work, "nvme.json"), args.model, clip=args.clip)
        disks.append(user.sustained_gbps(work, args.disk_bytes))
        bursts.append(user.disk_gbps(work, 1 << 30))
        small = {n: [] for n in args.layers}
        for r in range(args.floor_rounds):  # interleaved: a slow minute of this VM lands on both counts
            for n in args.layers:
                small[n].append(finetune(common + ["--offload", "cpu"], os.path.join(work, f"cpu{n}_{r}.json"),
                                         args.model, n, args.clip))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (a, b), full = args.layers, cfg["num_hidden_layers"]
    ta, tb = (statistics.median(t for run in small[n] for t in run["step_s"][1:]) for n in (a, b))
    compute = ta + (tb - ta) / (b - a) * (full - a)
    med = lambda key: min(statistics.median(d[key] for d in ds) for ds in (disks, bursts))  # noqa: E731
    steps = []
    for s, r, w, wait in zip(nvme["step_s"], nvme["nvme_read_bytes"], nvme["nvme_write_bytes"], nvme["io_wait_s"]):
        io = min(r / 1e9 * med("read_s_per_gb") + w / 1e9 * med("write_s_per_gb"), max(r, w) / 1e9 * med("both_s_per_gb"))
        steps.append({"step_s": s, "read_gb": r / 1e9, "write_gb": w / 1e9, "wait_s": wait, "io_floor_s": io,
                      "over_max_floors": s / max(io, compute)})
    ratio = later([x["over_max_floors"] for x in steps])
    print(f"{args.model}: {param_count(cfg) / 1e9:.2f}B parameters, {full} layers, batch 4 x {args.seq_len}"
          + (f", gradient_clipping {args.clip}" if args.clip >= 0 else ""))
    for k, x in enumerate(steps):
        print(f"  step {k}: {x['step_s']:.1f} s, read {x['read_gb']:.1f} / write {x['write_gb']:.1f} GB, "
              f"waited {x['wait_s']:.1f} s, I/O floor {x['io_floor_s']:.1f} s, / max(floors) {x['over_max_floors']:.2f}")
    print(f"  compute floor {compute:.1f} s (in CPU memory: {a} layers {ta:.2f} s, {b} layers {tb:.2f} s a step)")
    print(f"  steps 1-: step / max(floors) median {ratio:.2f}; peak RSS {nvme['peak_rss_bytes'] / 1e9:.2f} GB")
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "commit": commit,
                       "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
                       "params": param_count(cfg), "clip": args.clip, "disk": disks, "disk_1gib": bursts,
                       "compute_floor_s": compute, "compute_runs": {str(n): small[n] for n in small},
                       "floor_rounds": args.floor_rounds, "nvme_run": nvme, "steps": steps,
                       "over_max_floors": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
