"""Where both strategies' checkpoints live: the tag they save under, the directory and tag of a
checkpoint Lightning was given, and `convert_zero_checkpoint_to_fp32_state_dict` for a
single-file one ([Note: Lightning checkpoints in infinity's format] in trainer.py)."""

from __future__ import annotations

import os
from typing import Any

from infinity.checkpoint.layout import LATEST, MANIFEST
from infinity.integrations.lightning.single_file import convert_checkpoint

_TAG = "checkpoint"  # the tag DeepSpeed's strategy saves under, in the directory Lightning names


def _is_checkpoint_dir(path: Any) -> bool:
    """Whether `path` is the directory a strategy saved a checkpoint into: it holds `latest` or
    the tag directory (the test DeepSpeedStrategy makes, which names the tag directory)."""
    path = os.fspath(path)
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, LATEST))
                                    or os.path.isdir(os.path.join(path, _TAG)))


def _checkpoint_tag(path: Any) -> str | None:
    """The tag to load from a checkpoint directory: `latest`'s (None) when there is no tag
    directory of the strategies' name beside it."""
    path = os.fspath(path)
    if not os.path.isdir(os.path.join(path, _TAG)) and os.path.isfile(os.path.join(path, LATEST)):
        return None
    return _TAG


def _checkpoint_above(path: Any) -> str | None:
    """The checkpoint directory `path` lies in (one or two levels down), if any."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    for above in (parent, os.path.dirname(parent)):
        if _is_checkpoint_dir(above):
            return above
    return None


def _not_a_checkpoint(path: Any) -> FileNotFoundError:
    """The error for a path that holds no checkpoint, naming the directory above it that does when
    one does (a tag directory or a file inside one given instead of the checkpoint's directory)."""
    path = os.fspath(path)
    message = (f"{path}: The provided path is not a valid DeepSpeed checkpoint (an infinity checkpoint is the "
               f"directory the strategy saved into, holding {LATEST!r})")
    above = _checkpoint_above(path)
    if above is not None:
        return FileNotFoundError(f"{message}. Try to load using this parent directory instead: {above}")
    if os.path.isfile(path):
        message += "; a single-file checkpoint loads with InfinityStrategy(load_full_weights=True)"
    return FileNotFoundError(message)


def _checkpoint_location(path: Any) -> tuple[str, str | None]:
    """(directory, tag) of a checkpoint Lightning was given: the directory a strategy saved into,
    or one tag directory of it (holding the manifest)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    if not _is_checkpoint_dir(path):
        raise _not_a_checkpoint(path)
    return path, _checkpoint_tag(path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_file: Any,
                                               tag: str | None = None) -> dict[str, Any]:
    """A checkpoint `InfinityStrategy` saved (the directory Lightning named, holding `latest`) as
    one Lightning `.ckpt`: fp32 `state_dict` plus Lightning's keys, which
    `LightningModule.load_from_checkpoint` and `Trainer(ckpt_path=...)` for validate / test /
    predict read (no optimizer state: resume training from the directory), written one unit in
    memory at a time ([Note: a torch.save file one unit at a time] in single_file.py). Returns
    the keys written besides `state_dict`."""
    return convert_checkpoint(checkpoint_dir, output_file, tag)

