"""Where both strategies' checkpoints live: the tag they save under, the directory and tag of a
checkpoint Lightning was given, and `convert_zero_checkpoint_to_fp32_state_dict` for a
single-file one ([Note: Lightning checkpoints in infinity's format] in trainer.py)."""

from __future__ import annotations

import os
from typing import Any

from infinity.checkpoint.layout import LATEST, MANIFEST
from infinity.integrations.lightning.single_file import convert_checkpoint

_TAG = "checkpoint"  # the tag DeepSpeed's strategy saves under, in the directory Lightning names


def _checkpoint_location(path: str) -> tuple[str, str | None]:
    """(directory with `latest`, tag) of a checkpoint Lightning was given."""
    path = os.fspath(path)
    if os.path.isfile(path):
        raise ValueError(f"{path}: a single-file checkpoint; load it with InfinityStrategy(load_full_weights=True) "
                         "(an infinity checkpoint is a directory holding 'latest')")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    if not os.path.isfile(os.path.join(path, LATEST)):
        raise FileNotFoundError(f"{path}: not an infinity checkpoint (no {LATEST!r} file, no {MANIFEST})")
    return path, None


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_file: Any,
                                               tag: str | None = None) -> dict[str, Any]:
    """A checkpoint `InfinityStrategy` saved (the directory Lightning named, holding `latest`) as
    one Lightning `.ckpt`: fp32 `state_dict` plus Lightning's keys, which
    `LightningModule.load_from_checkpoint` and `Trainer(ckpt_path=...)` for validate / test /
    predict read (no optimizer state: resume training from the directory), written one unit in
    memory at a time ([Note: a torch.save file one unit at a time] in single_file.py). Returns
    the keys written besides `state_dict`."""
    return convert_checkpoint(checkpoint_dir, output_file, tag)

