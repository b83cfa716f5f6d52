"""`engine.save_checkpoint`: every rank streams its own shards from whichever tier holds them
into the checkpoint through the aio handle ([Note: checkpoint layout] in layout.py), never
gathering the model; rank 0 publishes the result ([Note: publishing a checkpoint] in files.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from infinity.checkpoint import files, leftovers
from infinity.checkpoint.layout import (
    BUFFERS,
    FORMAT,
    FROZEN,
    HF_CONFIG,
    LATEST,
    MANIFEST,
    MANIFEST_CRC,
    VERSION,
    dtype_name,
    manifest_crc,
    round_up,
    shard_file,
    state_file,
    unit_entries,
)
from infinity.checkpoint.protocol import Checkpointable, TrainingState
from infinity.checkpoint.safetensors_io import StreamWriter
from infinity.zero import dist as zdist
from infinity.offload.nvme_io import make_handle
from infinity.zero.tiling import tiled_weights

log = logging.getLogger("infinity")
PROGRESS_BYTES = 1 << 30  # a progress bar for anything larger


def check_tag(tag: Any) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", LATEST) or tag.startswith(".") or "/" in tag or "\0" in tag:
        raise ValueError(f"tag: expected a plain directory name (not empty, '.', '..' or {LATEST!r}, not starting "
                         f"with '.', no '/'), got {tag!r}")
    return tag


def _check_loadable(value: Any, what: str) -> bytes:
    """`value` serialized; it must load back with torch.load(weights_only=True): tensors,
    numbers, strings, and dicts, lists and tuples of them. Said now rather than when resuming."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises several kinds)
        raise TypeError(f"{what}: holds an object that torch.load(weights_only=True) refuses, so the checkpoint "
                        "could not be loaded without executing code; keep to tensors, numbers, strings, and dicts, "
                        f"lists and tuples of them ({str(e).splitlines()[0]})") from None
    return buffer.getvalue()


def rng_states(device_rng: torch.Tensor | None) -> dict:
    """The process's RNG states (Python, NumPy, torch) and the device's."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "device": device_rng,
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def engine_state(state: TrainingState, gas: int, client_state: dict) -> dict:
    """The rank's state file's contents (loaded back by load.training_state)."""
    return {
        "global_steps": state.global_steps, "skipped_steps": state.skipped_steps,
        "global_samples": state.global_samples,
        "micro_steps": state.micro_steps - state.micro_steps % gas,  # a partial accumulation is not kept
        "optimizer": state.optimizer, "lr_scheduler": state.lr_scheduler, "loss_scaler": state.loss_scaler,
        "rng": rng_states(state.device_rng),
        "client_state": client_state,
    }


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that its state_dict holds, by state_dict name (a shared one once)."""
    out, seen = {}, set()
    for module_name, m in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set and id(b) not in seen:  # noqa: SLF001
                seen.add(id(b))
                out[prefix + name] = b
    return out


def aliases(engine: Checkpointable) -> dict[str, str]:
    """state_dict names of parameters held under another name (tied weights) -> that name."""
    first = {id(s.param): s.name for u in engine.units for s in u.slots}
    return {name: first[id(p)] for name, p in engine.module.named_parameters(remove_duplicate=False)
            if id(p) in first and first[id(p)] != name}


def agree(error: BaseException | None, what: str, payload: Any = None, everyone: bool = False) -> list:
    """Every rank's `payload`, once no rank has failed; if one has, every rank raises (its own
    error, or one naming the rank that failed) instead of waiting for it in a collective. Over
    the data-parallel group, or the whole job with `everyone`."""
    rank = zdist.rank(everyone=True)
    gathered = zdist.all_gather_object(
        (None if error is None else f"rank {rank}: {type(error).__name__}: {error}", payload), everyone=everyone)
    failures = [g for g, _ in gathered if g is not None]
    if failures:
        if error is not None:
            raise error
        raise RuntimeError(f"{what}: {failures[0]}")
    return [p for _, p in gathered]


