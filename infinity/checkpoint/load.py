"""`engine.load_checkpoint`: each rank fills its own shards from the checkpoint's extents, found
by parameter name, so another world size, offload placement or unit plan loads the same
values ([Note: re-sharding]), and another cut of a tiled weight too ([Note: a weight tiled
otherwise]); every extent read is checked against its CRC first.

[Note: re-sharding]
A parameter's place in a checkpoint is (unit, region, offset in the region); rank q's extent of
that region holds its elements [q*S, (q+1)*S) for the checkpoint's per-rank length S. A rank
loading its shard walks the parameters of each of its units that overlap the shard and copies
each overlapping run from the extents that hold it, reading every extent whole once (so its CRC
can be checked) and keeping it only while that kind of that unit is being filled. With the same
world size and units this is one extent per kind per unit: the rank's own bytes, read once.

[Note: a weight tiled otherwise]
A tiled weight's tiles are parameters of their own, and how a weight is cut follows the config:
`tile_size`, and for a tied weight the optimizer pool ([Note: a tied weight's tiles] in
infinity/offload/optimizer/sizing.py), so a job resumed with another budget cuts it otherwise.
The manifest lists each tiled weight's tiles in row order (`tiles`): where this model's tiles
of a weight are not the checkpoint's, each is read from the checkpoint's tiles of that weight by
its elements' place in the weight (`retiled`), as long as the weight has the same elements and
row width; otherwise `check_model` names the tiles.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from infinity.checkpoint import files
from infinity.checkpoint.layout import (
    BUFFERS,
    FROZEN,
    LATEST,
    MANIFEST,
    OPTIM_KINDS,
    CheckpointError,
    Manifest,
    ParamPlace,
    round_up,
    state_file,
)
from infinity.checkpoint.model_parallel import check_slice, slice_path
from infinity.checkpoint.protocol import Checkpointable, TrainingState
from infinity.checkpoint.safetensors_io import load_file
from infinity.checkpoint.save import (
    PROGRESS_BYTES,
    agree,
    check_tag,
    persistent_buffers,
    read_latest,
)
from infinity.io import AsyncIOHandle
from infinity.offload.nvme_io import make_handle
from infinity.zero.tiling import tiled_weights

log = logging.getLogger("infinity")


def resolve(load_dir: str, tag: Any = None) -> str | None:
    """The checkpoint directory of `tag` (or of the tag `latest` names); None when there is no
    `latest` and no tag was given."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
        try:
            check_tag(tag)
        except ValueError:
            raise ValueError(f"{os.path.join(load_dir, LATEST)}: holds {tag!r}, not the name of a checkpoint "
                             f"directory in {load_dir} (it is written by save_checkpoint); give the tag to load, "
                             "or write the tag's name there") from None
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    replaced = os.path.join(load_dir, f".{tag}.replaced")
    if not os.path.isdir(path) and os.path.isdir(replaced):
        log.warning("load_checkpoint: %s is missing, a save under the same tag died while replacing it; "
                    "loading the previous one from %s", path, replaced)
        return replaced
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint {path} (tag {tag!r})")
    return path


