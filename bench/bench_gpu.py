"""On a CUDA GPU: host <-> device bandwidth from our pinned pool against plain pinned memory, and
a bf16 training step with and without offload.

    python bench/bench_gpu.py copies --output copies.json
    python bench/bench_gpu.py step --mode plain --layers 20 --dim 2048
    python bench/bench_gpu.py step --mode nvme --layers 40 --dim 4096 --nvme-path /data

`copies`: 1 GiB host -> device and device -> host, through `CudaDevice` from a buffer of our
`BufferPool` (page-aligned, cudaHostRegister'ed) and through `Tensor.copy_` from
`torch.empty(pin_memory=True)` (cudaHostAlloc), in interleaved rounds; medians and ranges.

`step` (one mode per process, so each starts with an empty GPU):
  * plain: plain PyTorch, bf16 model on the GPU, fp32 masters and AdamW (fused) on the GPU,
    clip_grad_norm_ 1.0: no offload;
  * none: the engine, stage 3, nothing offloaded (fp32 state on the GPU, CPU Adam not used);
  * cpu / nvme: the engine with parameters and optimizer state in CPU memory / on NVMe
    (`--optim cpu` keeps the optimizer in CPU memory while parameters go to NVMe).
The model is built under `infinity.Init` for the engine's modes, so host memory never holds it whole.
Each engine step also records the bytes this process moved to and from the disk (/proc/self/io).

`formats DIR`: the FORMATS runs of bench/gpu_session.sh side by side (fp32, bf16 and 8-bit moments
at one size, rounds interleaved): median step and disk bytes a parameter, each against fp32's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def copies(args) -> dict:
    from infinity.device.cuda import CudaDevice
    from infinity.offload.pool import BufferPool

    size = args.copy_mib << 20
    dev = CudaDevice()
    pool = BufferPool(1, size, name="offload_param")
    ours = pool.acquire(size)
    plain = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    ours.fill_(1)
    plain.fill_(1)
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    results: dict[str, list[float]] = {"h2d_pool": [], "h2d_plain": [], "d2h_pool": [], "d2h_plain": []}

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return size / (time.perf_counter() - t) / 1e9

    for _ in range(2):  # warm-up
        dev.wait_host(dev.to_device(ours, gpu))
        gpu.copy_(plain, non_blocking=True)
    for _ in range(args.rounds):
        results["h2d_pool"].append(timed(lambda: dev.wait_host(dev.to_device(ours, gpu))))
        results["h2d_plain"].append(timed(lambda: gpu.copy_(plain, non_blocking=True)))
        results["d2h_pool"].append(timed(lambda: dev.wait_host(dev.to_host(gpu, ours))))
        results["d2h_plain"].append(timed(lambda: plain.copy_(gpu, non_blocking=True)))
    out = {k: _spread(v) for k, v in results.items()}
    out["h2d_ratio"] = out["h2d_pool"]["median"] / out["h2d_plain"]["median"]
    out["d2h_ratio"] = out["d2h_pool"]["median"] / out["d2h_plain"]["median"]
    out["bytes"] = size
    pool.release(ours)
    return out


def _gpt(args, meta: bool):
    import infinity
    from infinity.apps.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers, heads=args.dim // 128)
    torch.manual_seed(0)
    if meta:
        with infinity.Init():
            return GPT(cfg), cfg
    return GPT(cfg), cfg


def _batch(args, step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def step_plain(args) -> dict:
    model, cfg = _gpt(args, meta=False)
    model = model.cuda()
    masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    times, losses = [], []
    for s in range(args.steps + 1):
        idx, tgt = _batch(args, s)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(idx.cuda(), tgt.cuda())
        loss.backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        torch.cuda.synchronize()
        losses.append(loss.item())
        if s:
            times.append(time.perf_counter() - t)
        print(f"  plain step {s}: {time.perf_counter() - t:.3f} s, loss {loss.item():.4f}", flush=True)
    return {"params": cfg.num_params(), "step": _spread(times), "losses": losses,
            "gpu_peak_bytes": torch.cuda.max_memory_allocated()}


def step_engine(args) -> dict:
    import infinity

    work = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.nvme_path)
    optim = args.optim or args.mode
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": args.sub_group_size,
            "offload_param": {"device": args.mode, "nvme_path": work, "buffer_count": 8, "buffer_size": 2e8,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": optim, "nvme_path": work, "buffer_count": args.optim_buffers}}
    if args.max_grad_in_cpu is not None:
        zero["offload_optimizer"]["max_grad_in_cpu"] = int(args.max_grad_in_cpu)
    if args.optim_max_in_cpu is not None:
        zero["offload_optimizer"]["max_in_cpu"] = int(args.optim_max_in_cpu)
    adamw = {"lr": 1e-4, "weight_decay": 0.01, "moment_format": args.moment_format}
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": args.clip, "bf16": {"enabled": True},
              "steps_per_print": 1, "optimizer": {"type": "AdamW", "params": adamw},
              "zero_optimization": zero,
              "aio": {"block_size": 8 << 20, "queue_depth": 32, "thread_count": 2}}
    try:
        t = time.perf_counter()
        model, cfg = _gpt(args, meta=True)
        engine, *_ = infinity.initialize(model=model, config=config)
        setup = time.perf_counter() - t
        print(f"  engine set up in {setup:.1f} s", flush=True)
        times, losses, moved = [], [], []
        for s in range(args.steps + 1):
            idx, tgt = _batch(args, s)
            torch.cuda.synchronize()
            before = _proc_io()
            t = time.perf_counter()
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize()
            losses.append(loss.item())
            if s:
                times.append(time.perf_counter() - t)
                moved.append({k: v - before[k] for k, v in _proc_io().items()})
            print(f"  {args.mode}/{optim} step {s}: {time.perf_counter() - t:.3f} s, loss {loss.item():.4f}",
                  flush=True)
        report = dict(engine.report.last)
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"params": cfg.num_params(), "setup_s": setup, "step": _spread(times), "losses": losses,
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(), "report": report, "optim": optim,
            "disk_bytes": moved}


def _proc_io() -> dict:
    """This process's bytes read from and written to the disk so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


