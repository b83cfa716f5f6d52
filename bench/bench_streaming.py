"""The all-NVMe step when the optimizer state does not fit its pool: the streaming pipeline against
its floors, with the budgets users give (issue [3/7]), interleaved in one process.

    python bench/bench_streaming.py --rounds 5 --nvme-path /work --output streaming_134m.json
    python bench/bench_streaming.py --clip 0 --rounds 5 --nvme-path /work --output streaming_134m_noclip.json
    python bench/bench_streaming.py --rounds 5 --nvme-path /work --deepspeed /work/venv-ds/bin/python ...
    python bench/bench_streaming.py --cases stream-96m --moment-formats fp32 bf16 8bit --micro 1 --seq 64 \
        --rounds 5 --nvme-path /work --output formats_134m.json   # [4/7]: a disk-bound step, each moment format

The model is bench_user_configs.py's 134m GPT (12 x 768, vocab 64000, 134.4M parameters: 1.61 GB of
fp32 master and moments), bf16, batch 2 x 256, params and optimizer state on NVMe
(`max_in_cpu` 0 for both), aio 8 MiB blocks at queue depth 32, DeepSpeed's defaults otherwise.
The optimizer pool's budget is what users write, `offload_optimizer.buffer_count` x
`sub_group_size` fp32 elements ([Note: the pool is a budget] in
infinity/offload/optimizer/sizing.py):

  * stream-96m: 12 x 2e6 elements, 96 MB: 6% of the state;
  * stream-400m: 10 x 1e7, 400 MB: a quarter of it;
  * stream-1.6g: 16 x 2.5e7, 1.6 GB: the whole state (the pool holds it; the reference point);
  * cpu: both offloads on device "cpu", the compute floor.

The I/O floor of a case is the bytes its step moved (the engine's report, median over the
rounds) over this disk, read and written one after the other or both at once, whichever is less
(bench_user_configs.py's disk measurement, before and after the rounds): what the disk needs for
the bytes that do not stay in the pool. A step's ratio is taken per round against max(that
round's compute floor, the I/O floor), then the median (min-max). The per-step report's waits say
where the step waited (`waits`: seconds per kind of wait, summed over the step).

`--deepspeed PYTHON` also runs each fp32 streaming case's config on DeepSpeed 0.19.8, after the
rounds, one case a process (`DS_ACCELERATOR=cpu`, gloo, `--ds-steps` steps after a warm-up step):
the same file but `stage3_prefetch_bucket_size` 0, which its NVMe parameter path needs with
`max_in_cpu` 0. Its environment: `python3 -m venv /work/venv-ds && /work/venv-ds/bin/pip install
torch==2.13.0 deepspeed==0.19.8`, and Debian's libaio-dev for its AIO op (built on first use).
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
from bench_clip import spread  # noqa: E402
from bench_train import DS_SCRIPT, GPT_FILE, load_gpt  # noqa: E402


def _streaming(buffer_count: int, sub_group_size: float):
    def config(work: str) -> tuple[dict, dict | None]:
        return ({"sub_group_size": sub_group_size,
                 "offload_param": {"device": "nvme", "nvme_path": work, "buffer_count": 6, "buffer_size": 1e8,
                                   "max_in_cpu": 0},
                 "offload_optimizer": {"device": "nvme", "nvme_path": work, "buffer_count": buffer_count}},
                user.TUNED_AIO)
    return config


STREAMING = {"stream-96m": _streaming(12, 2e6), "stream-400m": _streaming(10, 1e7),
             "stream-1.6g": _streaming(16, 2.5e7)}
user.CASES.update(STREAMING)  # run_rounds builds its engines from bench_user_configs.CASES


def floor_of(moved: tuple[float, float], disks: list[dict]) -> float:
    """Seconds the disk needs for `moved` (bytes read, written): one after the other or both at
    once, whichever is less, from the medians of the disk's measurements."""
    med = lambda key: statistics.median(d[key] for d in disks)  # noqa: E731
    read_gb, write_gb = moved[0] / 1e9, moved[1] / 1e9
    sequential = read_gb * med("read_s_per_gb") + write_gb * med("write_s_per_gb")
    return min(sequential, max(read_gb, write_gb) * med("both_s_per_gb"))


def summarize(runs: dict, disks: list[dict], cases: list[str], num_params: int) -> dict:
    """Per case: the step, its waits, the bytes moved and the floors; for a moment format (a case
    `name@format`), its step and disk bytes against the fp32 case's, per round (the bytes as the
    kernel counted them for this process, /proc/self/io, not as the engine reports them)."""
    compute = runs["cpu"]["times"]
    out = {}
    for case in cases:
        run = runs[case]
        entry = {"step_s": spread(run["times"]), "wait_s": statistics.median(run["compute_wait_s"])}
        line = f"{case:>12}: step {entry['step_s']} s, waited {entry['wait_s']:.3f} s"
        if case != "cpu":
            moved = tuple(statistics.median(x) for x in zip(*run["moved_bytes"]))
            io = floor_of(moved, disks)
            waits: dict[str, list[float]] = {}
            for w in run["waits"]:
                for kind, seconds in w.items():
                    waits.setdefault(kind, []).append(seconds)
            entry.update(moved_gb=(moved[0] / 1e9, moved[1] / 1e9), io_floor_s=io,
                         waits={k: statistics.median(v) for k, v in waits.items()},
                         over_max_floors=spread([t / max(io, c) for t, c in zip(run["times"], compute)]),
                         over_cpu=spread([t / c for t, c in zip(run["times"], compute)]))
            line += (f", moved {moved[0] / 1e9:.2f} / {moved[1] / 1e9:.2f} GB, I/O floor {io:.3f} s | "
                     f"/ max(floors) {entry['over_max_floors']} | / cpu {entry['over_cpu']}")
            line += "".join(f"\n{'':>14}waited on {k}: {v:.3f} s" for k, v in sorted(entry["waits"].items()) if v >= 0.001)
            disk = [(r + w) / num_params for r, w in run.get("disk_bytes", [])]
            if disk:
                entry["disk_bytes_per_param"] = spread(disk)
                line += f"\n{'':>14}disk bytes a parameter a step (/proc/self/io): {entry['disk_bytes_per_param']}"
            base = runs.get(case.split("@")[0])
            if "@" in case and base is not None and base.get("disk_bytes") and disk:
                base_disk = [(r + w) / num_params for r, w in base["disk_bytes"]]
                entry["vs_fp32"] = {"step": spread([t / b for t, b in zip(run["times"], base["times"])]),
                                    "disk_bytes": statistics.median(disk) / statistics.median(base_disk)}
                line += (f"\n{'':>14}vs fp32: step {entry['vs_fp32']['step']} (per round), disk bytes "
                         f"{entry['vs_fp32']['disk_bytes']:.3f}")
        out[case] = entry
        print(line)
    return out