def tag_directory(path: str | os.PathLike, tag: Any, what: str) -> str:
    """`path` if it is a checkpoint (holds a manifest), else the tag directory of `path` that
    `tag` (or `latest`) names; `what` names the argument in the error."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = resolve(path, tag)
    if found is None:
        raise FileNotFoundError(f"{what} {path}: neither an infinity checkpoint (no {MANIFEST}) nor a directory with "
                                f"a {LATEST!r} file (what save_checkpoint writes); give a tag's directory")
    return found


class ExtentCache:
    """Extents of one checkpoint, read whole and checked once, typed."""

    def __init__(self, manifest: Manifest, handle: AsyncIOHandle, on_read=None):
        self.manifest, self.handle = manifest, handle
        self._extents: dict[tuple[str, int, int], torch.Tensor] = {}
        self._on_read = on_read
        self.retiled: dict[str, tuple[int, list[tuple[ParamPlace, int]]]] = {}  # [Note: a weight tiled otherwise]

    def get(self, kind: str, rank: int, unit: int) -> torch.Tensor:
        key = (kind, rank, unit)
        if key not in self._extents and kind in OPTIM_KINDS and kind not in self.manifest.optim_kinds:
            # a moment the saving optimizer did not keep (Lion's exp_avg_sq): zeros, as it would
            # have held them, for an engine whose optimizer keeps it
            self._extents[key] = torch.zeros(self.manifest.region_numel(unit, "train"), dtype=torch.float32)
        if key not in self._extents:
            m = self.manifest
            name, offset, nbytes, crc = m.extent(rank, kind, unit)
            raw = files.read_extent(self.handle, m.path(name), offset, nbytes, crc,
                                    f"the extent of unit {unit} ({m.units[unit]['name']})")
            dtype = torch.float32 if kind in OPTIM_KINDS else m.compute_dtype
            region = "train" if kind in OPTIM_KINDS else FROZEN
            self._extents[key] = raw.view(dtype)[:m.region_numel(unit, region)]
            if self._on_read is not None:
                self._on_read(nbytes)
        return self._extents[key]

    def clear(self) -> None:
        self._extents.clear()


def param_run(cache: ExtentCache, place: ParamPlace, kind: str, lo: int, hi: int) -> torch.Tensor | None:
    """Elements [lo, hi) of a parameter's flat values of `kind` ("master", "exp_avg",
    "exp_avg_sq" or "frozen") as the checkpoint stores them; a frozen parameter's masters are its
    frozen values and a trainable one's frozen values its masters; None for the moments of a
    parameter that was frozen (it has none)."""
    if place.region == FROZEN:
        if kind in ("exp_avg", "exp_avg_sq"):
            return None
        kind = FROZEN
    elif kind == FROZEN:
        kind = "master"
    per_rank = cache.manifest.region_numel(place.unit, place.region)
    if lo == hi:
        return torch.empty(0, dtype=torch.float32 if kind in OPTIM_KINDS else cache.manifest.compute_dtype)
    a, b = place.offset + lo, place.offset + hi
    runs = []
    while a < b:
        q = a // per_rank
        end = min(b, (q + 1) * per_rank)
        runs.append(cache.get(kind, q, place.unit)[a - q * per_rank:end - q * per_rank])
        a = end
    return runs[0] if len(runs) == 1 else torch.cat(runs)


def retiled(manifest: Manifest, engine: Checkpointable) -> tuple[dict[str, tuple[int, list[tuple[ParamPlace, int]]]], set[str]]:
    """[Note: a weight tiled otherwise] (this model's tile -> (its first element in its weight,
    [(a checkpoint tile of that weight, its first element in the weight)]), the checkpoint tiles
    they are read from) for each weight the checkpoint holds cut otherwise."""
    slots = {s.name: s for u in engine.units for s in u.slots}
    places = manifest.places
    out, used = {}, set()
    for weight, names in tiled_weights(engine.module).items():
        saved = manifest.tiles.get(weight)
        if not saved or any(n not in places for n in saved) or any(n not in slots for n in names):
            continue
        if saved == names and all(places[n].shape == list(slots[n].shape) for n in names):
            continue  # cut alike: read by name
        if (sum(places[n].numel for n in saved) != sum(slots[n].numel for n in names)
                or places[saved[0]].shape[1:] != list(slots[names[0]].shape[1:])):
            continue  # not the same weight: check_model names it
        sources, at = [], 0
        for n in saved:
            sources.append((places[n], at))
            at += places[n].numel
        at = 0
        for n in names:
            out[n] = (at, sources)
            at += slots[n].numel
        used.update(saved)
    return out, used


def _retiled_run(cache: ExtentCache, source: tuple[int, list[tuple[ParamPlace, int]]], kind: str,
                 lo: int, hi: int) -> torch.Tensor | None:
    """Elements [lo, hi) of a tile read from the checkpoint's tiles of its weight (`retiled`)."""
    first, tiles = source
    lo, hi = first + lo, first + hi
    parts = []
    for place, at in tiles:
        a, b = max(lo, at), min(hi, at + place.numel)
        if a < b:
            run = param_run(cache, place, kind, a - at, b - at)
            parts.append(torch.zeros(b - a, dtype=torch.float32) if run is None else run)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def fill_region(cache: ExtentCache, unit, region: str, kind: str, out: torch.Tensor) -> None:
    """Copies into `out` (this rank's shard of the unit's region) every run the checkpoint has."""
    per_rank = out.numel()
    lo_shard = unit.rank * per_rank
    train_padded = unit.train_shard_numel * unit.world
    places = cache.manifest.places
    for s in unit.slots:
        source = cache.retiled.get(s.name)
        if (s.group >= 0) != (region == "train") or (s.name not in places and source is None):
            continue
        start = s.offset if s.group >= 0 else s.offset - train_padded
        a, b = max(start, lo_shard), min(start + s.numel, lo_shard + per_rank)
        if a >= b:
            continue
        run = (param_run(cache, places[s.name], kind, a - start, b - start) if source is None
               else _retiled_run(cache, source, kind, a - start, b - start))
        target = out[a - lo_shard:b - lo_shard]
        target.zero_() if run is None else target.copy_(run)