def save_checkpoint(engine: Checkpointable, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False, *, keep_limit: bool = True,
                    mp: tuple[int, int] | None = None) -> dict[str, Any]:
    """Writes the checkpoint on every rank of the data-parallel group (all of them call it);
    returns what it cost: its directory (`path`), `bytes`, `seconds` and `gbps`.
    exclude_frozen_parameters: leave out the values of parameters with requires_grad False (a
    LoRA run's base weights); a load keeps the model's own values for them. Under model
    parallelism `save_sliced` (checkpoint/model_parallel.py) calls it for each slice, with
    `keep_limit` False (checkpoint.save_total_limit is its business) and `mp`, (model-parallel
    rank, size) for the slice's manifest."""
    rank = engine.rank
    save_dir = os.fspath(save_dir)
    t0 = time.perf_counter()
    error = partial = training = None
    try:
        engine.check_step_boundary("save_checkpoint")
        training = engine.training_state()
        state = _state_bytes(engine, training, client_state)
        tag = check_tag(f"global_step{training.global_steps}" if tag is None else tag)
        if rank == 0:
            partial = _start(save_dir, tag)
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    partial = agree(error, "save_checkpoint", partial)[0]  # rank 0's: [Note: leftovers and their writers]
    final = os.path.join(save_dir, tag)
    gas = engine.config.batch.gradient_accumulation_steps
    if rank == 0 and training.micro_steps % gas:
        log.warning("save_checkpoint: %d of %d micro-steps of this accumulation have run; their gradients are not "
                    "saved and a resume starts the accumulation again", training.micro_steps % gas, gas)
    entries: dict[str, dict] = {}
    try:
        entries = _write_rank(engine, partial, tag, state, exclude_frozen_parameters)
    except BaseException as e:  # noqa: BLE001 (the other ranks must hear of it, then it is raised)
        error = e
    try:
        everything = agree(error, "save_checkpoint", entries)
    except BaseException:
        if rank == 0:
            files.remove_tree(partial)
        raise
    nbytes = sum(e["bytes"] for part in everything for e in part.values())
    if rank == 0:
        try:
            _publish(engine, training, save_dir, tag, partial, final,
                     {n: e for part in everything for n, e in part.items()}, save_latest, exclude_frozen_parameters,
                     {} if mp is None else {"mp_rank": mp[0], "mp_world_size": mp[1]})
        except BaseException as e:  # noqa: BLE001
            error = e
    agree(error, "save_checkpoint (publishing on rank 0)")
    if rank == 0 and keep_limit and engine.config.checkpoint.save_total_limit is not None:
        _keep_newest(save_dir, engine.config.checkpoint.save_total_limit, tag)
    seconds = time.perf_counter() - t0
    saved = {"path": final, "bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds else 0.0}
    if rank == 0 and keep_limit:
        log.info("infinity: saved checkpoint %s: %.3f GB in %.2f s (%.2f GB/s)", final, nbytes / 1e9, seconds,
                 saved["gbps"])
    return saved


def _state_bytes(engine: Checkpointable, training: TrainingState, client_state: dict | None) -> bytes:
    """The rank's small state, serialized, once it is known to load back without executing code."""
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state: expected a dict, got {type(client_state).__name__}")
    _check_loadable(client_state, "client_state")
    state = engine_state(training, engine.config.batch.gradient_accumulation_steps, client_state or {})
    return _check_loadable(state, "the engine's state (its LR scheduler's state_dict, most likely)")


def _write_rank(engine: Checkpointable, partial: str, tag: str, state: bytes, exclude_frozen: bool) -> dict[str, dict]:
    """This rank's files in `partial`, fsynced; returns their manifest entries."""
    rank = engine.rank
    engine.flush_shards()  # the last step's writes: the state read next is the step's result
    trainable = [u for u in engine.units if u.trainable]
    frozen = [] if exclude_frozen else [u for u in engine.units if u.frozen_shard_numel]
    elsize = engine.config.compute_dtype.itemsize
    kinds = engine.optimizer_kinds()
    total = sum(round_up(u.train_shard_numel * 4) for u in trainable) * len(kinds)
    total += sum(round_up(u.frozen_shard_numel * elsize) for u in frozen)
    entries: dict[str, dict] = {}
    offsets: dict[str, int] = {}
    writer = files.ExtentWriter(make_handle(engine.config.aio))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"save {tag}", leave=False,
               disable=rank != 0 or total < PROGRESS_BYTES)

    def put(kind: str, unit_index: int, values: torch.Tensor) -> None:
        name = shard_file(rank, kind)
        offset = offsets.get(name, 0)
        nbytes, crc = writer.write(os.path.join(partial, name), offset, values)
        entry = entries.setdefault(name, {"bytes": 0, "extents": {}})
        entry["extents"][str(unit_index)] = [offset, nbytes, crc]
        entry["bytes"] = offsets[name] = offset + nbytes
        bar.update(nbytes)

    try:
        with torch.profiler.record_function("infinity::save_checkpoint"):
            for u in engine.units:
                if u.trainable:
                    for kind in kinds:
                        put(kind, u.index, engine.read_optimizer_shard(u, kind))
                if u.frozen_shard_numel and not exclude_frozen:
                    put(FROZEN, u.index, u.split(engine.read_param_shard(u)).frozen)
            writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    path = os.path.join(partial, state_file(rank))
    files.write_durable(path, state)
    size, crc = files.crc_of_file(path)
    entries[state_file(rank)] = {"bytes": size, "crc32": crc}
    if rank == 0:
        entries.update(_write_module_files(engine, partial))
    return entries