def formats(args) -> dict:
    """The `step --moment-format` runs of `gpu_session.sh`'s FORMATS section, side by side: each
    format's median step and disk bytes a parameter (/proc/self/io), and its ratios to fp32's,
    from the JSON files fmt_<format>_r<round>.json in `args.dir`."""
    import glob
    import os

    runs: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(args.dir, "fmt_*_r*.json"))):
        fmt = os.path.basename(path).split("_")[1]
        with open(path) as f:
            runs.setdefault(fmt, []).append(json.load(f))
    out = {}
    for fmt, rs in runs.items():
        steps = [t for r in rs for t in r["step"]["rounds"]]
        moved = [(m["read_bytes"] + m["write_bytes"]) / r["params"] for r in rs for m in r["disk_bytes"]]
        out[fmt] = {"step": _spread(steps), "disk_bytes_per_param": _spread(moved), "runs": len(rs)}
    if "fp32" in out:
        for fmt, o in out.items():
            o["step_vs_fp32"] = o["step"]["median"] / out["fp32"]["step"]["median"]
            o["bytes_vs_fp32"] = o["disk_bytes_per_param"]["median"] / out["fp32"]["disk_bytes_per_param"]["median"]
    for fmt, o in out.items():
        print(f"{fmt:5s} step {o['step']['median']:.3f} s ({o['step']['min']:.3f}-{o['step']['max']:.3f}), "
              f"{o['disk_bytes_per_param']['median']:.2f} disk bytes a parameter, "
              f"{o.get('step_vs_fp32', float('nan')):.2f}x fp32's step, "
              f"{o.get('bytes_vs_fp32', float('nan')):.2f}x its bytes")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("copies")
    c.add_argument("--copy-mib", type=int, default=1024)
    c.add_argument("--rounds", type=int, default=7)
    s = sub.add_parser("step")
    s.add_argument("--mode", choices=["plain", "none", "cpu", "nvme"], required=True)
    s.add_argument("--optim", choices=["none", "cpu", "nvme"], help="optimizer placement (default: --mode's)")
    s.add_argument("--layers", type=int, default=20)
    s.add_argument("--dim", type=int, default=2048)
    s.add_argument("--vocab", type=int, default=32000)
    s.add_argument("--seq", type=int, default=1024)
    s.add_argument("--micro", type=int, default=4)
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--sub-group-size", type=float, default=1e8)
    s.add_argument("--optim-buffers", type=int, default=16)
    s.add_argument("--moment-format", choices=["fp32", "bf16", "8bit"], default="fp32",
                   help="optimizer.params.moment_format of the engine's AdamW")
    s.add_argument("--max-grad-in-cpu", type=float, help="offload_optimizer.max_grad_in_cpu (elements)")
    s.add_argument("--optim-max-in-cpu", type=float, help="offload_optimizer.max_in_cpu (elements; 0: all on NVMe)")
    s.add_argument("--nvme-path", default=".")
    s.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: none)")
    f = sub.add_parser("formats", help="summarize gpu_session.sh's FORMATS runs")
    f.add_argument("dir")
    for q in (c, s, f):
        q.add_argument("--output")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info = {"gpu": gpu, "torch": torch.__version__, "args": vars(args)}
    if args.what == "copies":
        result = copies(args)
    elif args.what == "formats":
        result = formats(args)
    elif args.mode == "plain":
        try:
            result = step_plain(args)
        except torch.cuda.OutOfMemoryError as e:  # the size does not fit this GPU: that is the finding
            result = {"oom": str(e).splitlines()[0], "gpu_peak_bytes": torch.cuda.max_memory_allocated()}
    else:
        result = step_engine(args)
    result.update(info)
    print(json.dumps({k: v for k, v in result.items() if k != "report"}, default=float))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
