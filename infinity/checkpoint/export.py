"""Weights out of the engine in Hugging Face's layout (safetensors, sharded above a size with
`model.safetensors.index.json`, names as in the module's state_dict, tied weights once).

`consolidate` works from a checkpoint directory alone (no model code, no GPU): it reads the
fp32 masters (and the frozen parameters' values), never the moments, one unit at a time, and
streams each parameter into the file the moment its unit has been read, so host memory holds
about one unit. `save_16bit_model` does the same from a live engine with the parameters as the
model computes with them, gathering one unit at a time on every rank and writing on rank 0.
Neither changes anything in the directory until every file is written ([Note: publishing an
export] in checkpoint/publish.py).

[Note: tiles in an export]
A tiled weight ([Note: memory-centric tiling] in infinity/zero/tiling.py) is stored as tiles,
each a parameter of its own (`M.tiles.3.weight`); an export is read by from_pretrained and by
the user's own model, so it names the weight as the user's module did (`M.weight`, a tied one
once). The tiles are row blocks, written one after the other: the file declares the weight
whole, and the tiles' rows are streamed into it in order, so host memory still holds one
unit. A checkpoint's manifest lists each tiled weight's tiles (`tiles`), which is how
`consolidate`, without the model, knows them.

[Note: LoRA adapters in a checkpoint]
A checkpoint of `infinity finetune --lora` (infinity.apps.finetune.LoRALinear) holds each adapted
projection as `M.base_layer.weight` (frozen; `M.weight` before the projection could be tiled),
perhaps in tiles, beside `M.lora_A` [r, in] and `M.lora_B` [out, r], and the module adds
B @ A * scale to what the projection gives. A model directory has no place for the
adapters (from_pretrained drops them without a word), so `consolidate` writes `M.weight` +
B @ A * scale instead. The scale (alpha / r) is the module's `lora_scale` buffer, saved with the
checkpoint's buffers; for adapters saved without it the caller gives it (`lora_scale`), and
without either consolidate refuses rather than write the base model under the fine-tuned one's
name.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable

import torch
from tqdm import tqdm

from infinity.checkpoint.layout import BUFFERS, HF_CONFIG, Manifest
from infinity.checkpoint.files import write_atomic
from infinity.checkpoint.load import ExtentCache, checked_path, param_run, tag_directory
from infinity.checkpoint.protocol import Checkpointable
from infinity.checkpoint.safetensors_io import (
    ShardedWriter,
    check_filename,
    check_out_dir,
    load_file,
    read_header,
)
from infinity.checkpoint.save import PROGRESS_BYTES, agree, persistent_buffers
from infinity.io import AsyncIOHandle
from infinity.zero.tiling import tiled_weights
from infinity.zero.unit import Unit

Entry = tuple[str, torch.dtype, list[int]]

DEFAULT_SHARD_BYTES = 5 * 10 ** 9  # Hugging Face's save_pretrained default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LORA = re.compile(r"(.+)\.lora_([AB])")  # [Note: LoRA adapters in a checkpoint]


def untiled_entries(entries: list[Entry], tiles: dict[str, list[str]]) -> tuple[list[Entry], dict[str, str]]:
    """[Note: tiles in an export] `entries` (in the order they are written) with the tiles of
    each tiled weight declared as that weight, and tile name -> weight name for the writes. A
    weight whose tiles are not all there, one after the other, keeps its tiles' names."""
    at = {e[0]: i for i, e in enumerate(entries)}
    tile_of: dict[str, str] = {}
    for weight, names in tiles.items():
        places = [at.get(n, -1) for n in names]
        if places == list(range(places[0], places[0] + len(names))) and places[0] >= 0:
            tile_of.update((n, weight) for n in names)
    out = []
    for name, dtype, shape in entries:
        weight = tile_of.get(name)
        if weight is None:
            out.append((name, dtype, shape))
        elif name == tiles[weight][0]:
            out.append((weight, dtype, [sum(entries[at[n]][2][0] for n in tiles[weight]), *shape[1:]]))
    return out, tile_of


