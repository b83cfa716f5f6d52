"""Weights out of the engine in Hugging Face's layout (safetensors, sharded above a size with
`model.safetensors.index.json`, names as in the module's state_dict, tied weights once).

`consolidate` works from a checkpoint directory alone (no model code, no GPU): it reads the
fp32 masters (and the frozen parameters' values), never the moments, one unit at a time, and
streams each parameter into the file the moment its unit has been read, so host memory holds
about one unit. `save_16bit_model` does the same from a live engine with the parameters as the
model computes with them, gathering one unit at a time on every rank and writing on rank 0.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from infinity.checkpoint.layout import BUFFERS, HF_CONFIG, MANIFEST, Manifest
from infinity.checkpoint.load import ExtentCache, _read_small, param_run, resolve
from infinity.checkpoint.safetensors_io import (
    ShardedWriter,
    check_filename,
    load_file,
    read_header,
)
from infinity.checkpoint.save import PROGRESS_BYTES, agree, persistent_buffers
from infinity.io import AsyncIOHandle

if TYPE_CHECKING:
    from infinity.engine import Engine

DEFAULT_SHARD_BYTES = 5 * 10 ** 9  # Hugging Face's save_pretrained default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    for suffix, scale in (("GIB", 2 ** 30), ("MIB", 2 ** 20), ("KIB", 2 ** 10), ("GB", 10 ** 9), ("MB", 10 ** 6),
                          ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(suffix):
            s, unit = s[:-len(suffix)], scale
            break
    else:
        unit = 1
    try:
        value = int(float(s) * unit)
    except ValueError:
        raise ValueError(f"max_shard_size: expected a size such as '5GB' or a number of bytes, got {text!r}") from None
    if value < 1:
        raise ValueError(f"max_shard_size: expected a positive size, got {text!r}")
    return value


def consolidate(checkpoint: str, out_dir: str, *, dtype: torch.dtype = torch.float32, tag: str | None = None,
                max_shard_size: str | int = DEFAULT_SHARD_BYTES, filename: str = "model.safetensors") -> list[str]:
    """Writes the checkpoint's weights to `out_dir`; returns the files written. `checkpoint` is a
    tag directory, or a save directory whose `latest` (or `tag`) names one."""
    path = os.fspath(checkpoint)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        path = resolve(path, tag)
        if path is None:
            raise FileNotFoundError(f"{checkpoint}: neither a checkpoint (no {MANIFEST}) nor a directory with a "
                                    "'latest' file; give the tag's directory")
    manifest = Manifest.read(path)
    buffers_path = _read_small(manifest, BUFFERS) if BUFFERS in manifest.files else None
    buffer_header = read_header(buffers_path)[0] if buffers_path else {}
    entries = [(p["name"], dtype, p["shape"]) for u in manifest.units for p in u["params"]]
    buffers = load_file(buffers_path) if buffer_header else {}
    entries += [(n, b.dtype, list(b.shape)) for n, b in buffers.items()]
    writer = ShardedWriter(out_dir, filename, entries, parse_size(max_shard_size))
    bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="consolidate", leave=False,
               disable=writer.total_bytes < PROGRESS_BYTES)
    cache = ExtentCache(manifest, AsyncIOHandle(block_size=1 << 20, queue_depth=8))
    try:
        for u in manifest.units:
            for p in u["params"]:
                place = manifest.places[p["name"]]
                values = param_run(cache, place, "master", 0, place.numel)  # a frozen one's: its frozen values
                writer.add(place.name, values.reshape(place.shape).to(dtype))
                bar.update(place.numel * dtype.itemsize)
            cache.clear()
        for n, b in buffers.items():
            writer.add(n, b)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    written = list(writer.files)
    if HF_CONFIG in manifest.files:
        shutil.copyfile(_read_small(manifest, HF_CONFIG), os.path.join(out_dir, HF_CONFIG))
        written.append(os.path.join(out_dir, HF_CONFIG))
    return written


def write_model_config(module, directory: str) -> None:
    """config.json for `from_pretrained`: a Hugging Face model's own, or what `save_config` of
    infinity.models.llama.Llama writes; nothing for other models."""
    hf_config = getattr(module, "config", None)
    if hasattr(module, "save_config"):
        module.save_config(directory)
    elif hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(os.path.join(directory, HF_CONFIG))


def save_16bit_model(engine: "Engine", save_dir: str, save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False,
                     max_shard_size: str | int = DEFAULT_SHARD_BYTES) -> bool:
    """The model's weights in its compute dtype, from every rank's shards; all ranks call it,
    rank 0 writes. A Hugging Face model's config.json goes beside them unless one is there."""
    error = None
    try:
        engine.check_step_boundary("save_16bit_model")
        check_filename(save_filename)
        max_bytes = parse_size(max_shard_size)
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    agree(error, "save_16bit_model")
    save_dir = os.fspath(save_dir)
    slots = [(u, s) for u in engine.units for s in u.slots if not (exclude_frozen_parameters and s.group < 0)]
    buffers = persistent_buffers(engine.module)
    entries = [(s.name, u.dtype, list(s.shape)) for u, s in slots]
    entries += [(n, b.dtype, list(b.shape)) for n, b in buffers.items()]
    wanted = {id(s) for _, s in slots}
    writer = bar = None
    try:
        if engine.rank == 0:
            writer = ShardedWriter(save_dir, save_filename, entries, max_bytes)
            bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="save_16bit_model", leave=False,
                       disable=writer.total_bytes < PROGRESS_BYTES)
    except Exception as e:  # noqa: BLE001
        error = e
    for u in engine.units:  # every rank takes part in every gather, even after rank 0 failed to write
        if not any(id(s) in wanted for s in u.slots):
            continue
        full = engine.full_compute_values(u)
        if writer is not None and error is None:
            try:
                for s in u.slots:
                    if id(s) in wanted:
                        writer.add(s.name, u.param_values(full, s))
                        bar.update(s.numel * u.dtype.itemsize)
            except Exception as e:  # noqa: BLE001
                error = e
    if writer is not None and error is None:
        try:
            for n, b in buffers.items():
                writer.add(n, b)
            writer.close()
            if not os.path.exists(os.path.join(save_dir, HF_CONFIG)):
                write_model_config(engine.module, save_dir)
        except Exception as e:  # noqa: BLE001
            error = e
    if writer is not None and error is not None:
        writer.abort()
    if bar is not None:
        bar.close()
    agree(error, "save_16bit_model (writing on rank 0)")
    return True
