"""`infinity.load_pretrained(engine, path)`: pretrained weights streamed from safetensors (one
file, or a Hugging Face directory with `model.safetensors.index.json`) straight into the
partitions, one unit at a time: each unit's tensors are read from their files (only those
bytes), converted to fp32, and become the unit's fp32 masters and compute-dtype shard on every
rank; host memory holds about one unit. Nothing is executed to read them.
"""

from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

from infinity.checkpoint.layout import CheckpointError
from infinity.checkpoint.load import listing as _listing
from infinity.checkpoint.protocol import Checkpointable
from infinity.checkpoint.safetensors_io import _DTYPES, INDEX_SUFFIX, read_header
from infinity.checkpoint.save import PROGRESS_BYTES, agree, persistent_buffers
from infinity.zero.tiling import tile_names

WEIGHTS = "model.safetensors"


class TensorIndex:
    """Where each tensor of a safetensors checkpoint is: file, dtype, shape, byte range."""

    def __init__(self, path: str):
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, WEIGHTS + INDEX_SUFFIX)
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            elif os.path.isfile(os.path.join(path, WEIGHTS)):
                files = [WEIGHTS]
            else:
                raise FileNotFoundError(f"path: {path} holds neither {WEIGHTS} nor {WEIGHTS + INDEX_SUFFIX} (only "
                                        "safetensors checkpoints are read: they load without executing code)")
            paths = [os.path.join(path, f) for f in files]
        elif os.path.isfile(path):
            paths = [path]
        else:
            raise FileNotFoundError(f"path: no file or directory {path}")
        self.where: dict[str, tuple[str, int, dict]] = {}
        for p in paths:
            header, start = read_header(p)
            for name, info in header.items():
                self.where[name] = (p, start, info)

    def shape(self, name: str) -> list[int]:
        return self.where[name][2]["shape"]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only `rows` (first, count) of it: a tile's rows are one byte range."""
        path, start, info = self.where[name]
        lo, hi = info["data_offsets"]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: {name} has dtype {info['dtype']}, which infinity cannot load")
        shape = list(info["shape"])
        if rows is not None:
            row_bytes = (hi - lo) // shape[0]
            lo, hi, shape[0] = lo + rows[0] * row_bytes, lo + (rows[0] + rows[1]) * row_bytes, rows[1]
        out = torch.empty(hi - lo, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.seek(start + lo)
            if f.readinto(out.numpy()) != hi - lo:
                raise CheckpointError(f"{path}: {name} runs past the end of the file (truncated?)")
        return out.view(dtype).reshape(shape)


def load_pretrained(engine: Checkpointable, path: str, *, strict: bool = True, missing_ok=None) -> None:
    """Loads a safetensors checkpoint (file or Hugging Face directory) into `engine`'s partitions;
    every rank calls it. A missing or unexpected tensor, or a shape that differs, is an error
    naming it (`strict=False`: missing ones keep their values, unexpected ones are ignored;
    `missing_ok(name)`: those parameters may be missing, such as adapters added for fine-tuning)."""
    error = index = None
    try:
        engine.check_step_boundary("load_pretrained")
        index = TensorIndex(path)
        plan = _plan(engine, index, strict, missing_ok or (lambda name: False))
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    agree(error, "load_pretrained")
    total = sum(u.numel for u, _ in plan) * 4
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="load_pretrained", leave=False,
               disable=engine.rank != 0 or total < PROGRESS_BYTES)
    try:
        for unit, sources in plan:
            full = engine.full_fp32_values(unit) if len(sources) < len(unit.slots) else \
                torch.zeros(unit.padded_numel, dtype=torch.float32)
            for slot, name, rows in sources:
                values = index.read(name, rows)
                full[slot.offset:slot.offset + slot.numel].copy_(values.reshape(-1))
                bar.update(slot.numel * 4)
            engine.set_fp32_values(unit, full)
            del full
        buffers = persistent_buffers(engine.module)
        for name, buf in buffers.items():
            source = _buffer_source(name, index)
            if source is not None:
                buf.copy_(index.read(source))
    finally:
        bar.close()
    engine.after_load()


def _buffer_source(name: str, index: TensorIndex) -> str | None:
    return next((n for n in (name, _base_name(name)) if n in index.where), None)


def _base_name(name: str) -> str:
    """The name a peft model's base tensor has in the base model's checkpoint: peft wraps the
    model (`base_model.model.`) and each adapted layer (`.base_layer.`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _plan(engine: Checkpointable, index: TensorIndex, strict: bool, missing_ok) -> list:
    """For each unit, its slots and the checkpoint name each is read from (with the rows, for a
    tile of a tiled weight: the checkpoint holds the user's weight whole); checks names and shapes."""
    names_of: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tile_of: dict[str, tuple[list[str], int, int]] = {}  # tile -> its weight's names, first row, the weight's rows
    for weight, parts in tile_names(engine.module).items():
        for tile, first, _ in parts:
            tile_of.setdefault(tile, ([], first, sum(rows for _, _, rows in parts)))[0].append(weight)
    known = {n for ns in names_of.values() for n in ns} | {w for ws, _, _ in tile_of.values() for w in ws}
    known |= {n for n, _ in engine.module.named_buffers(remove_duplicate=False)}
    known |= {_base_name(n) for n in known}
    plan, missing, shapes = [], [], []
    for u in engine.units:
        sources = []
        for s in u.slots:
            tile = tile_of.get(s.name)
            names = tile[0] if tile else [s.name, *names_of.get(id(s.param), [])]
            found = next((n for n in [*names, *map(_base_name, names)] if n in index.where), None)
            if found is None:
                if not missing_ok(s.name):
                    missing.append(names[0])
                continue
            shape = [tile[2], *s.shape[1:]] if tile else list(s.shape)
            if list(index.shape(found)) != shape:
                shapes.append(f"{found} (checkpoint {index.shape(found)}, model {shape})")
                continue
            sources.append((s, found, (tile[1], s.shape[0]) if tile else None))
        plan.append((u, sources))
    for name, buf in persistent_buffers(engine.module).items():
        name = _buffer_source(name, index)
        if name is not None and list(index.shape(name)) != list(buf.shape):
            shapes.append(f"{name} (checkpoint {index.shape(name)}, model {list(buf.shape)})")
    # Values the model computes itself (non-persistent buffers: rotary inv_freq, which Llama
    # checkpoints of transformers < 4.31 hold under each layer's name) are skipped, as
    # from_pretrained skips them.
    persistent = persistent_buffers(engine.module)
    computed = {n.rsplit(".", 1)[-1] for n, _ in engine.module.named_buffers() if n not in persistent}
    unexpected = [n for n in index.where if n not in known and n.rsplit(".", 1)[-1] not in computed]
    problems = []
    if shapes:
        problems.append(f"shape mismatch: {_listing(shapes)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    if problems:
        raise CheckpointError("load_pretrained: the checkpoint does not fit this model: " + "; ".join(problems))
    return plan
