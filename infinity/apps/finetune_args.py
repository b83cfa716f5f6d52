"""The command line of `infinity finetune`: its flags, and what can be checked of them before
anything is read or built."""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from infinity.apps.finetune_config import DEFAULT_BATCH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a Hugging Face model directory (needs transformers) or a preset name "
                                   "(default: a small built-in Llama-style model)")
    p.add_argument("--data", help="a text or JSONL file (default: the Python standard library's source)")
    p.add_argument("--config", help="DeepSpeed JSON config (default: a built-in one, NVMe offload)")
    p.add_argument("--lora", type=_non_negative, default=0, help="LoRA rank on the attention and MLP projections "
                                                                 "(0: train every weight)")
    p.add_argument("--steps", type=_positive, default=200)
    p.add_argument("--batch", type=_positive, help=f"sequences per step for the built-in config (default {DEFAULT_BATCH})")
    p.add_argument("--seq-len", type=_positive, default=128)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="keep only each layer's input for backward and recompute the rest (long sequences); "
                        "the built-in config with NVMe offload writes those inputs under --nvme-path too")
    p.add_argument("--lr", type=_positive_float, help="for the built-in config: default 3e-3, or 1e-4 for a "
                   "pretrained model")
    p.add_argument("--save", help="checkpoint directory: every --save-every steps, on SIGTERM, and at the end")
    p.add_argument("--save-every", type=_positive, default=50)
    p.add_argument("--save-total-limit", type=_positive, help="keep only the newest N checkpoints under --save "
                   "(the config's checkpoint.save_total_limit; default: all)")
    p.add_argument("--resume", help="a checkpoint directory to continue from (its `latest` tag)")
    p.add_argument("--export", help="write the fine-tuned model here (Hugging Face layout)")
    p.add_argument("--plot", help="draw the loss and per-step I/O into this image (needs matplotlib)")
    p.add_argument("--metrics", help="write each step's loss, seconds and NVMe bytes here (JSON)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(), action=_Given,
                   help="directory for the offload files of the built-in config (with --config, "
                        "set nvme_path in its JSON)")
    p.add_argument("--offload", choices=["cpu", "nvme"], help="tier for the built-in config (default nvme)")
    p.add_argument("--moment-format", choices=["fp32", "bf16", "8bit"],
                   help="the optimizer's moments in the built-in config (optimizer.params.moment_format; "
                        "default fp32): bf16 and 8bit move fewer bytes and round the moments")
    p.add_argument("--trace", help="write a timeline of steps 2-4 here (Chrome trace JSON; the config's `trace` section)")
    p.add_argument("--sample-tokens", type=_non_negative, default=48)
    p.add_argument("--seed", type=_seed, default=0)
    p.set_defaults(nvme_path_given=False)


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given: a default that is a real directory
    cannot tell `--nvme-path /tmp` from no flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _integer(text: str, low: int, high: int | None, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1, None, "a positive integer")


def _seed(text: str) -> int:
    return _integer(text, -2**63, 2**64 - 1, "an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative(text: str) -> int:
    return _integer(text, 0, None, "a non-negative integer")


def check_arguments(args) -> None:
    """What can be checked before anything is read or built: the flags only the built-in config
    reads, where the results go, what to resume from. Raises ValueError or OSError naming the flag."""
    from infinity.checkpoint.layout import LATEST

    if args.config and getattr(args, "moment_format", None):
        raise ValueError("--moment-format: only sets the built-in config; with --config, set "
                         "optimizer.params.moment_format in its JSON")
    if args.config and args.nvme_path_given:
        raise ValueError("--nvme-path: only sets the built-in config; with --config, set "
                         "zero_optimization.offload_param.nvme_path and offload_optimizer.nvme_path in its JSON")
    for flag, path, directory in (("--save", args.save, True), ("--export", args.export, True),
                                  ("--trace", args.trace, False), ("--plot", args.plot, False),
                                  ("--metrics", getattr(args, "metrics", None), False)):
        if path is not None:
            _check_destination(flag, path, directory)
    if args.resume is not None:
        if not os.path.isdir(args.resume):
            raise ValueError(f"--resume {args.resume}: not a directory")
        if not os.path.isfile(os.path.join(args.resume, LATEST)):
            raise ValueError(f"--resume {args.resume}: no checkpoint in it (no '{LATEST}' file): "
                             "give the directory --save wrote")


def _check_destination(flag: str, path: str, directory: bool) -> None:
    """Fails now where writing `path` (a directory or a file) after the last step would: it exists
    as the other kind, or nothing can be created where it goes. Creates nothing."""
    if os.path.exists(path) and os.path.isdir(path) != directory:
        raise ValueError(f"{flag} {path}: " + ("exists and is not a directory" if directory
                                               else "is a directory; give a file's name"))
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise OSError(f"{flag} {path}: cannot create files in {parent} ({e.strerror})") from None