def listing(names: list[str]) -> str:
    """Up to five names, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_model(manifest: Manifest, engine: Checkpointable, *, strict: bool, optimizer_states: bool,
                num_groups: int) -> None:
    """The checkpoint holds this model's parameters, with their shapes; errors name them."""
    moved, read_from = retiled(manifest, engine)  # [Note: a weight tiled otherwise]
    ours = {s.name: s for u in engine.units for s in u.slots if s.name not in moved}
    theirs = {n: p for n, p in manifest.places.items() if n not in read_from}
    where = manifest.directory
    problems = []
    excluded = manifest.data.get("frozen_excluded", False)  # saved with exclude_frozen_parameters
    missing = [n for n, s in ours.items() if n not in theirs and not (excluded and s.group < 0)]
    unexpected = [n for n in theirs if n not in ours and n not in moved]
    if strict and missing:
        problems.append(f"missing from the checkpoint: {listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {listing(unexpected)}")
    shapes = [f"{n} (checkpoint {theirs[n].shape}, model {list(s.shape)})" for n, s in ours.items()
              if n in theirs and theirs[n].shape != list(s.shape)]
    if shapes:
        problems.append(f"shape mismatch: {listing(shapes)}")
    if optimizer_states:
        newly = [n for n, s in ours.items() if s.group >= 0 and n in theirs and theirs[n].region == FROZEN]
        if newly:
            problems.append(f"trainable here but frozen in the checkpoint, which has no optimizer state for them: "
                            f"{listing(newly)} (load with load_optimizer_states=False to start their moments at 0)")
        groups = manifest.data.get("param_groups")
        if groups is not None and groups != num_groups:
            problems.append(f"optimizer.param_groups: the checkpoint has {groups}, this optimizer "
                            f"{num_groups} (load with load_optimizer_states=False)")
    if problems:
        raise CheckpointError(f"load_checkpoint: {where} does not fit this model: " + "; ".join(problems))


def checked_path(manifest: Manifest, name: str) -> str:
    """The path of a small file of the checkpoint, once its size and CRC match the manifest."""
    entry = manifest.files.get(name)
    path = manifest.path(name)
    if entry is None:
        raise CheckpointError(f"{manifest.path(MANIFEST)}: lists no file {name}")
    try:
        size, crc = files.crc_of_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    if (size, crc) != (entry["bytes"], entry["crc32"]):
        raise CheckpointError(f"{path}: checksum mismatch (the file is damaged); nothing was read from it")
    return path


def set_rng_states(rng: dict) -> None:
    """The process's RNG states (Python, NumPy, torch) as `save.rng_states` kept them."""
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(rng["torch"])


def _check_files(manifest: Manifest) -> None:
    """Every file the manifest lists is there with its size: found before anything changes."""
    for name, entry in manifest.files.items():
        path = manifest.path(name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry['bytes']}; the file was truncated "
                                  "or changed")


def _read_state(manifest: Manifest, rank: int) -> dict:
    path = checked_path(manifest, state_file(rank))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises several kinds)
        raise CheckpointError(f"{path}: cannot be loaded without executing code, or is damaged "
                              f"({str(e).splitlines()[0]})") from None


def load_checkpoint(engine: Checkpointable, load_dir: str, tag: Any = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict | None]:
    optimizer_states = load_optimizer_states and not load_module_only
    error = path = manifest = state = None
    buffers: dict = {}
    try:  # everything that can be checked before a value changes, on every rank
        engine.check_step_boundary("load_checkpoint",
                                   replaces_all=optimizer_states and load_module_strict and not load_module_only)
        path = resolve(load_dir, tag)
        if path is not None:
            path = slice_path(engine, path)  # [Note: model-parallel checkpoints] in checkpoint/model_parallel.py
            manifest = Manifest.read(path)
            check_slice(engine, manifest)
            check_model(manifest, engine, strict=load_module_strict, optimizer_states=optimizer_states,
                        num_groups=len(engine.training_state().optimizer["param_groups"]))
            _check_files(manifest)
            state = _read_state(manifest, engine.rank if engine.rank < manifest.world_size else 0)
            buffers = load_file(checked_path(manifest, BUFFERS)) if BUFFERS in manifest.files else {}
            _check_buffers(engine, buffers, strict=load_module_strict, where=path)
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    agree(error, "load_checkpoint", everyone=True)
    if path is None:
        log.warning("load_checkpoint: %s has no %r file and no tag was given; nothing loaded", load_dir, LATEST)
        return None, None
    if manifest.world_size != engine.world_size and engine.rank == 0:
        log.info("load_checkpoint: re-sharding from %d ranks to %d", manifest.world_size, engine.world_size)
    _load_shards(engine, manifest, optimizer_states)
    for name, buf in persistent_buffers(engine.module).items():
        if name in buffers:
            buf.copy_(buffers[name])
    client_state: dict = state["client_state"] if state is not None else {}
    if state is not None and not load_module_only:  # DeepSpeed's load_module_only keeps the counters too
        rng = engine.rank < manifest.world_size  # another world size: the extra ranks keep their own
        engine.load_training_state(training_state(state, engine.config.batch.train_batch_size, rng=rng,
                                                  optimizer=optimizer_states, lr_scheduler=load_lr_scheduler_states))
        if rng:
            set_rng_states(state["rng"])
    engine.after_load()
    return path, client_state


