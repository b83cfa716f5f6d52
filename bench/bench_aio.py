"""Our AsyncIOHandle against fio (libaio; io_uring with fixed buffers) and DeepSpeed's aio handle,
interleaved A B C D A B C D on one file, because this disk's speed drifts within minutes.

    python bench/bench_aio.py --dir /work --size 4G --block-size 8M --queue-depth 32 --rounds 3

Every run reads and writes the whole file once, O_DIRECT, same block size and queue depth.
The file is written once before timing: writes overwrite allocated extents, as the engine's
store does. DeepSpeed runs in a separate virtual environment (--ds-python, default
/work/venv-ds/bin/python: `pip install torch==2.13.0 deepspeed==0.19.8 ninja`, libaio-dev
installed) with DS_ACCELERATOR=cpu; it is skipped when that interpreter is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from infinity.io import AsyncIOHandle, aligned_empty
from infinity.tools.aio_bench_sweep import parse_size

DS_SCRIPT = r"""
import json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
path, size, block, depth, op = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
handle = AsyncIOBuilder().load(verbose=False).aio_handle(block, depth, False, True, 1)
buf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
buf.fill_(0x5A)
start = time.perf_counter()
(handle.sync_pread if op == "read" else handle.sync_pwrite)(buf, path)
print(json.dumps({"gbps": size / (time.perf_counter() - start) / 1e9}), flush=True)
# The handle's teardown at interpreter exit sometimes aborts ("terminate called without an
# active exception"): the figure is already out, so skip the teardown.
os._exit(0)
"""


def ours(handle: AsyncIOHandle, buf: torch.Tensor, path: str, op: str) -> float:
    start = time.perf_counter()
    handle.read(buf, path) if op == "read" else handle.write(buf, path)
    return buf.numel() / (time.perf_counter() - start) / 1e9


def fio(engine: str, path: str, size: int, block: int, depth: int, op: str) -> float:
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={op}", f"--bs={block}", f"--iodepth={depth}",
           "--direct=1", f"--ioengine={engine}", f"--size={size}", "--numjobs=1", "--overwrite=1",
           "--fallocate=none", "--output-format=json"]
    if engine == "io_uring":
        cmd += ["--fixedbufs", "--registerfiles"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0][op]
    return job["io_bytes"] / (job["runtime"] / 1e3) / 1e9


def deepspeed(python: str, path: str, size: int, block: int, depth: int, op: str) -> float:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([python, "-c", DS_SCRIPT, path, str(size), str(block), str(depth), op],
                         capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        print(f"DeepSpeed {op} failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return float("nan")
    return json.loads(out.stdout.strip().splitlines()[-1])["gbps"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".", help="directory on the disk under test")
    p.add_argument("--size", type=parse_size, default=parse_size("4G"))
    p.add_argument("--block-size", type=parse_size, default=parse_size("8M"))
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ds-python", default="/work/venv-ds/bin/python")
    p.add_argument("--output", help="write the figures as JSON here")
    args = p.parse_args()

    contenders = {"infinity": None}
    if shutil.which("fio"):
        contenders["fio-libaio"] = "libaio"
        contenders["fio-io_uring-fixedbufs"] = "io_uring"
    else:
        print("fio not found (apt-get install fio): skipped", file=sys.stderr)
    if os.path.exists(args.ds_python):
        contenders["deepspeed"] = args.ds_python
    else:
        print(f"{args.ds_python} not found: DeepSpeed skipped", file=sys.stderr)

    work = tempfile.mkdtemp(prefix="bench-aio-", dir=args.dir)
    path = os.path.join(work, "data.bin")
    handle = AsyncIOHandle(block_size=args.block_size, queue_depth=args.queue_depth)
    buf = aligned_empty(args.size)
    buf.fill_(0x5A)  # touch every page before timing
    handle.write(buf, path)
    results: dict[str, dict[str, list[float]]] = {name: {"read": [], "write": []} for name in contenders}
    try:
        for r in range(args.rounds):
            for op in ("write", "read"):
                for name, how in contenders.items():
                    if name == "infinity":
                        g = ours(handle, buf, path, op)
                    elif name == "deepspeed":
                        g = deepspeed(how, path, args.size, args.block_size, args.queue_depth, op)
                    else:
                        g = fio(how, path, args.size, args.block_size, args.queue_depth, op)
                    results[name][op].append(g)
                    print(f"round {r} {op:<5} {name:<24} {g:6.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmedian of {args.rounds} interleaved rounds, {args.size / 2**30:.1f} GiB, "
          f"block {args.block_size >> 20} MiB, queue depth {args.queue_depth}, O_DIRECT, engine {handle.engine}")
    summary = {}
    for op in ("read", "write"):
        med = {name: statistics.median([g for g in v[op] if g == g] or [float("nan")]) for name, v in results.items()}
        best_other = max((g for n, g in med.items() if n != "infinity"), default=float("nan"))
        summary[op] = {"median_gbps": med, "ratio_vs_best_other": med["infinity"] / best_other}
        cells = "  ".join(f"{n} {g:.2f}" for n, g in med.items())
        print(f"{op:<5} GB/s: {cells}  | infinity / best other = {med['infinity'] / best_other:.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "engine": handle.engine, "rounds": results, "summary": summary}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