def ds_config(case: str, work: str, micro: int, clip: float) -> dict:
    """`case`'s config as DeepSpeed 0.19.8 runs it: the same file but stage3_prefetch_bucket_size 0,
    without which its NVMe parameter prefetch fails with `max_in_cpu` 0 (its issue #3062)."""
    config = user.engine_config(case, work, micro, clip)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    return config


def run_deepspeed(args, case: str, model_cfg: dict) -> dict:
    """`case` on DeepSpeed (`--deepspeed`: the Python of an environment with deepspeed==0.19.8),
    `--ds-steps` steps after a warm-up step, in a process of its own after our rounds."""
    work = tempfile.mkdtemp(prefix="bench-ds-", dir=args.nvme_path)
    try:
        payload = {"gpt_file": GPT_FILE, "steps": args.ds_steps, **{k: model_cfg[k] for k in
                   ("vocab", "seq", "dim", "layers", "micro")},
                   "config": ds_config(case, work, model_cfg["micro"], args.clip)}
        proc = subprocess.run([args.deepspeed, "-c", DS_SCRIPT, json.dumps(payload)], stdout=subprocess.PIPE,
                              text=True, cwd=tempfile.gettempdir(), env=dict(os.environ, DS_ACCELERATOR="cpu"),
                              timeout=args.ds_timeout)
        if proc.returncode:
            print(f"DeepSpeed {case}: exit {proc.returncode}", file=sys.stderr)
            return {"error": proc.returncode}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        print(f"DeepSpeed {case}: timed out after {args.ds_timeout} s", file=sys.stderr)
        return {"error": "timeout"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["config"] = json.loads(json.dumps(payload["config"]).replace(work, "<nvme>"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=[*STREAMING, "cpu"], default=[*STREAMING, "cpu"])
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--disk-bytes", type=int, default=1 << 30)
    p.add_argument("--nvme-path", default="/work")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--moment-formats", nargs="+", choices=["fp32", "bf16", "8bit"], default=["fp32"],
                   help="run each streaming case with its moments in each format (case@format)")
    p.add_argument("--micro", type=int, help="micro-batch (default the model's, 2)")
    p.add_argument("--seq", type=int, help="sequence length (default the model's, 256); a short one makes the "
                   "step disk-bound")
    p.add_argument("--deepspeed", metavar="PYTHON",
                   help="also run each fp32 streaming case on DeepSpeed with this Python (deepspeed==0.19.8)")
    p.add_argument("--ds-steps", type=int, default=3)
    p.add_argument("--ds-timeout", type=int, default=1800)
    p.add_argument("--output")
    args = p.parse_args()
    if "cpu" not in args.cases:
        args.cases.append("cpu")
    args.cases = [c if c == "cpu" or f == "fp32" else f"{c}@{f}" for c in args.cases for f in args.moment_formats
                  if c != "cpu" or f == args.moment_formats[0]]
    gpt = load_gpt()
    model_cfg = dict(user.MODELS["134m"])
    model_cfg.update({k: v for k, v in (("micro", args.micro), ("seq", args.seq)) if v})
    num_params = user.gpt_config(gpt, model_cfg).num_params()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-streaming-", dir=args.nvme_path)
    try:
        disks = [user.disk_gbps(work, args.disk_bytes)]
        runs, configs = user.run_rounds(args, gpt, model_cfg, work)
        disks.append(user.disk_gbps(work, args.disk_bytes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{num_params / 1e6:.1f}M parameters, clip {args.clip}, {args.rounds} rounds; disk read "
          f"{1 / statistics.median(d['read_s_per_gb'] for d in disks):.2f} GB/s, write "
          f"{1 / statistics.median(d['write_s_per_gb'] for d in disks):.2f} GB/s")
    summary = summarize(runs, disks, args.cases, num_params)
    deepspeed = {}
    for case in (c for c in args.cases if args.deepspeed and c in STREAMING):
        deepspeed[case] = run_deepspeed(args, case, model_cfg)
        if "step_s" in deepspeed[case]:
            ours = statistics.median(runs[case]["times"])
            print(f"{case:>12}: DeepSpeed step {spread(deepspeed[case]['times'])} s = "
                  f"{deepspeed[case]['step_s'] / ours:.2f}x infinity's", flush=True)
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "commit": commit,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "args": vars(args),
                       "model": model_cfg, "params": num_params, "disk": disks, "configs": configs, "runs": runs,
                       "summary": summary, "deepspeed": deepspeed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
