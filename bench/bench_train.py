"""End-to-end training step with parameters and optimizer state on NVMe, against its floors and
against DeepSpeed ZeRO-Infinity on the same model and config.

    python bench/bench_train.py --layers 20 --dim 2048 --vocab 32000 --steps 3 --nvme-path /work

In one run it measures
  * infinity: the step with offload_param and offload_optimizer on NVMe (bf16, stage 3);
  * the compute floor: the same engine and knobs with params and optimizer state in CPU memory,
    before and after the NVMe run; a model that does not fit is timed at two depths
    (--floor-layers) and extrapolated linearly in depth;
  * the I/O floor: the bytes a step must move (see io_floor) over the read and write GB/s of
    our handle, measured before and after the runs;
  * DeepSpeed 0.19.8 ZeRO-Infinity on the CPU accelerator with the same model and data, in the
    virtual environment given by --ds-python (skipped when missing), with the same knobs
    (`--knobs same`) or each engine at its own best (`--knobs tuned`): see KNOBS.
It prints medians with min-max, the ratios step / max(floors) and DeepSpeed / infinity, and
records the commit and command in --output.
"""

from __future__ import annotations

import argparse
import importlib.util
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
GPT_FILE = os.path.join(HERE, "..", "infinity", "apps", "models", "gpt.py")


def load_gpt():
    """The model module by path, so the DeepSpeed environment needs no infinity install."""
    spec = importlib.util.spec_from_file_location("bench_gpt", GPT_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


# The knobs a config leaves to the user, for both engines. "same": one set given to both
# (DeepSpeed 0.19.8 needs stage3_prefetch_bucket_size 0 with NVMe params and max_in_cpu 0, its
# issue #3062, so neither prefetches). "tuned": each at its best setting found here (see
# bench/results/train.md for the DeepSpeed settings tried).
KNOBS = {
    "same": {"prefetch": 0, "sub_group_size": 2.5e7, "param_buffers": 8, "optimizer_buffers": 48,
             "block_size": 1 << 20},
    # 96 optimizer buffers (9.6 GB of pool): with clipping, the state the pool holds is read during
    # backward for the next forward's updates; at 1.07B (12.9 GB of state) the rest is read in forward.
    "infinity-tuned": {"prefetch": 5e8, "sub_group_size": 2.5e7, "param_buffers": 8, "optimizer_buffers": 96,
                       "block_size": 8 << 20},
    # The fastest of the settings tried at 134M that also runs to the end
    # (bench/results/deepspeed_knobs_134m.json): 48 optimizer buffers were slower than its
    # default 4; prefetch with 16 param buffers ran 4 steps once and failed at step 1 in another
    # run ("param 0 already assigned swap buffer id", in its NVMe prefetch), so it stays off.
    "deepspeed-tuned": {"prefetch": 0, "sub_group_size": 2.5e7, "param_buffers": 8, "optimizer_buffers": 4,
                        "block_size": 8 << 20},
}


def ds_config(nvme_path: str, micro: int, knobs: dict, bf16: bool = True, clip: float = 1.0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": knobs["prefetch"],
            "sub_group_size": knobs["sub_group_size"],
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": knobs["param_buffers"],
                              "max_in_cpu": 0, "buffer_size": 1e8},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                  "buffer_count": knobs["optimizer_buffers"]},
        },
        "aio": {"block_size": knobs["block_size"], "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }


def batch(vocab: int, micro: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (micro, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def time_steps(engine, args, steps: int) -> list[float]:
    times = []
    for s in range(steps + 1):  # the first step records the order and warms up
        idx, tgt = batch(args.vocab, args.micro, args.seq, s)
        t0 = time.perf_counter()
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        if s:
            times.append(time.perf_counter() - t0)
        print(f"  step {s}: {time.perf_counter() - t0:.2f} s, loss {loss.item():.3f}", file=sys.stderr, flush=True)
    return times


def run_infinity(args, gpt, place: str = "nvme", layers: int | None = None) -> dict:
    """Our step with params and optimizer state on NVMe (`place` "nvme"), on NVMe behind host
    memory (`max_in_cpu` "auto" in both sections: "auto") or in CPU memory ("cpu", the compute
    floor), the same knobs otherwise."""
    import infinity

    cfg = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, layers=layers or args.layers,
                        heads=args.dim // 64)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    work = tempfile.mkdtemp(prefix="bench-train-", dir=args.nvme_path)
    config = ds_config(work, args.micro, our_knobs(args), clip=args.clip)
    config["zero_optimization"]["offload_optimizer"]["max_grad_in_cpu"] = args.max_grad_in_cpu
    if place == "cpu":
        for section in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][section] = {"device": "cpu"}
    elif place == "auto":  # RAM before disk: both sections keep what the host's budget holds
        for section in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][section]["max_in_cpu"] = "auto"
    try:
        engine, *_ = infinity.initialize(model=model, config=config)
        times = time_steps(engine, args, args.steps)
        report = dict(engine.report.last)
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"step_s": statistics.median(times), "times": times, "params": cfg.num_params(), "report": report,
            "config": config}