def training_state(saved: dict, train_batch_size: int, *, rng: bool, optimizer: bool,
                   lr_scheduler: bool) -> TrainingState:
    """What a state file (`save.engine_state`) gives back to the engine; None where the engine
    keeps its own: the parts not asked for, and a scheduler or scaler the checkpoint has none of."""
    steps = saved["global_steps"]
    return TrainingState(
        global_steps=steps, skipped_steps=saved["skipped_steps"],
        global_samples=saved.get("global_samples", steps * train_batch_size),  # older checkpoints lack it
        micro_steps=saved["micro_steps"],
        optimizer=saved["optimizer"] if optimizer else None,
        lr_scheduler=saved["lr_scheduler"] if lr_scheduler else None,
        loss_scaler=saved["loss_scaler"],
        device_rng=saved["rng"]["device"] if rng else None)


def _load_shards(engine: Checkpointable, manifest: Manifest, optimizer_states: bool) -> None:
    """Fills every unit's shard; units gathered for the whole run (stages 1/2, persistent ones)
    are gathered again only once every rank has read its shards, so that a rank that failed
    cannot leave the others waiting in a gather."""
    kinds = OPTIM_KINDS if optimizer_states else ("master",)
    total = sum(round_up(u.train_shard_numel * 4) * len(kinds) + round_up(u.frozen_shard_numel * 2)
                for u in engine.units)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="load checkpoint", leave=False,
               disable=engine.rank != 0 or total < PROGRESS_BYTES)
    cache = ExtentCache(manifest, make_handle(engine.config.aio), on_read=bar.update)
    cache.retiled, _ = retiled(manifest, engine)
    with engine.replacing_shards():
        error = None
        try:
            for u in engine.units:
                _load_unit(engine, manifest, cache, u, kinds)
            engine.flush_shards()
        except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
            error = e
        finally:
            bar.close()
        try:
            agree(error, "load_checkpoint", everyone=True)
        except BaseException as e:
            engine.mark_broken(f"load_checkpoint failed part way ({type(e).__name__}: {e}), leaving some values "
                               "loaded and others not", until_load=True)
            e.add_note("load_checkpoint failed part way: units before the failure hold the checkpoint's values, the "
                       "others their own; no checkpoint is saved from this engine until a load succeeds")
            raise


def _load_unit(engine: Checkpointable, manifest: Manifest, cache: ExtentCache, u, kinds: tuple[str, ...]) -> None:
    partial = any(s.name not in manifest.places and s.name not in cache.retiled for s in u.slots)  # non-strict: those keep their values
    master = None
    if u.trainable:
        values = {}
        for kind in kinds:
            out = (engine.read_optimizer_shard(u, kind).clone() if partial
                   else torch.zeros(u.train_shard_numel, dtype=torch.float32))
            fill_region(cache, u, "train", kind, out)
            cache.clear()
            values[kind] = out
        engine.write_optimizer_shards(u, values)
        master = values["master"]
    shard = engine.read_param_shard(u) if partial else torch.zeros(u.shard_numel, dtype=u.dtype)
    parts = u.split(shard)
    if master is not None:
        parts.train.copy_(master)  # the compute-dtype values are the masters rounded, as an update writes
    if u.frozen_shard_numel:
        fill_region(cache, u, FROZEN, FROZEN, parts.frozen)
        cache.clear()
    engine.write_param_shard(u, shard)


def _check_buffers(engine: Checkpointable, saved: dict[str, torch.Tensor], *, strict: bool, where: str) -> None:
    ours = persistent_buffers(engine.module)
    missing = [n for n in ours if n not in saved]
    if strict and missing:
        raise CheckpointError(f"load_checkpoint: {where} has no values for the buffers {listing(missing)}")
    for name, buf in ours.items():
        if name in saved and list(saved[name].shape) != list(buf.shape):
            raise CheckpointError(f"load_checkpoint: buffer {name} has shape {list(saved[name].shape)} in {where}, "
                                  f"{list(buf.shape)} in the model")
