"""Our AsyncIOHandle against fio and DeepSpeed's aio handle on one file, in interleaved rounds,
because this disk's speed drifts within minutes.

    python bench/bench_aio.py --dir /work --size 2G --rounds 8 --buffers-ab --reserve-hugepages \
        --output bench/results/aio.json

Every measurement reads or writes the whole file once, O_DIRECT, 8 MiB blocks, queue depth 32,
one worker, random bytes on every side (fio writes random bytes by default; we and DeepSpeed
tile one seeded random block). The file is written once before timing: writes overwrite
allocated extents, as the engine's store does. Each round runs every contender once per op,
writes first; round r starts with contender r (the order rotates, so that no contender always
runs first). The summary gives medians with the min-max spread over the rounds.

Contenders:
- infinity: our handle (engine "auto", io_uring here) on a buffer from `aligned_empty`:
  page-locked and backed by transparent huge pages. One buffer for the whole run, as the
  engine's pools keep theirs, filled (so every page is touched) before the first round; the
  share of it that the kernel really backed with huge pages is recorded (`thp_share`).
- fio, per engine in --fio-engines (io_uring with `--fixedbufs --registerfiles`, libaio), once
  with its default buffers (malloc: 4 KiB pages, not locked) and once with `--iomem=shmhuge`
  (SysV shared memory on reserved 2 MiB huge pages). shmhuge needs free reserved huge pages
  (HugePages_Free in /proc/meminfo, about depth x block / 2 MiB + 2 of them: 130 for 32 x 8 MiB).
  Without them it is skipped with a message; --reserve-hugepages raises vm.nr_hugepages for
  the run and puts it back afterwards. Either way the results say what was done. By hand:
  `echo 160 > /proc/sys/vm/nr_hugepages` before, `echo 0 > /proc/sys/vm/nr_hugepages` after.
- deepspeed: DeepSpeed's aio handle (`new_cpu_locked_tensor`: posix_memalign + mlock, 4 KiB
  pages), run in its own virtual environment (--ds-python, default /work/venv-ds/bin/python:
  `pip install torch==2.13.0 deepspeed==0.19.8 ninja`, libaio-dev installed) with
  DS_ACCELERATOR=cpu; skipped when that interpreter is missing.
- with --buffers-ab, also our handle on plain 4 KiB pages, locked and unlocked (touched before
  timing either way): the A/B behind "page-locked" and "huge pages" in the README. Each of our
  contenders keeps its own buffer of --size bytes for the run: 3 x --size of memory.

CPU seconds are recorded too: our whole process (its I/O worker, and io_uring's kernel threads)
during each transfer, and fio's usr + sys share of its runtime; and the disk's mean request
size over each transfer (/sys/class/block/DEV/stat), which shows how the block layer cut the
pieces: at max_sectors_kb, or earlier at max_segments physically contiguous runs of the buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinity.io import AsyncIOHandle, aligned_empty
from infinity.apps.tools.aio_bench_sweep import parse_size

OPS = ("write", "read")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DS_SCRIPT = r"""
import json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
path, size, block, depth, op, seed = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], int(sys.argv[6])
handle = AsyncIOBuilder().load(verbose=False).aio_handle(block, depth, False, True, 1)
buf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
pattern = torch.randint(0, 256, (min(size, block * depth),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
for start in range(0, size, pattern.numel()):
    buf[start:start + pattern.numel()].copy_(pattern[:size - start])
start = time.perf_counter()
(handle.sync_pread if op == "read" else handle.sync_pwrite)(buf, path)
print(json.dumps({"gbps": size / (time.perf_counter() - start) / 1e9}), flush=True)
# The handle's teardown at interpreter exit sometimes aborts ("terminate called without an
# active exception"): the figure is already out, so skip the teardown.
os._exit(0)
"""


@dataclass(frozen=True, slots=True)
class Setup:
    """What every contender shares: the file and the transfer shape."""

    path: str
    size: int  # bytes per measurement: the whole file
    block: int  # bytes per I/O piece
    depth: int  # pieces in flight
    pattern: torch.Tensor  # random bytes, depth x block of them, tiled over every write buffer
    seed: int


@dataclass(frozen=True, slots=True)
class Contender:
    name: str
    measure: Callable[[str], tuple[float, float]]  # op -> (GB/s, CPU seconds spent on it)
    what: str  # one line for the results: buffers and knobs


# ---- the contenders -----------------------------------------------------------------------------


def fill(buf: torch.Tensor, pattern: torch.Tensor) -> None:
    """Tiles `pattern` over `buf`; also touches every page before the clock starts."""
    for start in range(0, buf.numel(), pattern.numel()):
        buf[start:start + pattern.numel()].copy_(pattern[:buf.numel() - start])


def thp_share(ptr: int) -> float:
    """Share of the mapping holding `ptr` that is backed by transparent huge pages (smaps)."""
    rss = huge = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m[1], 16) <= ptr < int(m[2], 16)
            elif inside and line.startswith(("Rss:", "AnonHugePages:")):
                kib = int(line.split()[1])
                rss, huge = (kib, huge) if line.startswith("Rss:") else (rss, kib)
    return huge / rss if rss else 0.0


def ours(handle: AsyncIOHandle, buf: torch.Tensor, path: str, op: str) -> tuple[float, float]:
    cpu = time.process_time()  # this process's user + system time: our worker and io_uring's
    start = time.perf_counter()
    handle.read(buf, path) if op == "read" else handle.write(buf, path)
    return buf.numel() / (time.perf_counter() - start) / 1e9, time.process_time() - cpu


def fio(setup: Setup, engine: str, iomem: str | None, op: str) -> tuple[float, float]:
    cmd = ["fio", "--name=bench", f"--filename={setup.path}", f"--rw={op}", f"--bs={setup.block}",
           f"--iodepth={setup.depth}", "--direct=1", f"--ioengine={engine}", f"--size={setup.size}",
           "--numjobs=1", "--overwrite=1", "--fallocate=none", "--output-format=json"]
    if engine == "io_uring":
        cmd += ["--fixedbufs", "--registerfiles"]
    if iomem:
        cmd.append(f"--iomem={iomem}")
    job = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["jobs"][0]
    seconds = job[op]["runtime"] / 1e3
    return job[op]["io_bytes"] / seconds / 1e9, (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds


def deepspeed(python: str, setup: Setup, op: str) -> tuple[float, float]:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    argv = [setup.path, setup.size, setup.block, setup.depth, op, setup.seed]
    out = subprocess.run([python, "-c", DS_SCRIPT, *map(str, argv)], capture_output=True, text=True, env=env,
                         cwd=tempfile.gettempdir(), check=False)
    if out.returncode != 0:
        print(f"DeepSpeed {op} failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return float("nan"), float("nan")
    return json.loads(out.stdout.strip().splitlines()[-1])["gbps"], float("nan")  # its CPU time: not measured


def contenders(args: argparse.Namespace, setup: Setup, handle: AsyncIOHandle, shmhuge: bool,
               thp: dict[str, float]) -> list[Contender]:
    def our(name: str, pin: bool, huge_pages: bool, what: str) -> Contender:
        # One buffer per contender for the whole run, as the engine's pools keep theirs (a
        # buffer allocated afresh for each measurement wrote ~5% slower here).
        buf = aligned_empty(setup.size, pin=pin, huge_pages=huge_pages)
        fill(buf, setup.pattern)
        thp[name] = thp_share(buf.data_ptr())
        return Contender(name, lambda op: ours(handle, buf, setup.path, op), what)

    out = [our("infinity", True, True, f"our handle (engine {handle.engine}), mlock'ed, transparent huge pages")]
    if args.buffers_ab:
        out.append(our("infinity 4k locked", True, False, "our handle, mlock'ed, 4 KiB pages (MADV_NOHUGEPAGE)"))
        out.append(our("infinity 4k unlocked", False, False, "our handle, not locked, 4 KiB pages, touched"))
    for engine in args.fio_engines:
        knobs = " --fixedbufs --registerfiles" if engine == "io_uring" else ""
        for iomem in (None, "shmhuge") if shmhuge else (None,):
            name = f"fio {engine}" + (f" {iomem}" if iomem else "")
            what = f"fio --ioengine={engine}{knobs} --iomem={iomem or 'malloc (default)'}"
            out.append(Contender(name, lambda op, e=engine, m=iomem: fio(setup, e, m, op), what))
    if os.path.exists(args.ds_python):
        out.append(Contender("deepspeed", lambda op: deepspeed(args.ds_python, setup, op),
                             "DeepSpeed 0.19 aio_handle, new_cpu_locked_tensor (mlock, 4 KiB pages)"))
    return out


# ---- huge pages for fio's shmhuge ---------------------------------------------------------------


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def hugepages_for_fio(args: argparse.Namespace) -> dict:
    """Checks (or with --reserve-hugepages, reserves) the huge pages fio's shmhuge needs.
    Returns what was found and done; `ok` says whether the shmhuge contenders run."""
    page = meminfo("Hugepagesize") * 1024
    # fio 3.33 maps depth x block plus a page of alignment, rounded to huge pages, and needs
    # one more: 130 for 32 x 8 MiB, 34 for 64 x 1 MiB (measured).
    needed = math.ceil((args.queue_depth * args.block_size + 4096) / page) + 1
    free = meminfo("HugePages_Free")
    info = {"page_bytes": page, "needed": needed, "free_at_start": free, "reserved_by_this_run": 0, "ok": True}
    if free >= needed:
        return info
    if args.reserve_hugepages:
        with open("/proc/sys/vm/nr_hugepages") as f:
            info["nr_hugepages_before"] = int(f.read())
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(info["nr_hugepages_before"] + needed - free))
        info["reserved_by_this_run"] = meminfo("HugePages_Free") - free
        if meminfo("HugePages_Free") >= needed:
            return info
    info["ok"] = False
    print(f"fio --iomem=shmhuge skipped: it needs {needed} free {page >> 20} MiB huge pages, /proc/meminfo has "
          f"HugePages_Free: {meminfo('HugePages_Free')}. Reserve them with `echo {needed + 30} > "
          "/proc/sys/vm/nr_hugepages` (root) or pass --reserve-hugepages", file=sys.stderr)
    return info


def release_hugepages(info: dict) -> None:
    if "nr_hugepages_before" in info:
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(info["nr_hugepages_before"]))


# ---- the run ------------------------------------------------------------------------------------


def mount_of(directory: str) -> list[str]:
    """The /proc/mounts entry (source, mount point, type, ...) holding `directory`."""
    where = os.path.realpath(directory)
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    return max((m for m in mounts if where.startswith(m[1].rstrip("/") + "/") or where == m[1]),
               key=lambda m: len(m[1]))


def disk_counters(stat_path: str | None, op: str) -> tuple[int, int]:
    """(requests completed, sectors) of `op` so far on the block device, from its stat file."""
    if stat_path is None:
        return 0, 0
    with open(stat_path) as f:
        fields = [int(x) for x in f.read().split()]
    return (fields[0], fields[2]) if op == "read" else (fields[4], fields[6])


def run_rounds(field: list[Contender], rounds: int, stat_path: str | None) -> tuple[dict, dict, list[list[str]]]:
    """({name: {op: [GB/s per round]}}, {"cpu_seconds" | "request_kib": the same shape}, each
    round's order). request_kib is the device's mean request size over the transfer (the
    block layer splits a piece at max_sectors_kb and at max_segments physically contiguous
    runs); it counts whatever else used the disk meanwhile too."""
    gbps = {c.name: {op: [] for op in OPS} for c in field}
    extra = {key: {c.name: {op: [] for op in OPS} for c in field} for key in ("cpu_seconds", "request_kib")}
    orders = []
    for r in range(rounds):
        order = field[r % len(field):] + field[:r % len(field)]
        orders.append([c.name for c in order])
        for op in OPS:
            for c in order:
                requests, sectors = disk_counters(stat_path, op)
                g, seconds = c.measure(op)
                requests, sectors = (b - a for a, b in zip((requests, sectors), disk_counters(stat_path, op)))
                kib = sectors / 2 / requests if requests else float("nan")
                gbps[c.name][op].append(g)
                extra["cpu_seconds"][c.name][op].append(seconds)
                extra["request_kib"][c.name][op].append(kib)
                print(f"round {r} {op:<5} {c.name:<24} {g:6.2f} GB/s  cpu {seconds:5.2f} s  {kib:5.0f} KiB/request",
                      flush=True)
    return gbps, extra, orders


def spread(values: list[float]) -> dict[str, float]:
    v = [g for g in values if not math.isnan(g)] or [float("nan")]
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def summarize(results: dict[str, dict[str, list[float]]]) -> dict:
    summary = {}
    for op in OPS:
        stats = {name: spread(v[op]) for name, v in results.items()}
        fio_best = max((n for n in stats if n.startswith("fio")), key=lambda n: stats[n]["median"], default=None)
        others = [n for n in stats if not n.startswith("infinity")]
        best = max(others, key=lambda n: stats[n]["median"], default=None)
        ours_med = stats["infinity"]["median"]
        summary[op] = {
            "gbps": stats,
            "best_fio": fio_best,
            "ratio_vs_best_fio": ours_med / stats[fio_best]["median"] if fio_best else None,
            "best_other": best,
            "ratio_vs_best_other": ours_med / stats[best]["median"] if best else None,
        }
    return summary


def print_tables(results: dict, orders: list[list[str]], summary: dict) -> None:
    """Markdown: one row per round and op, then medians [min-max] and the ratios."""
    names = list(results)
    print("\n| round | op | first | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---:|" * len(names))
    for r, order in enumerate(orders):
        for op in OPS:
            print(f"| {r} | {op} | {order[0]} | " + " | ".join(f"{results[n][op][r]:.2f}" for n in names) + " |")
    print("\n| op | " + " | ".join(names) + " | infinity / best fio | infinity / best other |")
    print("|---|" + "---:|" * (len(names) + 2))
    for op in OPS:
        s = summary[op]
        cells = " | ".join("{median:.2f} [{min:.2f}-{max:.2f}]".format(**s["gbps"][n]) for n in names)
        fio_ratio = f"{s['ratio_vs_best_fio']:.2f} ({s['best_fio']})" if s["best_fio"] else "-"
        other_ratio = f"{s['ratio_vs_best_other']:.2f} ({s['best_other']})" if s["best_other"] else "-"
        print(f"| {op} | {cells} | {fio_ratio} | {other_ratio} |")


def machine(directory: str) -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()

    mount = mount_of(directory)
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True, check=True).stdout.strip() \
        if shutil.which("fio") else None
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        # Whether the I/O engine or this script differ from the commit (others' files may).
        "io_code_modified": bool(git("status", "--porcelain", "--", "csrc/aio", "infinity/io", "bench/bench_aio.py")),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "kernel": platform.release(), "cpus": os.cpu_count(), "mem_gib": round(meminfo("MemTotal") / 2**20, 1),
        "filesystem": f"{mount[2]} on {mount[0]} ({mount[1]})", "fio": fio_version,
        "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".", help="directory on the disk under test")
    p.add_argument("--size", type=parse_size, default=parse_size("2G"), help="file size (bytes per measurement)")
    p.add_argument("--block-size", type=parse_size, default=parse_size("8M"))
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fio-engines", type=lambda s: s.split(","), default=["io_uring", "libaio"],
                   help="comma-separated fio ioengines, each with default and shmhuge buffers")
    p.add_argument("--reserve-hugepages", action="store_true",
                   help="raise vm.nr_hugepages for fio's shmhuge if too few are free, restored at the end")
    p.add_argument("--buffers-ab", action="store_true",
                   help="also our handle on 4 KiB pages, locked and unlocked (the README's buffer A/B)")
    p.add_argument("--ds-python", default="/work/venv-ds/bin/python")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the figures as JSON here")
    return p.parse_args()


def check_memory(args: argparse.Namespace) -> None:
    """Refuses a run whose buffers would not fit beside what the machine already uses."""
    ours_bytes = args.size * (3 if args.buffers_ab else 1)
    need = ours_bytes + args.size + (1 << 30)  # + DeepSpeed's child process + a margin
    available = meminfo("MemAvailable") * 1024
    if need > available:
        raise SystemExit(f"--size {args.size >> 20} MiB needs about {need >> 20} MiB of memory ({ours_bytes >> 20} "
                         f"MiB of our buffers, one --size for DeepSpeed's process, 1 GiB spare), MemAvailable is "
                         f"{available >> 20} MiB: use a smaller --size or run without --buffers-ab")


def main() -> int:
    args = parse_args()
    check_memory(args)
    # SIGTERM unwinds like an exception, so that the file is removed and huge pages are given back.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not shutil.which("fio"):
        print("fio not found (apt-get install fio): fio skipped", file=sys.stderr)
        args.fio_engines = []
    if not os.path.exists(args.ds_python):
        print(f"{args.ds_python} not found: DeepSpeed skipped", file=sys.stderr)
    info = machine(args.dir)
    hugepages = hugepages_for_fio(args) if args.fio_engines else {"ok": False}
    work = tempfile.mkdtemp(prefix="bench-aio-", dir=args.dir)
    gen = torch.Generator().manual_seed(args.seed)
    pattern = torch.randint(0, 256, (min(args.size, args.block_size * args.queue_depth),), dtype=torch.uint8,
                            generator=gen)
    setup = Setup(os.path.join(work, "data.bin"), args.size, args.block_size, args.queue_depth, pattern, args.seed)
    handle = AsyncIOHandle(block_size=args.block_size, queue_depth=args.queue_depth)
    thp: dict[str, float] = {}
    try:
        field = contenders(args, setup, handle, hugepages["ok"], thp)
        field[0].measure("write")  # lays the file out
        stat = f"/sys/class/block/{os.path.basename(mount_of(args.dir)[0])}/stat"
        results, extra, orders = run_rounds(field, args.rounds, stat if os.path.exists(stat) else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        release_hugepages(hugepages)

    summary = summarize(results)
    print(f"\n{args.rounds} interleaved rounds, {args.size / 2**30:.1f} GiB, block {args.block_size >> 20} MiB, "
          f"queue depth {args.queue_depth}, O_DIRECT; GB/s median [min-max]")
    print_tables(results, orders, summary)
    for name, share in thp.items():
        print(f"{name}: {share:.2f} of the buffer on transparent huge pages")
    for key, unit, digits in (("cpu_seconds", "CPU seconds", 3), ("request_kib", "KiB per device request", 0)):
        for op in OPS:
            cells = ", ".join(f"{n} {statistics.median(v[op]):.{digits}f}" for n, v in extra[key].items())
            print(f"{op} {unit}, median: {cells}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({**info, "args": {k: v for k, v in vars(args).items()}, "hugepages": hugepages,
                       "contenders": {c.name: c.what for c in field}, "order": orders, "rounds": results,
                       **extra, "thp_share": thp, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
