"""The `infinity` command: `finetune` (the main job), `estimate` (what fits where), `consolidate`
(a checkpoint to a Hugging Face safetensors directory) and `clean` (what runs killed outright
left on disk).

    infinity finetune                       # built-in default: a small GPT, params and optimizer on NVMe
    infinity finetune --config ds.json --layers 24 --dim 2048 --steps 100
    infinity estimate --params 13e9 --world-size 1
    infinity consolidate ckpt/ out/ --dtype bf16
    infinity clean /local_nvme [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile

import torch
from tqdm import tqdm


def _default_config(nvme_path: str, offload: str, micro_batch: int) -> dict:
    device = {"device": offload, "nvme_path": nvme_path} if offload == "nvme" else {"device": offload}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": dict(device, buffer_count=6, max_in_cpu=0),
            "offload_optimizer": dict(device, buffer_count=9),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 16},
    }


def _synthetic_batches(vocab: int, seq_len: int, batch: int, seed: int):
    """Sequences where every token determines the next one: a loss that visibly falls."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab, generator=g)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seq = [start]
        for _ in range(seq_len):
            seq.append(table[seq[-1]])
        seq = torch.cat(seq, dim=1)
        yield seq[:, :-1], seq[:, 1:]


def finetune(args: argparse.Namespace) -> int:
    import infinity
    from infinity.models import GPT, GPTConfig

    cfg_model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
                          heads=max(1, args.dim // 64))
    torch.manual_seed(args.seed)
    work = None
    if args.config:
        config = args.config
    else:
        work = tempfile.mkdtemp(prefix="infinity-finetune-", dir=args.nvme_path)
        config = _default_config(work, args.offload, args.batch)
    try:
        model = GPT(cfg_model)
        engine, _, _, _ = infinity.initialize(model=model, config=config)
        print(f"model: {cfg_model.num_params() / 1e6:.1f}M parameters in {len(engine.units)} units; "
              f"offload: param={engine.config.zero.offload_param.device}, "
              f"optimizer={engine.config.zero.offload_optimizer.device}")
        data = _synthetic_batches(args.vocab, args.seq_len, engine.config.batch.train_micro_batch_size_per_gpu,
                                  args.seed)
        first = last = None
        bar = tqdm(range(args.steps), desc="finetune", unit="step")
        for _ in bar:
            for _ in range(engine.config.batch.gradient_accumulation_steps):
                idx, tgt = next(data)
                loss = engine(idx.to(engine.device), tgt.to(engine.device))
                engine.backward(loss)
                engine.step()
            last = loss.item()
            first = last if first is None else first
            report = engine.report.last
            postfix = {"loss": f"{last:.3f}"}
            if "nvme_read_bytes" in report:
                postfix["read"] = f"{report['nvme_read_bytes'] / 2**20:.0f}MiB"
                postfix["overlap"] = f"{report.get('overlap_fraction', 0.0):.0%}"
            bar.set_postfix(postfix)
        print(f"loss {first:.3f} -> {last:.3f} in {args.steps} steps")
        print("last step:", json.dumps({k: v for k, v in engine.report.last.items() if not isinstance(v, list)},
                                        default=float))
        engine.close()
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def estimate(args: argparse.Namespace) -> int:
    """Bytes per tier for each offload choice, DeepSpeed's accounting for ZeRO-3 with Adam."""
    p, world, half = float(args.params), args.world_size, 2
    shard = p / world
    largest_unit = float(args.largest_unit or p / 32)
    rows = []
    for param in ("none", "cpu", "nvme"):
        for optim in ("none", "cpu", "nvme"):
            device = host = nvme = 0.0
            device += 2 * largest_unit * half  # two gathered units in flight
            if param == "none":
                device += half * shard
            elif param == "cpu":
                host += half * shard
            else:
                nvme += half * shard
            state = 16 * shard  # fp32 master, exp_avg, exp_avg_sq, fp32 grad accumulator
            if optim == "none":
                device += state
            elif optim == "cpu":
                host += state
            else:
                nvme += 12 * shard
                host += 4 * shard
            rows.append((param, optim, device, host, nvme))
    gib = 2 ** 30
    print(f"{p / 1e9:.2f}B parameters, world size {world}, per rank:")
    print(f"{'offload_param':<14}{'offload_optimizer':<19}{'device GiB':>11}{'host GiB':>10}{'nvme GiB':>10}")
    for param, optim, d, h, n in rows:
        print(f"{param:<14}{optim:<19}{d / gib:>11.1f}{h / gib:>10.1f}{n / gib:>10.1f}")
    return 0


def clean(args: argparse.Namespace) -> int:
    """Lists the store directories under NVME_PATH and removes those whose process is gone."""
    from infinity.tiers.lock import remove_stale, survey
    from infinity.tiers._messages import human_bytes

    found = survey(args.nvme_path)
    if not found:
        print(f"no infinity store directories under {args.nvme_path}")
        return 0
    print(f"{'status':<16}{'size':>10}  directory (owner)")
    for f in found:
        print(f"{f.status:<16}{human_bytes(f.nbytes):>10}  {f.directory} ({f.owner})")
    stale = [f for f in found if f.status == "stale"]
    reclaim = human_bytes(sum(f.nbytes for f in stale))
    if args.dry_run:
        print(f"{len(stale)} stale, {reclaim}: run without --dry-run to remove them")
        return 0
    removed = remove_stale(args.nvme_path, "infinity-*/rank*")
    print(f"removed {len(removed)} stale directories, {reclaim}; directories in use are left alone")
    return 0


def consolidate(args: argparse.Namespace) -> int:
    """Checkpoint -> safetensors from the fp32 masters, one unit at a time (no model code, no GPU)."""
    from infinity.checkpoint import consolidate as run
    from infinity.checkpoint.export import DTYPES
    from infinity.tiers._messages import human_bytes

    written = run(args.checkpoint_dir, args.out_dir, dtype=DTYPES[args.dtype], tag=args.tag,
                  max_shard_size=args.max_shard_size)
    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files ({human_bytes(total)}) to {args.out_dir}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_count(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 13e9, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a finite number of at least 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity", description="ZeRO-Infinity offload engine for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("finetune", help="train a GPT with parameters and optimizer state offloaded")
    f.add_argument("--config", help="DeepSpeed JSON config (default: a built-in one, NVMe offload)")
    f.add_argument("--nvme-path", default=tempfile.gettempdir(), help="directory for the offload files")
    f.add_argument("--offload", choices=["cpu", "nvme"], default="nvme", help="tier for the built-in config")
    f.add_argument("--steps", type=_positive_int, default=30)
    f.add_argument("--batch", type=_positive_int, default=4)
    f.add_argument("--layers", type=_positive_int, default=8)
    f.add_argument("--dim", type=_positive_int, default=256)
    f.add_argument("--vocab", type=_positive_int, default=4096)
    f.add_argument("--seq-len", type=_positive_int, default=64)
    f.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("estimate", help="memory per tier for a model size")
    e.add_argument("--params", required=True, type=_positive_count, help="number of parameters, e.g. 13e9")
    e.add_argument("--world-size", type=_positive_int, default=1)
    e.add_argument("--largest-unit", type=_positive_count, help="parameters of the largest unit (default params/32)")
    k = sub.add_parser("consolidate", help="write a checkpoint's weights as Hugging Face safetensors")
    k.add_argument("checkpoint_dir", help="a checkpoint (save_dir/tag), or save_dir to take the tag 'latest' names")
    k.add_argument("out_dir", help="where model.safetensors (or its shards and index) go")
    k.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the weights written")
    k.add_argument("--tag", help="the tag under CHECKPOINT_DIR (default: the one 'latest' names)")
    k.add_argument("--max-shard-size", default="5GB", help="split into shards above this size (default 5GB)")
    c = sub.add_parser("clean", help="list and remove what runs killed outright (kill -9, OOM) left on disk")
    c.add_argument("nvme_path", help="the nvme_path of the runs")
    c.add_argument("--dry-run", action="store_true", help="list only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "finetune":
        if not os.path.isdir(args.nvme_path):
            parser.error(f"--nvme-path {args.nvme_path}: not a directory")
        return finetune(args)
    if args.command == "consolidate":
        if not os.path.isdir(args.checkpoint_dir):
            parser.error(f"checkpoint_dir {args.checkpoint_dir}: not a directory")
        try:
            return consolidate(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"infinity consolidate: {e}", file=sys.stderr)
            return 2
    if args.command == "clean":
        if not os.path.isdir(args.nvme_path):
            parser.error(f"nvme_path {args.nvme_path}: not a directory")
        return clean(args)
    return estimate(args)


if __name__ == "__main__":
    sys.exit(main())
