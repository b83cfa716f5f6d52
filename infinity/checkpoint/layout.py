"""What a checkpoint directory holds and the manifest that describes it.

[Note: checkpoint layout]
    save_dir/latest                    the newest tag, one line (replaced atomically)
    save_dir/<tag>/manifest.json       layout, shapes, dtypes, world size, a checksum per extent
    save_dir/<tag>/rank00000.master.bin      rank 0's fp32 masters of every unit, end to end
    save_dir/<tag>/rank00000.exp_avg.bin     ... its exp_avg      } the moments the optimizer keeps
    save_dir/<tag>/rank00000.exp_avg_sq.bin  ... its exp_avg_sq   } (manifest "optim_kinds": Lion
                                             exp_avg alone, Adagrad exp_avg_sq, Adam both); a moment
                                             not saved loads as zeros
    save_dir/<tag>/rank00000.frozen.bin      its shards of frozen parameters, compute dtype
    save_dir/<tag>/rank00000.state.pt        counters, optimizer groups, scheduler, loss scale,
                                             RNG states, client_state (torch.load weights_only)
    save_dir/<tag>/buffers.safetensors       the module's persistent buffers (rank 0)
    save_dir/<tag>/config.json               a Hugging Face model's config, when it has one

A shard file is each unit's region of that rank's shard ([Note: flat layout] in
infinity/zero/unit.py), in unit order, each starting on a 4 KiB boundary so that it is one
O_DIRECT transfer: an *extent*. The manifest gives each extent's offset, its length rounded
up to 4 KiB (the zero padding included) and a CRC-32 of those bytes, so every byte of every
file is checked when read, and a reader of part of the checkpoint (another world size, or
`consolidate`) checks exactly what it reads. Parameters are found by name: each unit lists its
parameters with their region, offset in the region (padding excluded), shape and param group,
which is all a reader with another world size, another unit plan or no model at all needs.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch

FORMAT = "infinity-checkpoint"
VERSION = 1
EXTENT_ALIGN = 4096
OPTIM_KINDS = ("master", "exp_avg", "exp_avg_sq")
FROZEN = "frozen"
MANIFEST = "manifest.json"
LATEST = "latest"
BUFFERS = "buffers.safetensors"
HF_CONFIG = "config.json"
MANIFEST_CRC = "manifest_crc32"  # of the manifest's other keys, canonical JSON: a damaged offset is caught too


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete, or of another model."""


def shard_file(rank: int, kind: str) -> str:
    return f"rank{rank:05d}.{kind}.bin"


def state_file(rank: int) -> str:
    return f"rank{rank:05d}.state.pt"


def round_up(n: int, multiple: int = EXTENT_ALIGN) -> int:
    return -(-n // multiple) * multiple


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"manifest: unknown dtype {name!r}")
    return dtype


def unit_entries(units, exclude_frozen: bool = False) -> list[dict]:
    """The manifest's description of each unit (infinity.zero.unit.Unit): its shard lengths and
    where each parameter is in its region, padding excluded. exclude_frozen: the checkpoint holds
    no frozen values, and lists no frozen parameter."""
    out = []
    for u in units:
        train_padded = u.train_shard_numel * u.world
        params = []
        for s in u.slots:
            trainable = s.group >= 0
            if exclude_frozen and not trainable:
                continue
            params.append({"name": s.name, "shape": list(s.shape), "numel": s.numel,
                           "region": "train" if trainable else FROZEN,
                           "offset": s.offset if trainable else s.offset - train_padded, "group": s.group})
        out.append({"name": u.name, "train_shard_numel": u.train_shard_numel,
                    "frozen_shard_numel": 0 if exclude_frozen else u.frozen_shard_numel, "params": params})
    return out