def our_knobs(args) -> dict:
    return KNOBS["same" if args.knobs == "same" else "infinity-tuned"]


def ds_knobs(args) -> dict:
    return KNOBS["same" if args.knobs == "same" else "deepspeed-tuned"]


def run_apart(args, place: str, layers: int | None = None) -> dict:
    """run_infinity in a process of its own: the memory of a 1.07B engine in CPU memory (21 GB
    here) and of the NVMe one's pools do not come back to the OS reliably inside one process."""
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--phase", f"{place}:{layers or args.layers}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{place} run at {layers or args.layers} layers failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compute_floor(args) -> dict:
    """The step of the same engine with params and optimizer state in CPU memory: the same
    arithmetic with no tier below. A model too large for memory is timed at two depths
    (`--floor-layers` and half of it) and the time extrapolated linearly in the number of layers:
    the embedding, head and loss are the fixed part, each block adds the same."""
    deep = min(args.layers, args.floor_layers or args.layers)
    steps = run_apart(args, "cpu", deep)["times"]
    out = {"measured_layers": [deep], "measured_steps_s": steps}
    step = statistics.median(steps)
    if deep < args.layers:
        # Medians at each depth: a difference of single steps would multiply their noise by the
        # layers added. The spread is the deep run's, scaled to the full depth.
        shallow = max(1, deep // 2)
        shallow_steps = run_apart(args, "cpu", shallow)["times"]
        per_layer = (step - statistics.median(shallow_steps)) / (deep - shallow)
        full = step + (args.layers - deep) * per_layer
        steps = [t * full / step for t in steps]
        out.update(measured_layers=[deep, shallow], per_layer_s=per_layer, shallow_steps_s=shallow_steps)
    out.update(steps_s=steps)
    return out


def handle_gbps(nvme_path: str, block_size: int, queue_depth: int = 32) -> tuple[list[float], list[float]]:
    """Read and write GB/s of our handle on a 1 GiB file in `nvme_path`, 3 of each."""
    from infinity.io import AsyncIOHandle, aligned_empty

    size = 1 << 30
    work = tempfile.mkdtemp(prefix="bench-io-", dir=nvme_path)
    try:
        handle = AsyncIOHandle(block_size=int(block_size), queue_depth=queue_depth)
        buf = aligned_empty(size)
        buf.fill_(1)
        path = os.path.join(work, "f")
        handle.write(buf, path)
        w, r = [], []
        for _ in range(3):
            t = time.perf_counter(); handle.write(buf, path); w.append(size / (time.perf_counter() - t) / 1e9)  # noqa: E702
            t = time.perf_counter(); handle.read(buf, path); r.append(size / (time.perf_counter() - t) / 1e9)  # noqa: E702
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r, w


def io_floor(args, num_params: int, r: list[float], w: list[float]) -> dict:
    """The bytes a step must move over the handle's GB/s: bf16 params read once (backward;
    forward can take them from the update that wrote them) and written once, fp32 master and
    both moments read and written, and the gradients beyond max_grad_in_cpu written in backward
    and read by the update (clipping only: without it nothing waits for the norm). Spread: from
    the slowest and fastest of the handle's runs."""
    spilled = max(0.0, num_params - args.max_grad_in_cpu) if args.clip > 0 else 0.0
    read_bytes = 14 * num_params + 4 * spilled
    write_bytes = 14 * num_params + 4 * spilled
    floor = lambda rg, wg: (read_bytes / rg + write_bytes / wg) / 1e9  # noqa: E731
    return {"step_s": floor(statistics.median(r), statistics.median(w)), "step_s_min": floor(max(r), max(w)),
            "step_s_max": floor(min(r), min(w)), "read_gbps": r, "write_gbps": w, "read_bytes": read_bytes,
            "write_bytes": write_bytes, "spilled_grad_params": spilled}


DS_SCRIPT = r"""
import json, os, sys, time, statistics, importlib.util, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
args = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("bench_gpt", args["gpt_file"]); gpt = importlib.util.module_from_spec(spec)
sys.modules["bench_gpt"] = gpt
spec.loader.exec_module(gpt)
deepspeed.init_distributed(dist_backend="gloo")
cfg = gpt.GPTConfig(vocab_size=args["vocab"], seq_len=args["seq"], dim=args["dim"], layers=args["layers"], heads=args["dim"] // 64)
torch.manual_seed(0)
model = gpt.GPT(cfg)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args["config"])
times = []
for s in range(args["steps"] + 1):
    g = torch.Generator().manual_seed(s)
    idx = torch.randint(0, args["vocab"], (args["micro"], args["seq"] + 1), generator=g)
    t0 = time.perf_counter()
    loss = engine(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    engine.step()
    if s:
        times.append(time.perf_counter() - t0)
    print(f"  deepspeed step {s}: {time.perf_counter() - t0:.2f} s, loss {loss.item():.3f}", file=sys.stderr, flush=True)
print(json.dumps({"step_s": statistics.median(times), "times": times}))
"""


def run_deepspeed(args) -> dict | None:
    if not os.path.exists(args.ds_python):
        print(f"{args.ds_python} not found: DeepSpeed skipped", file=sys.stderr)
        return None
    work = tempfile.mkdtemp(prefix="bench-ds-", dir=args.nvme_path)
    try:
        payload = {"gpt_file": GPT_FILE, "vocab": args.vocab, "seq": args.seq, "dim": args.dim, "layers": args.layers,
                   "micro": args.micro, "steps": args.steps,
                   "config": ds_config(work, args.micro, ds_knobs(args), clip=args.clip)}
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        out = subprocess.run([args.ds_python, "-c", DS_SCRIPT, json.dumps(payload)], env=env, cwd=tempfile.gettempdir(),
                             stdout=subprocess.PIPE, text=True, timeout=args.ds_timeout)
        if out.returncode != 0:
            print(f"DeepSpeed run failed with exit code {out.returncode}", file=sys.stderr)
            return {"error": out.returncode}
        return json.loads(out.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        print("DeepSpeed run timed out", file=sys.stderr)
        return {"error": "timeout"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(args, commit: str, ours: dict, floor_c: dict, floor_io: dict, ds: dict | None):
    """Prints the run's figures; returns max(floors) and step / max(floors) at the floors' spread."""
    floor = max(floor_c["step_s"], floor_io["step_s"])
    span = lambda d: f"{d['step_s']:.2f} s ({d['step_s_min']:.2f}-{d['step_s_max']:.2f})"  # noqa: E731
    times = ours["times"]
    print(f"\n{ours['params'] / 1e9:.2f}B params, bf16, micro-batch {args.micro} x {args.seq} tokens, "
          f"clipping {args.clip}, knobs {args.knobs}, commit {commit}")
    print(f"infinity step, median of {len(times)} (min-max): {ours['step_s']:.2f} s ({min(times):.2f}-{max(times):.2f})")
    print(f"compute floor (the engine in CPU memory), median (min-max): {span(floor_c)}")
    print(f"I/O floor ({floor_io['read_bytes'] / 1e9:.1f} GB read, {floor_io['write_bytes'] / 1e9:.1f} GB written, "
          f"handle {statistics.median(floor_io['read_gbps']):.2f} / {statistics.median(floor_io['write_gbps']):.2f} GB/s): "
          f"{span(floor_io)}")
    ratios = (ours["step_s"] / max(floor_c["step_s_max"], floor_io["step_s_max"]),
              ours["step_s"] / max(floor_c["step_s_min"], floor_io["step_s_min"]))
    print(f"step / max(floors) = {ours['step_s'] / floor:.3f} (with the floors' spread: {ratios[0]:.3f}-{ratios[1]:.3f})")
    if ds and "step_s" in ds:
        print(f"DeepSpeed step, median of {len(ds['times'])}: {ds['step_s']:.2f} s "
              f"({min(ds['times']):.2f}-{max(ds['times']):.2f}) -> DeepSpeed / infinity = {ds['step_s'] / ours['step_s']:.2f}")
    return floor, ratios


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--floor-layers", type=int, default=None,
                   help="layers timed in CPU memory for the compute floor (default: all of them)")
    p.add_argument("--nvme-path", default=".")
    p.add_argument("--clip", type=float, default=1.0,
                   help="gradient_clipping; 0 lets infinity update each unit during backward")
    p.add_argument("--knobs", choices=("same", "tuned"), default="same",
                   help="same: one set of knobs for both engines; tuned: each at its best (KNOBS)")
    p.add_argument("--max-grad-in-cpu", type=float, default=1e9,
                   help="offload_optimizer.max_grad_in_cpu: gradient elements held in host memory")
    p.add_argument("--ds-python", default="/work/venv-ds/bin/python")
    p.add_argument("--ds-timeout", type=int, default=3600)
    p.add_argument("--auto", action="store_true",
                   help="also run infinity with max_in_cpu 'auto' in both offload sections (DeepSpeed has no such value)")
    p.add_argument("--skip-deepspeed", action="store_true")
    p.add_argument("--only-deepspeed", action="store_true",
                   help="run DeepSpeed alone (at sizes where both do not fit in memory at once)")
    p.add_argument("--output")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # PLACE:LAYERS, one engine's run (run_apart)
    return p


def _print_auto(auto: dict, ours: dict, floor_c: dict, ds: dict | None) -> None:
    """--auto's line: the max_in_cpu 'auto' step against the compute floor, all-NVMe and DeepSpeed."""
    moved = {k: v for k, v in auto["report"].items() if "bytes" in k}
    print(f"infinity with max_in_cpu 'auto', median of {len(auto['times'])}: {auto['step_s']:.2f} s "
          f"({min(auto['times']):.2f}-{max(auto['times']):.2f}) = {auto['step_s'] / floor_c['step_s']:.2f}x the "
          f"compute floor, {auto['step_s'] / ours['step_s']:.2f}x all-NVMe"
          + (f", {ds['step_s'] / auto['step_s']:.2f}x faster than DeepSpeed" if ds and "step_s" in ds else "")
          + f"; last step moved {moved}")


def main() -> int:
    args = _parser().parse_args()
    gpt = load_gpt()
    if args.phase:
        place, layers = args.phase.split(":")
        out = run_infinity(args, gpt, place, int(layers))
        print("\n" + json.dumps(out, default=float))
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    meta = {"args": vars(args), "commit": commit, "command": " ".join(sys.argv),
            "knobs": {"infinity": our_knobs(args), "deepspeed": ds_knobs(args)}}
    if args.only_deepspeed:
        ds = run_deepspeed(args)
        print(json.dumps(ds))
        if args.output:
            with open(args.output, "w") as f:
                json.dump({**meta, "deepspeed": ds}, f, indent=2)
        return 0

    # The compute floor is measured before and after the NVMe run and the handle's GB/s around
    # it, so that floors and step share the machine's state (this VM's speed drifts by more than
    # the margins); the spread of each floor is reported.
    full = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers).num_params()
    deep = min(args.layers, args.floor_layers or args.layers)
    print(f"compute floor (the engine in CPU memory, {deep} layers):", flush=True)
    floors = [compute_floor(args)]
    r1, w1 = handle_gbps(args.nvme_path, our_knobs(args)["block_size"])
    print("infinity, params and optimizer on NVMe:", flush=True)
    ours = run_apart(args, "nvme")
    auto = None
    if args.auto:
        print("infinity, max_in_cpu 'auto':", flush=True)
        auto = run_apart(args, "auto")
    r2, w2 = handle_gbps(args.nvme_path, our_knobs(args)["block_size"])
    print(f"compute floor again ({deep} layers):", flush=True)
    floors.append(compute_floor(args))
    ds = None if args.skip_deepspeed else run_deepspeed(args)
    steps = [t for f in floors for t in f["steps_s"]]
    floor_c = {"step_s": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps), "runs": floors}
    floor_io = io_floor(args, full, r1 + r2, w1 + w2)

    floor, ratios = summarize(args, commit, ours, floor_c, floor_io, ds)
    if auto is not None:
        _print_auto(auto, ours, floor_c, ds)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({**meta, "infinity": ours, "infinity_auto": auto, "compute_floor": floor_c, "io_floor": floor_io,
                       "step_over_floors": ours["step_s"] / floor, "step_over_floors_spread": ratios,
                       "deepspeed": ds}, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