def _write_module_files(engine: Checkpointable, partial: str) -> dict[str, dict]:
    """Rank 0's files of the module itself: its persistent buffers and, for a Hugging Face model,
    its config; returns their manifest entries."""
    entries: dict[str, dict] = {}
    buffers = persistent_buffers(engine.module)
    path = os.path.join(partial, BUFFERS)
    w = StreamWriter(path, [(n, b.dtype, list(b.shape)) for n, b in buffers.items()])
    try:
        for n, b in buffers.items():
            w.add(n, b)
        w.close()
    except BaseException:
        w.abort()  # now, not when the traceback is collected: a removed file's space is held while open
        raise
    size, crc = files.crc_of_file(path)
    entries[BUFFERS] = {"bytes": size, "crc32": crc}
    hf_config = getattr(engine.module, "config", None)
    if hasattr(hf_config, "to_json_string"):  # a Hugging Face model: export makes a model directory
        path = os.path.join(partial, HF_CONFIG)
        files.write_atomic(path, hf_config.to_json_string().encode())
        size, crc = files.crc_of_file(path)
        entries[HF_CONFIG] = {"bytes": size, "crc32": crc}
    return entries


def _start(save_dir: str, tag: str) -> str:
    """Rank 0: creates `save_dir` if needed, removes what saves killed outright left there, and
    creates the directory the ranks write into; returns it ([Note: publishing a checkpoint])."""
    if not os.path.isdir(save_dir):
        os.makedirs(save_dir)
        files.fsync_dir(os.path.dirname(os.path.abspath(save_dir)))
    leftovers.remove(leftovers.find(save_dir))
    partial = os.path.join(save_dir, f".{tag}.partial-{files.writer_id()}")
    os.makedirs(partial)
    return partial


def _publish(engine: Checkpointable, training: TrainingState, save_dir: str, tag: str, partial: str, final: str,
             entries: dict[str, dict], save_latest: bool, exclude_frozen: bool, extra: dict) -> None:
    """[Note: publishing a checkpoint] in files.py. A failure before the tag is published
    removes what was written; one writing `latest` keeps the tag, which is whole, and says so."""
    zero = engine.config.zero
    manifest = {
        "format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.world_size, "stage": zero.stage,
        "compute_dtype": dtype_name(engine.config.compute_dtype), "offload_param": zero.offload_param.device,
        "offload_optimizer": zero.offload_optimizer.device, "global_steps": training.global_steps,
        "param_groups": len(training.optimizer["param_groups"]), "saved_at": time.time(),
        "units": unit_entries(engine.units, exclude_frozen), "frozen_excluded": exclude_frozen,
        "optim_kinds": list(engine.optimizer_kinds()),
        "aliases": aliases(engine), "tiles": tiled_weights(engine.module), "hf_config": HF_CONFIG in entries,
        "files": dict(sorted(entries.items())), **extra,
    }
    publish(save_dir, tag, partial, final, manifest, save_latest)


