"""Checkpoints of a model-parallel job ([Note: model parallelism] in zero/model_parallel.py).

[Note: model-parallel checkpoints]
    save_dir/latest
    save_dir/<tag>/manifest.json      format, tag, model_parallel_size, data_parallel_size, dirs
    save_dir/<tag>/mp_rank_00/        model-parallel rank 0's slice: a whole checkpoint of its
    save_dir/<tag>/mp_rank_01/        data-parallel group ([Note: checkpoint layout]), its
    ...                               manifest marked with mp_rank and mp_world_size

Each model-parallel rank's data-parallel group writes its directory as any checkpoint is written,
inside one directory that rank 0 of the job created ([Note: publishing a checkpoint] in files.py);
once every rank has finished, rank 0 writes the tag's manifest and publishes the whole tag with one
rename, then `latest`. A crash at any point leaves the previous tag and `latest` as they were.

A load reads the tag's manifest, checks that the engines have the same model-parallel size (a
slice's parameters are the model's code's business: infinity cannot cut them again), and loads
`mp_rank_XX` on each model-parallel rank over its data-parallel group, which may have another
size than when it was saved ([Note: re-sharding] in load.py). `consolidate` and the Hugging Face
export refuse these checkpoints: how a slice joins its neighbours (which dimension, which
parameters are replicated) is known to the model's code, not to the checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from infinity.checkpoint import files
from infinity.checkpoint.layout import FORMAT, MANIFEST, MANIFEST_CRC, VERSION, CheckpointError, Manifest, manifest_crc
from infinity.checkpoint.protocol import Checkpointable
from infinity.checkpoint.save import _keep_newest, _start, agree, check_tag, publish, save_checkpoint
from infinity.zero import dist as zdist

SIZE_KEY = "model_parallel_size"  # in a model-parallel tag's manifest (and nowhere else)


def slice_dir(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}"


def save_sliced(engine: Checkpointable, save_dir: str, tag: Any, client_state: dict | None, save_latest: bool,
                exclude_frozen: bool) -> dict[str, Any]:
    """`save_checkpoint` under model parallelism: every rank of the job calls it."""
    mp = engine.model_parallel
    first = zdist.rank(everyone=True) == 0
    save_dir = os.fspath(save_dir)
    t0 = time.perf_counter()
    error = partial = steps = None
    try:
        engine.check_step_boundary("save_checkpoint")
        steps = engine.training_state().global_steps
        tag = check_tag(f"global_step{steps}" if tag is None else tag)
        if first:
            partial = _start(save_dir, tag)
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    partial = agree(error, "save_checkpoint", partial, everyone=True)[0]
    saved: dict[str, Any] = {}
    try:
        saved = save_checkpoint(engine, partial, slice_dir(mp.rank), client_state, False, exclude_frozen,
                                keep_limit=False, mp=(mp.rank, mp.world))
    except BaseException as e:  # noqa: BLE001 (the other ranks must hear of it, then it is raised)
        error = e
    try:
        sizes = agree(error, "save_checkpoint", saved.get("bytes", 0) if engine.rank == 0 else 0, everyone=True)
    except BaseException:
        if first:
            files.remove_tree(partial)
        raise
    final = os.path.join(save_dir, tag)
    if first:
        try:
            _publish(save_dir, tag, partial, final, steps, mp.world, mp.dp_world, save_latest)
        except BaseException as e:  # noqa: BLE001
            error = e
    agree(error, "save_checkpoint (publishing on rank 0)", everyone=True)
    if first and engine.config.checkpoint.save_total_limit is not None:
        _keep_newest(save_dir, engine.config.checkpoint.save_total_limit, tag)
    seconds = time.perf_counter() - t0
    nbytes = sum(sizes)
    return {"path": final, "bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds else 0.0}


def _publish(save_dir: str, tag: str, partial: str, final: str, steps: int, mp_world: int, dp_world: int,
             save_latest: bool) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "tag": tag, SIZE_KEY: mp_world, "data_parallel_size": dp_world,
                "global_steps": steps, "saved_at": time.time(), "dirs": [slice_dir(r) for r in range(mp_world)]}
    missing = [d for d in manifest["dirs"] if not os.path.isfile(os.path.join(partial, d, MANIFEST))]
    if missing:
        files.remove_tree(partial)
        raise CheckpointError(f"save_checkpoint: {', '.join(missing)} of {tag} were not written")
    publish(save_dir, tag, partial, final, manifest, save_latest)


def read_sliced(path: str) -> dict | None:
    """The manifest of the tag directory `path` if it is a model-parallel checkpoint, else None."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # not one; the ordinary reader says what is wrong
    if not isinstance(data, dict) or SIZE_KEY not in data or data.get("format") != FORMAT:
        return None
    if data.get(MANIFEST_CRC) != manifest_crc(data):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: checksum mismatch (the manifest was changed or "
                              "damaged); nothing was loaded")
    return data


def slice_path(engine: Checkpointable, path: str) -> str:
    """The directory this rank loads from, given the tag directory `path`: its model-parallel
    rank's slice, after checking that the layouts agree."""
    sliced = read_sliced(path)
    mp = engine.model_parallel
    if sliced is None:
        if mp is not None:
            raise CheckpointError(f"load_checkpoint: {path} was saved without model parallelism; these engines have "
                                  f"{mp.world} model-parallel ranks (mpu), and infinity cannot cut the model's "
                                  "parameters into slices (the model's code does)")
        return path
    if mp is None or mp.world != sliced[SIZE_KEY]:
        have = "no mpu" if mp is None else f"{mp.world} model-parallel ranks"
        raise CheckpointError(f"load_checkpoint: {path} holds {sliced[SIZE_KEY]} model-parallel slices "
                              f"({', '.join(sliced['dirs'])}), but these engines have {have}; load it with the "
                              "same model-parallel size (the data-parallel size may differ)")
    return os.path.join(path, sliced["dirs"][mp.rank])


def check_slice(engine: Checkpointable, manifest: Manifest) -> None:
    """Raises unless the checkpoint `manifest` describes is this rank's model-parallel slice (or,
    without model parallelism, the whole model)."""
    mine = (0, 1) if engine.model_parallel is None else (engine.model_parallel.rank, engine.model_parallel.world)
    saved = (manifest.data.get("mp_rank", 0), manifest.data.get("mp_world_size", 1))
    if saved != mine:
        raise CheckpointError(f"load_checkpoint: {manifest.directory} is model-parallel slice {saved[0]} of "
                              f"{saved[1]}, but this rank is slice {mine[0]} of {mine[1]}; load the tag's directory "
                              "with the same mpu")
