"""The step's thread time a transfer costs: the swapper's bookkeeping over the I/O handle's.

    python bench/bench_transfer_overhead.py --nvme-path /work          # 64 KiB shards, 7 rounds
    python bench/bench_transfer_overhead.py --kib 1024 --rounds 3

A streaming step makes thousands of NVMe transfers (the 134M GPT's 8-bit step about 2,800), and
each costs the step's own thread some time beside the disk's: where the step is held by that
thread, this is what it pays. Small shards keep the disk's share small; the figure is thread CPU
time (`time.thread_time`), which waiting for the disk does not count.

Each round times, one after the other, the order turning each round:
  * handle: `AsyncIOHandle.submit_read` then `wait`, a quarter of the shards at a time;
  * swapper: `Swapper.fetch`, `wait`, `release(dirty=True)` and `reap` of the same shards, so that
    each fetch's read and each release's write count as one transfer each.
Printed: microseconds of thread time per transfer, median (min-max) over the rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from infinity.io import AsyncIOHandle
from infinity.offload.pool import BufferPool
from infinity.offload.store import NvmeStore
from infinity.offload.swapper import Swapper


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--kib", type=int, default=64, help="bytes a shard, in KiB")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--cycles", type=int, default=100, help="batches of a quarter of the shards, a round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    nbytes, count = args.kib << 10, args.shards
    batch = max(1, count // 4)
    work = tempfile.mkdtemp(dir=args.nvme_path, prefix="transfer-overhead-")
    try:
        store = NvmeStore(work, {"shard": {k: nbytes for k in range(count)}}, job_id="overhead")
        pool = BufferPool(2 * batch, nbytes)
        handle = AsyncIOHandle(block_size=1 << 20, queue_depth=32)
        swapper = Swapper(store, pool, write_handle=AsyncIOHandle(block_size=1 << 20, queue_depth=32))
        for k in range(count):
            swapper.write("shard", k, torch.zeros(nbytes // 4))
        swapper.flush()
        buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(batch)]

        def on_handle(cycles: int) -> float:
            t0 = time.thread_time()
            for c in range(cycles):
                keys = [(c * batch + i) % count for i in range(batch)]
                extents = [store.extent("shard", k) for k in keys]
                ids = [handle.submit_read(b, e.path, e.offset) for b, e in zip(buffers, extents)]
                for r in ids:
                    handle.wait(r)
            return (time.thread_time() - t0) / (cycles * batch) * 1e6

        def on_swapper(cycles: int) -> float:
            t0 = time.thread_time()
            for c in range(cycles):
                keys = [(c * batch + i) % count for i in range(batch)]
                fetches = [swapper.fetch("shard", k) for k in keys]
                for k, f in zip(keys, fetches):
                    swapper.wait(f)
                    swapper.release("shard", k, dirty=True)
                swapper.reap()
            swapper.flush()
            return (time.thread_time() - t0) / (cycles * batch * 2) * 1e6

        timers = {"handle": on_handle, "swapper": on_swapper}
        for timer in timers.values():  # warm-up
            timer(max(1, args.cycles // 5))
        times: dict[str, list[float]] = {name: [] for name in timers}
        for r in range(args.rounds):
            names = list(timers) if r % 2 == 0 else list(reversed(timers))
            for name in names:
                times[name].append(timers[name](args.cycles))
        print(f"{args.kib} KiB shards, {args.rounds} rounds; thread time a transfer, median (min-max):")
        for name, values in times.items():
            print(f"  {name:>8}: {spread(values)} us")
        swapper.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
