"""What bandwidth-centric partitioning buys with N nodes, on paper, from this machine's measured
disk and loopback bandwidth (ZeRO-Infinity's "bandwidth-centric partitioning": each rank reads
1/N of a unit's bytes from its own NVMe, then the ranks all-gather the unit, instead of every
rank reading the whole unit from its own disk).

    python bench/bench_partitioning.py --dir /tmp --unit 64M --rounds 5 --output bench/results/partitioning.json

Measured here, interleaved over --rounds rounds, medians with min-max spread:
- disk: one O_DIRECT read of a unit and of its 1/N parts (N in --nodes), through the engine's
  AsyncIOHandle (8 MiB blocks, queue depth 32, the settings of bench/results/aio.md), from a file
  written once before timing;
- all-gather: torch.distributed's all_gather_into_tensor of the unit (each of N gloo processes on
  this host contributing 1/N) over loopback: an upper bound of what a network between nodes
  gives, since loopback is memory copies on this host's 2 cores.
The model: the unit arrives on every rank after max(read(S/N), nothing) + allgather(S, N) when
partitioned (reads on N disks run in parallel), against read(S) when every rank reads the whole
unit from its own disk (each node holding a full copy, N times the NVMe). The table also gives
the partitioned time for links of a stated bandwidth (the all-gather moves (N-1)/N of the unit
into each rank: ring algorithm), for nodes with this machine's disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infinity.io import AsyncIOHandle, aligned_empty

BLOCK, DEPTH = 8 << 20, 32


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _read_seconds(handle: AsyncIOHandle, buf: torch.Tensor, path: str, nbytes: int) -> float:
    view = buf[:nbytes]
    start = time.perf_counter()
    handle.read(view, path)
    return time.perf_counter() - start


def _gather_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    part = torch.full((nbytes // world,), rank, dtype=torch.uint8)
    whole = torch.empty(part.numel() * world, dtype=torch.uint8)
    dist.all_gather_into_tensor(whole, part)  # warm-up: connections made
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(whole, part)
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _allgather_seconds(world: int, nbytes: int, repeats: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_gather_worker, args=(world, port, nbytes, repeats, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the unit's file is written")
    parser.add_argument("--unit", type=_size, default=64 << 20, help="bytes of one unit (default 64M)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="N to measure the all-gather for")
    parser.add_argument("--model-nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--links-gbps", type=float, nargs="+", default=[12.5, 25.0, 50.0],
                        help="link bandwidths for the paper table, GB/s (100, 200, 400 Gb/s)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output")
    args = parser.parse_args()

    path = os.path.join(args.dir, "infinity-partitioning-bench.bin")
    handle = AsyncIOHandle(block_size=BLOCK, queue_depth=DEPTH)
    buf = aligned_empty(args.unit)
    buf.copy_(torch.randint(0, 256, (args.unit,), dtype=torch.uint8))
    handle.write(buf, path)
    reads: dict[int, list[float]] = {n: [] for n in sorted({1, *args.nodes, *args.model_nodes})}
    gathers: dict[int, list[float]] = {n: [] for n in args.nodes}
    try:
        for r in range(args.rounds):
            order = list(reads)
            order = order[r % len(order):] + order[:r % len(order)]  # rotate: no size always first
            for n in order:
                reads[n].append(_read_seconds(handle, buf, path, args.unit // n // 4096 * 4096))
            for n in args.nodes:
                gathers[n].append(statistics.median(_allgather_seconds(n, args.unit, 3)))
    finally:
        os.unlink(path)

    disk_gbps = args.unit / statistics.median(reads[1]) / 1e9
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "unit_bytes": args.unit, "rounds": args.rounds,
        "read_s": {str(n): _summary(v) for n, v in reads.items()},
        "allgather_loopback_s": {str(n): _summary(v) for n, v in gathers.items()},
        "disk_read_gbps": disk_gbps,
    }
    rows = []
    for n in args.model_nodes:
        whole = statistics.median(reads[1])
        part = statistics.median(reads[n])
        row = {"nodes": n, "own_copy_s": whole, "partitioned_read_s": part}
        if str(n) in result["allgather_loopback_s"]:
            row["partitioned_loopback_s"] = part + result["allgather_loopback_s"][str(n)]["median"]
        for link in args.links_gbps:
            row[f"partitioned_{link:g}GBps_s"] = part + args.unit * (n - 1) / n / (link * 1e9)
        rows.append(row)
    result["model"] = rows
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