def manifest_crc(data: dict) -> int:
    body = {k: v for k, v in data.items() if k != MANIFEST_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class ParamPlace:
    """Where one parameter's values are in a checkpoint."""

    def __init__(self, unit: int, entry: dict):
        self.unit = unit
        self.name: str = entry["name"]
        self.shape: list[int] = entry["shape"]
        self.numel: int = entry["numel"]
        self.region: str = entry["region"]  # "train" or "frozen"
        self.offset: int = entry["offset"]
        self.group: int = entry["group"]


class Manifest:
    """A checkpoint's manifest, checked as it is read."""

    def __init__(self, data: dict, directory: str):
        self.data = data
        self.directory = directory
        self.world_size: int = data["world_size"]
        self.compute_dtype = dtype_of(data["compute_dtype"])
        self.units: list[dict] = data["units"]
        self.files: dict[str, dict] = data["files"]
        self.tiles: dict[str, list[str]] = data.get("tiles", {})  # weight name -> its tiles' names, in order
        # the optimizer state kinds saved (the rule's); checkpoints before "optim_kinds" hold all three
        self.optim_kinds: tuple[str, ...] = tuple(data.get("optim_kinds", OPTIM_KINDS))
        self.places: dict[str, ParamPlace] = {}
        for j, u in enumerate(self.units):
            for p in u["params"]:
                self.places[p["name"]] = ParamPlace(j, p)

    @classmethod
    def read(cls, directory: str) -> "Manifest":
        path = os.path.join(directory, MANIFEST)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; {directory} is not a complete infinity checkpoint (a save "
                                  "that did not finish leaves no directory under the tag's name)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e}); the file is damaged") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not an infinity checkpoint manifest (format {data.get('format')!r})"
                                  if isinstance(data, dict) else f"{path}: not an infinity checkpoint manifest")
        if data.get("version") != VERSION:
            raise CheckpointError(f"{path}: format version {data.get('version')!r}; this infinity reads "
                                  f"version {VERSION}")
        if data.get(MANIFEST_CRC) != manifest_crc(data):
            raise CheckpointError(f"{path}: checksum mismatch (the manifest was changed or damaged); nothing was "
                                  "loaded")
        if "model_parallel_size" in data:  # [Note: model-parallel checkpoints] in checkpoint/model_parallel.py
            raise CheckpointError(f"{directory}: a model-parallel checkpoint of {data['model_parallel_size']} slices "
                                  f"({', '.join(map(str, data.get('dirs', [])))}); infinity does not join slices, "
                                  "whose layout the model's code knows: load it into engines with the same mpu, or "
                                  "join the slices with the model-parallel framework's own tools")
        try:
            manifest = cls(data, directory)
            manifest.validate()
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: malformed ({type(e).__name__}: {e})") from None
        return manifest

    def validate(self) -> None:
        """Every parameter lies inside its region, and every extent it needs is listed."""
        if "master" not in self.optim_kinds or not set(self.optim_kinds) <= set(OPTIM_KINDS):
            raise CheckpointError(f"{self.path(MANIFEST)}: optim_kinds {list(self.optim_kinds)}: expected master and "
                                  f"some of {list(OPTIM_KINDS[1:])}")
        for j, u in enumerate(self.units):
            for p in u["params"]:
                region = p["region"]
                if region not in ("train", FROZEN):
                    raise CheckpointError(f"{self.path(MANIFEST)}: {p['name']} has region {region!r}")
                if p["offset"] < 0 or p["offset"] + p["numel"] > self.region_numel(j, region) * self.world_size:
                    raise CheckpointError(f"{self.path(MANIFEST)}: {p['name']} lies outside its unit's region")
            kinds = (self.optim_kinds if u["train_shard_numel"] else ()) + ((FROZEN,) if u["frozen_shard_numel"] else ())
            for kind in kinds:
                for rank in range(self.world_size):
                    self.extent(rank, kind, j)

    def check_whole(self, what: str) -> None:
        """Raises if this checkpoint is one model-parallel rank's slice of the model, which `what`
        (an export) cannot write as the model ([Note: model-parallel checkpoints])."""
        if self.data.get("mp_world_size", 1) > 1:
            raise CheckpointError(f"{what}: {self.directory} is model-parallel rank {self.data['mp_rank']}'s slice "
                                  f"of {self.data['mp_world_size']}; infinity does not join slices, whose layout "
                                  "the model's code knows: join them with the model-parallel framework's tools")

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def region_numel(self, unit: int, region: str) -> int:
        """Elements per rank of a unit's region in this checkpoint."""
        u = self.units[unit]
        return u["train_shard_numel"] if region == "train" else u["frozen_shard_numel"]

    def extent(self, rank: int, kind: str, unit: int) -> tuple[str, int, int, int]:
        """(file name, offset, length rounded to 4 KiB, crc32) of one rank's extent of a unit."""
        name = shard_file(rank, kind)
        entry = self.files.get(name)
        if entry is None or str(unit) not in entry.get("extents", {}):
            raise CheckpointError(f"{self.path(MANIFEST)}: lists no extent of unit {unit} in {name}")
        offset, nbytes, crc = entry["extents"][str(unit)]
        return name, offset, nbytes, crc

    def summary(self) -> dict[str, Any]:
        return {k: self.data.get(k) for k in ("tag", "world_size", "stage", "compute_dtype", "offload_param",
                                              "offload_optimizer", "global_steps")}