def base_layer_names(names: Iterable[str], owners: Iterable[str]) -> dict[str, str]:
    """`M.base_layer.X` -> `M.X` among `names`, for each LoRA module `M` of `owners`: the merged
    weight (and bias) under the projection's own names ([Note: LoRA adapters in a checkpoint])."""
    prefixes = tuple(f"{m}.base_layer." for m in owners)
    return {n: n.replace(".base_layer.", ".", 1) for n in names if n.startswith(prefixes)}


class RowMerger:
    """Adds B @ A * scale to an adapted weight's rows as they stream past, the weight whole or
    its tiles in order ([Note: tiles in an export])."""

    def __init__(self) -> None:
        self._rows: dict[str, int] = {}  # weight name -> rows merged so far

    def __call__(self, name: str, values: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 scale: float) -> torch.Tensor:
        first = self._rows.get(name, 0)
        self._rows[name] = first + values.shape[0]
        return values.float() + b[first:first + values.shape[0]] @ a * scale


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
                max_shard_size: str | int = DEFAULT_SHARD_BYTES, filename: str = "model.safetensors",
                lora_scale: float | None = None) -> list[str]:
    """Writes the checkpoint's weights to `out_dir`; returns the files written. `checkpoint` is a
    tag directory, or a save directory whose `latest` (or `tag`) names one. LoRA adapters are
    merged into their weights with `lora_scale` ([Note: LoRA adapters in a checkpoint])."""
    path = tag_directory(checkpoint, tag, "checkpoint")
    out_dir = os.fspath(out_dir)
    check_out_dir(out_dir, "out_dir")
    for inside in (os.fspath(checkpoint), path):
        if os.path.commonpath([os.path.realpath(inside), os.path.realpath(out_dir)]) == os.path.realpath(inside):
            raise ValueError(f"out_dir {out_dir}: inside the checkpoint directory {inside}; give a directory "
                             "outside it")
    manifest = Manifest.read(path)
    manifest.check_whole("consolidate")
    buffers_path = checked_path(manifest, BUFFERS) if BUFFERS in manifest.files else None
    buffer_header = read_header(buffers_path)[0] if buffers_path else {}
    buffers = load_file(buffers_path) if buffer_header else {}
    saved_scales = {n.removesuffix(".lora_scale"): float(b) for n, b in buffers.items() if n.endswith(".lora_scale")}
    buffers = {n: b for n, b in buffers.items() if not n.endswith(".lora_scale")}
    merges = lora_merges(manifest, lora_scale, saved_scales)
    adapters = {n for a, b, _ in merges.values() for n in (a, b)}
    entries = [(p["name"], dtype, p["shape"]) for u in manifest.units for p in u["params"] if p["name"] not in adapters]
    entries, tile_of = untiled_entries(entries, manifest.tiles)
    out_name = base_layer_names([n for n, _, _ in entries], [w.removesuffix(".base_layer.weight") for w in merges])
    entries = [(out_name.get(n, n), dtype_, shape) for n, dtype_, shape in entries]
    entries += [(n, b.dtype, list(b.shape)) for n, b in buffers.items()]
    config = None
    if HF_CONFIG in manifest.files:
        with open(checked_path(manifest, HF_CONFIG), "rb") as f:
            config = f.read()
    writer = ShardedWriter(out_dir, filename, entries, parse_size(max_shard_size), what="out_dir")
    bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="consolidate", leave=False,
               disable=writer.total_bytes < PROGRESS_BYTES)
    cache = ExtentCache(manifest, AsyncIOHandle(block_size=1 << 20, queue_depth=8))
    try:
        if config is not None:
            writer.add_file(HF_CONFIG, config)
        merge = RowMerger()
        for u in manifest.units:
            for p in u["params"]:
                if p["name"] in adapters:
                    continue
                values = _read_param(cache, manifest, p["name"])  # a frozen one's: its frozen values
                name = tile_of.get(p["name"], p["name"])
                if name in merges:
                    a_name, b_name, scale = merges[name]
                    a, b = (_read_param(cache, manifest, n).float() for n in (a_name, b_name))
                    values = merge(name, values, a, b, scale)
                writer.add(out_name.get(name, name), values.to(dtype))
                bar.update(values.numel() * dtype.itemsize)
            cache.clear()
        for n, b in buffers.items():
            writer.add(n, b)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return list(writer.files) + ([os.path.join(out_dir, HF_CONFIG)] if config is not None else [])


