"""Fine-tuning with each optimizer moment format ([Note: moment formats] in
infinity/optim/formats.py): `infinity finetune`'s default job (its built-in Llama-style model and
config, parameters and optimizer state on NVMe) for the same steps and seed with fp32, bf16 and
8-bit moments, one run after the other; the loss curves, their last steps' mean against fp32's,
the NVMe bytes a step and the peak RSS.

    python bench/bench_moment_formats.py --steps 500 --nvme-path /work --output moment_formats_finetune.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(fmt: str, args, work: str) -> dict:
    out = os.path.join(work, f"{fmt}.json")
    cmd = [sys.executable, "-m", "infinity.apps.cli", "finetune", "--steps", str(args.steps), "--moment-format", fmt,
           "--nvme-path", args.nvme_path, "--metrics", out, "--sample-tokens", "0", "--seed", str(args.seed)]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=work, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "8bit"])
    p.add_argument("--tail", type=int, default=50, help="steps whose mean loss is compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nvme-path", default="/work")
    p.add_argument("--output")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()  # the tree the runs start from
    with tempfile.TemporaryDirectory() as work:
        runs = {fmt: run(fmt, args, work) for fmt in args.formats}
    base = statistics.mean(runs[args.formats[0]]["loss"][-args.tail:])
    summary = {}
    for fmt, r in runs.items():
        tail = statistics.mean(r["loss"][-args.tail:])
        summary[fmt] = {"final_loss_mean": tail, "vs_first": tail / base, "first_loss": r["loss"][0],
                        "step_s_median": statistics.median(r["step_s"][1:]),
                        "nvme_bytes_median": statistics.median(r["nvme_bytes"][1:]),
                        "peak_rss_gb": r["peak_rss_bytes"] / 1e9, "optimizer": r["optimizer"]}
        print(f"{fmt:>5}: loss {r['loss'][0]:.3f} -> mean of last {args.tail} {tail:.4f} ({tail / base:.4f}x "
              f"{args.formats[0]}), step {summary[fmt]['step_s_median']:.3f} s, NVMe "
              f"{summary[fmt]['nvme_bytes_median'] / 1e6:.1f} MB a step, peak RSS {summary[fmt]['peak_rss_gb']:.2f} GB")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "commit": commit,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "args": vars(args),
                       "summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
