"""The `infinity` command: `finetune` (the main job), `estimate` (what fits where), `consolidate`
(a checkpoint to a Hugging Face safetensors directory) and `clean` (what runs killed outright
left on disk).

    infinity finetune                       # built-in default: a small Llama on the stdlib's source, NVMe offload
    infinity finetune --model ./Llama-3.2-1B --data chat.jsonl --lora 16 --save ckpt/ --export out/
    infinity estimate --params 13B --gpus 1 --gpu-mem 80G --cpu-mem 512G --nvme-free 4T
    infinity estimate --model llama-3b --lora 16   # this machine's memory and disk
    infinity consolidate ckpt/ out/ --dtype bf16
    infinity run --num_gpus 2 train.py --deepspeed ds.json   # `deepspeed` is infinity in train.py
    infinity clean /local_nvme [--dry-run]          # also a checkpoint or export directory
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys



def finetune(args: argparse.Namespace) -> int:
    from infinity.apps.finetune import run
    return run(args)


def estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Bytes per tier for each offload choice, what fits this (or a described) machine, and the
    config block to paste (infinity.apps.tools.estimate)."""
    from infinity.apps.tools.estimate import run

    return run(args, parser)


def clean(args: argparse.Namespace) -> int:
    """Lists what runs killed outright left in DIR (NVMe stores under an nvme_path, unfinished
    saves and exports in a checkpoint or export directory) and removes what belongs to
    processes that are gone."""
    from infinity.checkpoint import leftovers
    from infinity.offload.lock import remove_stale, survey
    from infinity.offload._messages import human_bytes

    stores = survey(args.directory)
    found = leftovers.find_for(args.directory)
    if not stores and not found:
        print(f"nothing that infinity left in {args.directory}")
        return 0
    print(f"{'status':<16}{'size':>10}  path (what, owner)")
    for f in stores:
        print(f"{f.status:<16}{human_bytes(f.nbytes):>10}  {f.directory} (an NVMe store, {f.owner})")
    for f in found:
        back = f"; put back as {f.restore}" if f.restore else ""
        print(f"{f.status:<16}{human_bytes(f.nbytes):>10}  {f.path} ({f.what}, "
              f"{leftovers.describe_writer(f.writer)}{back})")
    stale = [f.nbytes for f in stores if f.status == "stale"] + [f.nbytes for f in found if f.status == "stale"]
    reclaim = human_bytes(sum(stale))
    if args.dry_run:
        print(f"{len(stale)} stale, {reclaim}: run without --dry-run to remove them")
        return 0
    remove_stale(args.directory, "infinity-*/rank*")
    leftovers.remove(found)
    print(f"removed {len(stale)} stale, {reclaim}; what is in use is left alone")
    return 0


def consolidate(args: argparse.Namespace) -> int:
    """Checkpoint -> safetensors from the fp32 masters, one unit at a time (no model code, no GPU)."""
    from infinity.checkpoint import consolidate as run
    from infinity.checkpoint.export import DTYPES
    from infinity.offload._messages import human_bytes

    written = run(args.checkpoint_dir, args.out_dir, dtype=DTYPES[args.dtype], tag=args.tag,
                  max_shard_size=args.max_shard_size, lora_scale=args.lora_scale)
    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files ({human_bytes(total)}) to {args.out_dir}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def _check_finetune_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path}: not a directory")
    for flag, path in (("--data", args.data), ("--config", args.config)):
        if path is not None and not os.path.isfile(path):
            parser.error(f"{flag} {path}: not a file")
    if args.model and not os.path.isdir(args.model) and (os.sep in args.model or os.path.exists(args.model)):
        parser.error(f"--model {args.model}: not a directory (expected a Hugging Face model directory or a preset name)")
    if args.save_total_limit is not None and not args.save:
        parser.error("--save-total-limit: keeps the newest checkpoints under --save; give --save DIR too")
    if args.config:
        try:  # read before the data and the model are
            with open(args.config, encoding="utf-8") as f:
                json.load(f)
        except ValueError as e:  # UnicodeDecodeError (a binary file) and JSONDecodeError are ValueErrors
            parser.error(f"--config {args.config}: not a JSON file ({e})")
        given = [flag for flag, value in (("--lr", args.lr), ("--batch", args.batch), ("--offload", args.offload))
                 if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: only set the built-in config; with --config, set them in its JSON "
                         "(optimizer.params.lr, train_micro_batch_size_per_gpu, zero_optimization.offload_*)")


def main(argv: list[str] | None = None) -> int:
    from infinity.apps.tools.estimate import add_arguments as add_estimate_arguments

    parser = argparse.ArgumentParser(prog="infinity", description="ZeRO-Infinity offload engine for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("finetune", help="fine-tune a causal LM with parameters and optimizer state offloaded")
    from infinity.apps.finetune import add_arguments
    add_arguments(f)
    e = sub.add_parser("estimate", help="what fits where: bytes per tier for each offload choice, and a config")
    add_estimate_arguments(e)
    k = sub.add_parser("consolidate", help="write a checkpoint's weights as Hugging Face safetensors")
    k.add_argument("checkpoint_dir", help="a checkpoint (save_dir/tag), or save_dir to take the tag 'latest' names")
    k.add_argument("out_dir", help="where model.safetensors (or its shards and index) go")
    k.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the weights written")
    k.add_argument("--tag", help="the tag under CHECKPOINT_DIR (default: the one 'latest' names)")
    k.add_argument("--max-shard-size", default="5GB", help="split into shards above this size (default 5GB)")
    k.add_argument("--lora-scale", type=_finite_float, help="merge the checkpoint's LoRA adapters into their "
                   "weights, each as B @ A * LORA_SCALE (alpha / r: 2 for `infinity finetune --lora`)")
    from infinity.apps.launcher import add_arguments as add_run_arguments
    r = sub.add_parser("run", help="launch a training script on every GPU (CPU ranks without one) and host, as the "
                       "`deepspeed` launcher does, with `deepspeed` meaning infinity in it",
                       usage="infinity run [--num_gpus N] [--hostfile F] [--include/--exclude SPEC] [options] "
                       "SCRIPT [ARGS...]")
    add_run_arguments(r)
    c = sub.add_parser("clean", help="list and remove what runs killed outright (kill -9, OOM) left on disk")
    c.add_argument("directory", metavar="DIR", help="the nvme_path of the runs, a checkpoint directory (save_dir), "
                   "or an export's directory")
    c.add_argument("--dry-run", action="store_true", help="list only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "run":
        from infinity.apps.launcher import run as launch
        return launch(args)
    if args.command == "finetune":
        _check_finetune_arguments(parser, args)
        try:
            return finetune(args)
        except (ValueError, OSError) as e:  # bad input found on the way (data, config, model): no traceback
            print(f"infinity finetune: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # the engine's files went with it (engine.close in finetune.run)
            print("infinity finetune: interrupted", file=sys.stderr)
            return 130
    if args.command == "consolidate":
        if not os.path.isdir(args.checkpoint_dir):
            parser.error(f"checkpoint_dir {args.checkpoint_dir}: not a directory")
        try:
            return consolidate(args)
        except (ValueError, OSError) as e:  # a damaged checkpoint, a bad out_dir, a full disk: no traceback
            print(f"infinity consolidate: {e}", file=sys.stderr)
            return 2
    if args.command == "clean":
        if not os.path.isdir(args.directory):
            parser.error(f"DIR {args.directory}: not a directory")
        return clean(args)
    return estimate(args, e)


if __name__ == "__main__":
    sys.exit(main())
