"""The all-NVMe step with the configs users write, against its floors, interleaved in one process
(issue #35: "Fast with the configs users already have").

    python bench/bench_user_configs.py --model 134m --rounds 6 --nvme-path /work --output 134m.json
    python bench/bench_user_configs.py --model 7m --rounds 10 --nvme-path /work --output 7m.json

Models (bf16; params and optimizer state on NVMe, offload_param.max_in_cpu 0):
  * 134m: the GPT of bench/results/clip.md, 12 x 768, vocab 64000 (134.4M parameters), batch
    2 x 256. (Issue #35 writes vocab 32000, which is 110M parameters; its floors, 1.30-1.42 s,
    are those of vocab 64000.)
  * 7m: 8 x 256, vocab 4096 (7.4M), batch 4 x 64.
Configs (CASES; every one of them is written whole into --output):
  * ds-style: what a DeepSpeed ZeRO-Infinity user writes: sub_group_size 1e8, optimizer
    buffer_count 4, param buffer_count 6 x buffer_size 1e8, aio 8 MiB blocks at queue depth 32,
    DeepSpeed's defaults for everything else (prefetch 5e7, persistence threshold 1e5, ...);
  * ds-style-no-aio: the same without its aio section (the disk's measured setting is used);
  * ds-defaults: DeepSpeed 0.19.8's defaults: sub_group_size 1e9, buffer counts 5 / 4,
    buffer_size 1e8, no aio section;
  * tuned: bench/'s hand-tuned knobs (bench_clip.py): sub_group_size 2.5e7, 48 optimizer
    buffers, 8 param buffers, prefetch 5e8, max reuse distance 0, persistence 0, 8 MiB / 32;
  * tuned-no-aio: the same without its aio section;
  * ds-style-auto: ds-style with "max_in_cpu": "auto" in both offload sections (host memory
    before the disk: a model whose state fits moves almost nothing to NVMe);
  * cpu: the compute floor, ds-style with both offloads on device "cpu".
Each engine's pools are allocated for the whole run: the 134m cases together take about 18 GB of
host memory, so "auto" (which budgets from the memory free when its engine is built) is best
run in its own invocation (`--cases ds-style-auto cpu`).
The I/O floor is the time the disk takes to read and write the bytes a step must move (14 bytes
a parameter each way: bf16 params, fp32 master, exp_avg, exp_avg_sq; gradients stay in memory).
The disk is measured around the rounds, with 8 MiB / 32: a read alone, a write alone, and both at
once. On a half-duplex disk both at once take as long as the two one after the other; the floor
is the smaller of (read time + write time) and the time of both at once, each scaled to the
step's bytes, so it is right whichever the disk is. Rounds interleave the engines, each round
starting with a different one; the first step of each is a warm-up. Ratios are taken per round
(the engine's step over max(floors) of that round), then the median (min-max).
The cases without an aio section measure the disk in the run, into a fresh cache (the setting
each engine used is in --output): a setting cached at a busy moment is not reused.
--trace-dir writes a timeline ([Note: the timeline] in infinity/device/timeline.py) of each NVMe
engine's last step.
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
from bench_clip import spread  # noqa: E402
from bench_train import batch, load_gpt  # noqa: E402

MODELS = {
    "134m": dict(layers=12, dim=768, vocab=64000, micro=2, seq=256),
    "7m": dict(layers=8, dim=256, vocab=4096, micro=4, seq=64),
    "tiny": dict(layers=2, dim=64, vocab=512, micro=2, seq=16),  # a smoke test of the script itself
}
DEFAULT_CASES = {
    "134m": ["ds-style", "ds-style-no-aio", "ds-defaults", "tuned", "cpu"],
    "7m": ["ds-defaults", "tuned-no-aio", "tuned", "ds-style-auto", "cpu"],
    "tiny": ["ds-style", "ds-defaults", "tuned-no-aio", "cpu"],
}
TUNED_AIO = {"block_size": 8 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
             "overlap_events": True}


def _ds_style(work: str) -> tuple[dict, dict | None]:
    return ({"sub_group_size": 1e8,
             "offload_param": {"device": "nvme", "nvme_path": work, "buffer_count": 6, "buffer_size": 1e8,
                               "max_in_cpu": 0},
             "offload_optimizer": {"device": "nvme", "nvme_path": work, "buffer_count": 4}}, TUNED_AIO)


def _ds_defaults(work: str) -> tuple[dict, dict | None]:
    return ({"sub_group_size": 1e9,
             "offload_param": {"device": "nvme", "nvme_path": work, "buffer_count": 5, "buffer_size": 1e8,
                               "max_in_cpu": 0},
             "offload_optimizer": {"device": "nvme", "nvme_path": work, "buffer_count": 4}}, None)


def _tuned(work: str) -> tuple[dict, dict | None]:
    return ({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 5e8, "sub_group_size": 2.5e7,
             "offload_param": {"device": "nvme", "nvme_path": work, "buffer_count": 8, "buffer_size": 1e8,
                               "max_in_cpu": 0},
             "offload_optimizer": {"device": "nvme", "nvme_path": work, "buffer_count": 48}}, TUNED_AIO)


def _without_aio(case):
    return lambda work: (case(work)[0], None)


def _with_auto_budget(case):
    def config(work: str) -> tuple[dict, dict | None]:
        zero, aio = case(work)
        return {**zero, "offload_param": {**zero["offload_param"], "max_in_cpu": "auto"},
                "offload_optimizer": {**zero["offload_optimizer"], "max_in_cpu": "auto"}}, aio
    return config


def _in_cpu_memory(work: str) -> tuple[dict, dict | None]:
    zero, _ = _ds_style(work)
    return {**zero, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, None


CASES = {"ds-style": _ds_style, "ds-style-no-aio": _without_aio(_ds_style), "ds-defaults": _ds_defaults,
         "tuned": _tuned, "tuned-no-aio": _without_aio(_tuned), "ds-style-auto": _with_auto_budget(_ds_style),
         "cpu": _in_cpu_memory}


def engine_config(case: str, work: str, micro: int, clip: float) -> dict:
    """The config of `case`; "name@fmt" is case `name` with its moments in `fmt` (moment_format)."""
    base, _, fmt = case.partition("@")
    zero, aio = CASES[base](work)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
              "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, **zero}}
    if fmt:
        config["optimizer"]["params"]["moment_format"] = fmt
    if aio is not None:
        config["aio"] = aio
    return config


# ---- the disk ---------------------------------------------------------------------------------

def disk_gbps(nvme_path: str, size: int, reps: int = 3) -> dict:
    """Seconds per GB of a read alone, a write alone and the two at once (separate files and
    handles, submitted together), medians of `reps`, with the tuned aio setting."""
    from infinity.io import AsyncIOHandle, aligned_empty

    work = tempfile.mkdtemp(prefix="bench-disk-", dir=nvme_path)
    try:
        readers, writers = (AsyncIOHandle(**TUNED_AIO) for _ in range(2))
        src, dst = aligned_empty(size, pin=False), aligned_empty(size, pin=False)
        src.fill_(1)
        a, b = os.path.join(work, "a"), os.path.join(work, "b")
        writers.write(src, a)
        writers.write(src, b)  # both files exist: every timed write overwrites in place
        alone_r, alone_w, both = [], [], []
        for _ in range(reps):
            t = time.perf_counter(); readers.read(dst, a); alone_r.append(time.perf_counter() - t)  # noqa: E702
            t = time.perf_counter(); writers.write(src, b); alone_w.append(time.perf_counter() - t)  # noqa: E702
            t = time.perf_counter()
            ids = readers.submit_read(dst, a), writers.submit_write(src, b)
            readers.wait(ids[0])
            writers.wait(ids[1])
            both.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_gb = lambda xs: statistics.median(xs) / (size / 1e9)  # noqa: E731
    return {"read_s_per_gb": per_gb(alone_r), "write_s_per_gb": per_gb(alone_w), "both_s_per_gb": per_gb(both),
            "bytes": size, "reps": reps}


def sustained_gbps(nvme_path: str, size: int, piece: int = 8 << 20, depth: int = 32, reps: int = 2) -> dict:
    """`disk_gbps` over `size` bytes a file, moved in `piece`-byte requests with `depth` of them in
    flight each way, as a streaming step moves its state, instead of one buffer of `size` bytes
    (which caps it at what memory holds). On this machine's virtio disk it ran 5-20% slower than
    disk_gbps's 1 GiB in one buffer, at 1 GiB and at 8 GiB alike (finetune_3b.md)."""
    from infinity.io import AsyncIOHandle, aligned_empty

    work = tempfile.mkdtemp(prefix="bench-disk-", dir=nvme_path)
    n = max(1, size // piece)
    try:
        readers, writers = (AsyncIOHandle(**TUNED_AIO) for _ in range(2))
        bufs = [aligned_empty(piece, pin=False) for _ in range(2 * depth)]
        for b in bufs:
            b.fill_(1)
        a, b = os.path.join(work, "a"), os.path.join(work, "b")
        for path in (a, b):  # both files exist: every timed write overwrites in place
            for i in range(n):
                writers.submit_write(bufs[i % depth], path, i * piece)
                if writers.num_pending >= depth:
                    writers.wait()
            writers.wait()

        def timed(read: bool, write: bool) -> float:
            t = time.perf_counter()
            pending: list[tuple[AsyncIOHandle, int]] = []
            for i in range(n):
                while len(pending) >= (depth - 1) * (read + write):  # piece i - depth's buffers are free
                    handle, request = pending.pop(0)
                    handle.wait(request)
                if read:
                    pending.append((readers, readers.submit_read(bufs[i % depth], a, i * piece)))
                if write:
                    pending.append((writers, writers.submit_write(bufs[depth + i % depth], b, i * piece)))
            for handle, request in pending:
                handle.wait(request)
            return time.perf_counter() - t

        alone_r, alone_w, both = [], [], []
        for _ in range(reps):
            alone_r.append(timed(True, False))
            alone_w.append(timed(False, True))
            both.append(timed(True, True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_gb = lambda xs: statistics.median(xs) / (n * piece / 1e9)  # noqa: E731
    return {"read_s_per_gb": per_gb(alone_r), "write_s_per_gb": per_gb(alone_w), "both_s_per_gb": per_gb(both),
            "bytes": n * piece, "piece": piece, "depth": depth, "reps": reps}


def io_floor(num_params: int, disks: list[dict]) -> dict:
    """The step's bytes over the disk: read + write one after the other, or both at once,
    whichever is less (module docstring); from the medians over the disk's measurements."""
    gb = 14 * num_params / 1e9  # each way
    med = lambda key: statistics.median(d[key] for d in disks)  # noqa: E731
    sequential = gb * (med("read_s_per_gb") + med("write_s_per_gb"))
    together = gb * med("both_s_per_gb")
    return {"step_s": min(sequential, together), "read_plus_write_s": sequential, "both_at_once_s": together,
            "half_duplex": together > 0.9 * sequential, "gb_each_way": gb,
            "read_gbps": 1 / med("read_s_per_gb"), "write_gbps": 1 / med("write_s_per_gb")}


# ---- the rounds -------------------------------------------------------------------------------

def proc_io() -> tuple[int, int]:
    """The bytes this process has read from and written to storage so far, as the kernel counts
    them (/proc/self/io; the I/O threads and io_uring's workers are threads of this process)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def run_rounds(args, gpt, model_cfg, work: str) -> tuple[dict, dict]:
    """Interleaved steps of every case: per case its step times, bytes moved and waits."""
    import infinity
    from infinity.device.timeline import TIMELINE

    engines, configs = {}, {}
    runs = {c: {"times": [], "moved_bytes": [], "disk_bytes": [], "waits": [], "compute_wait_s": [], "losses": []}
            for c in args.cases}
    try:
        for case in args.cases:
            torch.manual_seed(0)
            sub = os.path.join(work, case)
            os.makedirs(sub)
            configs[case] = engine_config(case, sub, model_cfg["micro"], args.clip)
            t0 = time.perf_counter()
            engines[case], *_ = infinity.initialize(model=gpt.GPT(gpt_config(gpt, model_cfg)), config=configs[case])
            aio, zero = engines[case].config.aio, engines[case].config.zero
            runs[case]["aio"] = {k: getattr(aio, k) for k in ("block_size", "queue_depth", "thread_count", "engine")}
            runs[case]["max_in_cpu"] = {"offload_param": zero.offload_param.max_in_cpu,
                                        "offload_optimizer": zero.offload_optimizer.max_in_cpu}
            runs[case]["chosen"] = engines[case].chosen  # what the engine sized itself (its pool and pieces)
            print(f"{case}: built in {time.perf_counter() - t0:.1f} s; aio block_size {aio.block_size >> 10} KiB, "
                  f"queue_depth {aio.queue_depth}", flush=True)
        for r in range(args.rounds + 1):  # round 0 records the order and warms up
            order = args.cases[r % len(args.cases):] + args.cases[:r % len(args.cases)]
            for case in order:
                engine, run = engines[case], runs[case]
                idx, tgt = batch(model_cfg["vocab"], model_cfg["micro"], model_cfg["seq"], r)
                tracing = args.trace_dir and r == args.rounds and case != "cpu"
                if tracing:
                    TIMELINE.start()
                io0 = proc_io()
                t0 = time.perf_counter()
                loss = engine(idx, tgt)
                engine.backward(loss)
                engine.step()
                dt = time.perf_counter() - t0
                io1 = proc_io()
                if tracing:
                    TIMELINE.write(os.path.join(args.trace_dir, f"{case}.json"), TIMELINE.stop())
                rep = engine.report.last
                run["losses"].append(round(loss.item(), 4))
                if r:
                    run["times"].append(dt)
                    run["moved_bytes"].append(
                        (rep.get("nvme_read_bytes", 0) + rep.get("optimizer_nvme_read_bytes", 0),
                         rep.get("nvme_write_bytes", 0) + rep.get("optimizer_nvme_write_bytes", 0)))
                    run["disk_bytes"].append((io1[0] - io0[0], io1[1] - io0[1]))  # what the kernel counted
                    run["waits"].append(rep.get("waits", {}))
                    run["compute_wait_s"].append(rep.get("compute_wait_s", 0.0))
                print(f"round {r} {case}: {dt:.3f} s, loss {loss.item():.4f}, "
                      f"waited {rep.get('compute_wait_s', 0.0):.3f} s", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    for case in args.cases:
        configs[case] = json.loads(json.dumps(configs[case]).replace(work, "<nvme>"))
    return runs, configs


def gpt_config(gpt, m: dict):
    return gpt.GPTConfig(vocab_size=m["vocab"], seq_len=m["seq"], dim=m["dim"], layers=m["layers"],
                         heads=max(1, m["dim"] // 64))


def summarize(runs: dict, floor: dict, cases: list[str]) -> dict:
    """Per case: step median (min-max), bytes moved, compute-thread wait, and per-round ratios to
    max(floors) and to the compute floor."""
    compute = runs.get("cpu", {}).get("times")
    out = {}
    print(f"\nI/O floor {floor['step_s']:.3f} s (read + write {floor['read_plus_write_s']:.3f} s, both at once "
          f"{floor['both_at_once_s']:.3f} s: {'half' if floor['half_duplex'] else 'full'}-duplex; read "
          f"{floor['read_gbps']:.2f} GB/s, write {floor['write_gbps']:.2f} GB/s)")
    for case in cases:
        run = runs[case]
        entry = {"step_s": spread(run["times"]), "wait_s": statistics.median(run["compute_wait_s"])}
        line = f"{case:>16}: step {entry['step_s']} s, waited {entry['wait_s']:.3f} s"
        if case != "cpu":
            rb, wb = (statistics.median(x) for x in zip(*run["moved_bytes"]))
            entry["moved_gb"] = (rb / 1e9, wb / 1e9)
            line += f", moved {rb / 1e9:.2f} / {wb / 1e9:.2f} GB"
            if compute:
                floors = [max(floor["step_s"], c) for c in compute]
                entry["over_max_floors"] = spread([t / f for t, f in zip(run["times"], floors)])
                entry["over_cpu"] = spread([t / c for t, c in zip(run["times"], compute)])
                line += f" | / max(floors) {entry['over_max_floors']} | / cpu {entry['over_cpu']}"
        out[case] = entry
        print(line)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="134m")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), help="default: the model's (DEFAULT_CASES)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping of every case")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--disk-bytes", type=int, default=1 << 30, help="bytes per timed transfer of the I/O floor")
    p.add_argument("--nvme-path", default="/work")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--output")
    args = p.parse_args()
    args.cases = args.cases or DEFAULT_CASES[args.model]
    return args


def main() -> int:
    args = parse_args()
    gpt = load_gpt()
    model_cfg = MODELS[args.model]
    num_params = gpt_config(gpt, model_cfg).num_params()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-user-configs-", dir=args.nvme_path)
    os.environ["INFINITY_CACHE_DIR"] = os.path.join(work, "aio-cache")  # measured in this run
    try:
        disks = [disk_gbps(work, args.disk_bytes)]
        runs, configs = run_rounds(args, gpt, model_cfg, work)
        disks.append(disk_gbps(work, args.disk_bytes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    floor = io_floor(num_params, disks)
    print(f"\n{num_params / 1e6:.1f}M parameters ({args.model}), clip {args.clip}, {args.rounds} rounds")
    summary = summarize(runs, floor, args.cases)
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
        result = {"command": " ".join(["python", *sys.argv]), "commit": commit,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "args": vars(args),
                  "model": model_cfg, "params": num_params, "disk": disks, "io_floor": floor,
                  "configs": configs, "runs": runs, "summary": summary}
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