def _read_param(cache: ExtentCache, manifest: Manifest, name: str) -> torch.Tensor:
    place = manifest.places[name]
    return param_run(cache, place, "master", 0, place.numel).reshape(place.shape)


def _weight_shape(manifest: Manifest, name: str) -> list[int] | None:
    """A parameter's shape in the checkpoint, a tiled one's whole ([Note: tiles in an export])."""
    if name in manifest.places:
        return list(manifest.places[name].shape)
    tiles = manifest.tiles.get(name, [])
    if not tiles or not all(t in manifest.places for t in tiles):
        return None
    shapes = [manifest.places[t].shape for t in tiles]
    return [sum(s[0] for s in shapes), *shapes[0][1:]]


def lora_merges(manifest: Manifest, lora_scale: float | None,
                saved_scales: dict[str, float]) -> dict[str, tuple[str, str, float]]:
    """The adapted weight (`M.base_layer.weight`, or `M.weight` in checkpoints of earlier
    versions) -> (`M.lora_A`, `M.lora_B`, scale) for each adapter of the checkpoint, the scale
    being the `M.lora_scale` buffer saved with it, else `lora_scale`; an error for adapters
    without a scale, adapters of another layout, and a scale without adapters ([Note: LoRA
    adapters in a checkpoint])."""
    if lora_scale is not None and not (isinstance(lora_scale, (int, float)) and math.isfinite(lora_scale)):
        raise ValueError(f"lora_scale: expected a finite number, got {lora_scale!r}")
    found = sorted(n for n in manifest.places if ".lora_" in f".{n}")
    merges = {}
    for name in found:
        match = LORA.fullmatch(name)
        owner = match.group(1) if match else name
        weight_name = next((w for w in (f"{owner}.base_layer.weight", f"{owner}.weight")
                            if _weight_shape(manifest, w)), f"{owner}.weight")
        shape = _weight_shape(manifest, weight_name)
        a, b = (manifest.places.get(f"{owner}.{x}") for x in ("lora_A", "lora_B"))
        if not (match and shape and a and b and len(shape) == 2
                and a.shape == [a.shape[0], shape[1]] and b.shape == [shape[0], a.shape[0]]):
            raise ValueError(f"{manifest.directory}: {name} is a LoRA tensor that consolidate cannot merge (it "
                             "merges M.lora_A [r, in] and M.lora_B [out, r] into M.weight [out, in], as `infinity "
                             "finetune --lora` saves them); merge the adapters in the model and export it with "
                             "engine.save_16bit_model")
        scale = lora_scale if lora_scale is not None else saved_scales.get(owner)
        merges[weight_name] = (a.name, b.name, scale)
    unscaled = sorted(w for w, (_, _, scale) in merges.items() if scale is None)
    if unscaled:
        raise ValueError(f"{manifest.directory}: holds LoRA adapters of {len(unscaled)} weights ({unscaled[0]}, ...) "
                         "but not their scale (alpha / r, saved as M.lora_scale by `infinity finetune --lora`), "
                         "which merging them into the weights needs; pass --lora-scale (lora_scale=)")
    if lora_scale is not None and not merges:
        raise ValueError(f"lora_scale: the checkpoint holds no LoRA adapters (no parameter named M.lora_A), got "
                         f"{lora_scale!r}")
    return merges