def publish(save_dir: str, tag: str, partial: str, final: str, manifest: dict, save_latest: bool) -> None:
    """Writes `manifest` (its CRC added) into `partial`, renames it to `final`, then `latest`
    ([Note: publishing a checkpoint] in files.py); a failure before the rename removes `partial`."""
    manifest[MANIFEST_CRC] = manifest_crc(manifest)
    try:
        files.write_atomic(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1).encode())
        files.fsync_dir(partial)
        _rename_into_place(save_dir, tag, partial, final)
    except BaseException:
        files.remove_tree(partial)
        raise
    if save_latest:
        _write_latest(save_dir, tag)


def _rename_into_place(save_dir: str, tag: str, partial: str, final: str) -> None:
    replaced = os.path.join(save_dir, f".{tag}.replaced")
    if os.path.isdir(replaced) and not os.path.exists(final):
        os.rename(replaced, final)  # an earlier replace died between its renames: that was the tag
    if os.path.exists(final):
        files.remove_tree(replaced)
        os.rename(final, replaced)
    try:
        os.rename(partial, final)
    except BaseException:
        if not os.path.exists(final):
            os.rename(replaced, final)
        raise
    files.fsync_dir(save_dir)
    files.remove_tree(replaced)


def read_latest(save_dir: str) -> str | None:
    """What `save_dir/latest` holds (stripped), None when there is no such file."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with files.naming(path), open(path, encoding="utf-8") as f:
        return f.read().strip()


def _write_latest(save_dir: str, tag: str) -> None:
    path = os.path.join(save_dir, LATEST)
    try:
        previous = read_latest(save_dir)
    except (OSError, UnicodeDecodeError):
        previous = None
    try:
        files.write_atomic(path, f"{tag}\n".encode())
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e}; the checkpoint {os.path.join(save_dir, tag)} was saved whole, "
                      f"but {LATEST} still names {previous!r}: load it with tag={tag!r}, or make room and save "
                      "again", path) from None


# ---- keeping the newest checkpoints (checkpoint.save_total_limit) --------------------------------


def published(save_dir: str) -> list[str]:
    """The checkpoints of `save_dir` (directories holding our manifest), oldest first by when
    they were published: the manifest's `saved_at`, else its modification time."""
    found = []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name, MANIFEST)
        if name.startswith(".") or os.path.islink(os.path.join(save_dir, name)) or not os.path.isfile(path):
            continue  # a link to a checkpoint elsewhere is the user's
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT:
            when = data.get("saved_at")
            found.append((when if isinstance(when, (int, float)) else os.path.getmtime(path), name))
    return [name for _, name in sorted(found)]


def _keep_newest(save_dir: str, limit: int, saved: str) -> None:
    """Removes the checkpoints beyond the newest `limit`, oldest first, never the one just saved
    nor the one `latest` names. Each goes out of sight by one rename, then is deleted; a
    failure is said and the save stands."""
    try:
        named = read_latest(save_dir)
        for name in published(save_dir)[:-limit]:
            if name in (saved, named):
                continue
            doomed = os.path.join(save_dir, f".{name}.removed-{files.writer_id()}")
            os.rename(os.path.join(save_dir, name), doomed)
            files.fsync_dir(save_dir)
            files.remove_tree(doomed)
            log.info("infinity: removed checkpoint %s (checkpoint.save_total_limit %d)", name, limit)
    except (OSError, UnicodeDecodeError) as e:
        log.warning("save_checkpoint: checkpoint.save_total_limit %d: could not remove older checkpoints of %s "
                    "(%s); they are left in place", limit, save_dir, e)