def model_config(module) -> bytes | None:
    """config.json for `from_pretrained`: a Hugging Face model's own, or what `save_config` of
    infinity.apps.models.llama.Llama writes; None for other models."""
    hf_config = getattr(module, "config", None)
    if hasattr(module, "save_config"):
        with tempfile.TemporaryDirectory() as tmp:
            module.save_config(tmp)
            with open(os.path.join(tmp, HF_CONFIG), "rb") as f:
                return f.read()
    if hasattr(hf_config, "to_json_string"):
        return hf_config.to_json_string().encode()
    return None


def write_model_config(module, directory: str) -> None:
    """The model's config.json (`model_config`) in `directory`, replacing one there atomically."""
    config = model_config(module)
    if config is not None:
        write_atomic(os.path.join(directory, HF_CONFIG), config)


def write_units(engine: Checkpointable, wanted: set[int], full_values: Callable[[Unit], torch.Tensor],
                add: Callable[[str, torch.Tensor], None] | None) -> Exception | None:
    """Hands each parameter whose slot is `wanted` (ids of slots) to `add` (rank 0's writer; None
    on the others) as `full_values` gives its unit, one unit in memory at a time. Every rank takes
    part in every unit's gather, even after `add` failed: returns that failure, which stops the
    writing but not the gathers."""
    error = None
    for u in engine.units:
        if not any(id(s) in wanted for s in u.slots):
            continue
        full = full_values(u)
        if add is None or error is not None:
            continue
        try:
            for s in u.slots:
                if id(s) in wanted:
                    add(s.name, u.param_values(full, s))
        except Exception as e:  # noqa: BLE001 (the caller's agree() raises it on every rank)
            error = e
    return error


def save_16bit_model(engine: Checkpointable, save_dir: str, save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False,
                     max_shard_size: str | int = DEFAULT_SHARD_BYTES) -> bool:
    """The model's weights in its compute dtype, from every rank's shards; all ranks call it,
    rank 0 writes. A Hugging Face model's config.json goes beside them, replacing one there."""
    error = None
    try:
        if engine.model_parallel is not None:  # [Note: model-parallel checkpoints] in checkpoint/model_parallel.py
            raise ValueError("save_16bit_model: under model parallelism (mpu) each rank holds a slice of the model, "
                             "and infinity does not know how the slices join; save_checkpoint writes each slice, "
                             "and engine.consolidated_state_dict() gives this rank's slice whole")
        engine.check_step_boundary("save_16bit_model")
        check_filename(save_filename)
        max_bytes = parse_size(max_shard_size)
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    agree(error, "save_16bit_model")
    save_dir = os.fspath(save_dir)
    slots = [(u, s) for u in engine.units for s in u.slots if not (exclude_frozen_parameters and s.group < 0)]
    buffers = persistent_buffers(engine.module)
    entries, tile_of = untiled_entries([(s.name, u.dtype, list(s.shape)) for u, s in slots],
                                       tiled_weights(engine.module))
    entries += [(n, b.dtype, list(b.shape)) for n, b in buffers.items()]
    wanted = {id(s) for _, s in slots}
    writer = bar = None

    def add(name: str, values: torch.Tensor) -> None:
        writer.add(tile_of.get(name, name), values)
        bar.update(values.numel() * values.element_size())

    try:
        if engine.rank == 0:
            writer = ShardedWriter(save_dir, save_filename, entries, max_bytes, what="save_dir")
            bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="save_16bit_model", leave=False,
                       disable=writer.total_bytes < PROGRESS_BYTES)
            config = model_config(engine.module)
            if config is not None:
                writer.add_file(HF_CONFIG, config)
    except Exception as e:  # noqa: BLE001
        error = e
    try:
        failed = write_units(engine, wanted, engine.full_compute_values,
                             add if writer is not None and error is None else None)
        error = error or failed
        if writer is not None and error is None:
            try:
                for n, b in buffers.items():
                    writer.add(n, b)
                writer.close()
            except Exception as e:  # noqa: BLE001
                error = e
    finally:
        if writer is not None:
            writer.abort()  # what was not published: nothing after a close
        if bar is not None:
            bar.close()
    agree(error, "save_16bit_model (writing on rank 0)")
    return True
