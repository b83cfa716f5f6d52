"""Lightning's single-file checkpoint (a `torch.save`d dict: `state_dict` plus Lightning's own
keys) written with one unit of parameters in memory at a time: from an infinity checkpoint
directory (`convert_checkpoint`, behind `infinity.integrations.lightning.strategy.convert_zero_checkpoint_to_fp32_state_dict`)
or from a live engine (`save_full_weights`, for `InfinityStrategy(save_full_weights=True)`), and
read back into a live engine (`load_full_weights`). Needs torch, not Lightning.

[Note: a torch.save file one unit at a time]
`torch.save` writes each tensor's storage from memory, so a state dict built in memory would
hold the whole model. The parameters' fp32 values are written instead, unit by unit as they are
read (an infinity checkpoint's masters, or a live engine's units gathered one at a time), into a
scratch file beside the output; the state dict is then made of tensors mapped from that file
copy-on-write (`numpy.memmap` mode "c", one storage per parameter, so a loader gets independent
tensors), and `torch.save` reads them through the page cache: clean, file-backed pages the kernel
takes back at will, not memory of the process. The disk holds the values twice for the while (the
scratch file, then the output); the scratch file goes when the output is published. The output
is written under a temporary name, fsynced and renamed into place, so a failed conversion leaves
`output_file` as it was. Tied parameters come out as one tensor under every name; buffers as
saved (they are small). Parameters are fp32 whatever dtype the model computes in, as Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` gives them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from infinity.checkpoint import files
from infinity.checkpoint.export import write_units
from infinity.checkpoint.layout import BUFFERS, Manifest, state_file
from infinity.checkpoint.load import ExtentCache, checked_path, param_run, tag_directory
from infinity.checkpoint.safetensors_io import load_file
from infinity.checkpoint.save import agree, aliases, persistent_buffers
from infinity.io import AsyncIOHandle
from infinity.zero.registry import GatheredParameters

if TYPE_CHECKING:
    from infinity.engine import Engine

__all__ = ["CkptWriter", "convert_checkpoint", "load_full_weights", "save_full_weights"]

_ALIGN = 64  # bytes: where each parameter's values start in the scratch file


class CkptWriter:
    """Writes `output_file` ([Note: a torch.save file one unit at a time]).

    Args:
        output_file: the `.ckpt` to write; its directory must exist.
        entries: every parameter's state_dict name and shape, in the order the file lists them;
            `add` must give each of them once, in any order.
    """

    def __init__(self, output_file: str | os.PathLike, entries: Iterable[tuple[str, list[int]]]):
        self.output_file = os.fspath(output_file)
        directory = os.path.dirname(os.path.abspath(self.output_file))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"output_file: its directory {directory} does not exist")
        if os.path.isdir(self.output_file):
            raise IsADirectoryError(f"output_file: {self.output_file} is a directory; give the path of a file")
        self._places: dict[str, tuple[int, list[int]]] = {}  # name -> (byte offset, shape)
        total = 0
        for name, shape in entries:
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            self._places[name] = (total, list(shape))
            total += -(-numel * 4 // _ALIGN) * _ALIGN
        self._total = total
        self._written: set[str] = set()
        fd, self._scratch = tempfile.mkstemp(dir=directory, prefix=".infinity-values-", suffix=".tmp")
        self._fd: int | None = fd
        try:
            os.ftruncate(fd, total)
        except BaseException:
            self.abort()
            raise

    def add(self, name: str, values: torch.Tensor) -> None:
        """Writes one parameter's values (any floating dtype; stored as fp32)."""
        offset, shape = self._places[name]
        if list(values.shape) != shape:
            raise ValueError(f"{name}: values of shape {list(values.shape)}, expected {shape}")
        data = memoryview(values.detach().to(torch.float32).contiguous().cpu().numpy()).cast("B")
        with files.naming(self._scratch):
            while data:
                done = os.pwrite(self._fd, data, offset)
                data, offset = data[done:], offset + done
        self._written.add(name)

    def finish(self, extra: dict[str, Any], aliases: dict[str, str], buffers: dict[str, torch.Tensor]) -> None:
        """Publishes `extra` with `state_dict`: the parameters, `aliases` (name -> the name it ties
        to) and `buffers`."""
        missing = [n for n in self._places if n not in self._written]
        if missing:
            raise RuntimeError(f"{self.output_file}: no values were written for {len(missing)} parameters "
                               f"({missing[0]}, ...)")
        os.close(self._fd)
        self._fd = None
        mapped = np.memmap(self._scratch, dtype=np.uint8, mode="c", shape=(self._total,)) if self._total else None
        state_dict: dict[str, torch.Tensor] = {}
        for name, (offset, shape) in self._places.items():
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if numel == 0:
                state_dict[name] = torch.empty(shape)
                continue
            view = mapped[offset:offset + numel * 4].view(np.float32).reshape(shape)
            state_dict[name] = torch.from_numpy(view)
        for name, target in aliases.items():
            state_dict[name] = state_dict[target]
        state_dict.update(buffers)
        tmp = files.temporary_name(self.output_file)
        try:
            with files.naming(tmp), open(tmp, "wb") as f:
                torch.save({**extra, "state_dict": state_dict}, f)
                f.flush()
                os.fsync(f.fileno())
            del state_dict, mapped
            with files.naming(self.output_file):
                os.replace(tmp, self.output_file)
        except BaseException:
            files.remove_file(tmp)
            raise
        finally:
            files.remove_file(self._scratch)
        files.fsync_dir(os.path.dirname(os.path.abspath(self.output_file)))

    def abort(self) -> None:
        """Removes the scratch file (the output is untouched); after `finish`, does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        files.remove_file(self._scratch)


def convert_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike,
                       tag: str | None = None) -> dict[str, Any]:
    """An infinity checkpoint (`checkpoint_dir` holding `latest`, or a tag's directory) as one
    Lightning `.ckpt`: its client_state (Lightning's keys, as `InfinityStrategy` saves them) and
    `state_dict`, the fp32 masters (frozen parameters' values where there are none) and the
    buffers. Returns what was written but the state_dict."""
    path = tag_directory(checkpoint_dir, tag, "checkpoint_dir")
    manifest = Manifest.read(path)
    extra = dict(torch.load(checked_path(manifest, state_file(0)), map_location="cpu", weights_only=True)["client_state"])
    for key in ("state_dict", "optimizer_states"):
        extra.pop(key, None)
    params = [p for u in manifest.units for p in u["params"]]
    aliases = {n: t for n, t in manifest.data.get("aliases", {}).items() if n not in manifest.places}
    buffers = load_file(checked_path(manifest, BUFFERS)) if BUFFERS in manifest.files else {}
    writer = CkptWriter(output_file, [(p["name"], p["shape"]) for p in params])
    cache = ExtentCache(manifest, AsyncIOHandle(block_size=1 << 20, queue_depth=8))
    try:
        for u in manifest.units:
            for p in u["params"]:
                place = manifest.places[p["name"]]
                writer.add(p["name"], param_run(cache, place, "master", 0, place.numel).reshape(place.shape))
            cache.clear()  # one unit's extents in memory at a time
        writer.finish(extra, aliases, buffers)
    except BaseException:
        writer.abort()
        raise
    return extra


def save_full_weights(engine: "Engine", filepath: str, extra: dict, exclude_frozen: bool) -> None:
    """The model's fp32 weights and `extra` as one `.ckpt` (every rank calls it; rank 0 writes),
    one unit in memory at a time."""
    engine.check_step_boundary("save_checkpoint")
    slots = [(u, s) for u in engine.units for s in u.slots if not (exclude_frozen and s.group < 0)]
    wanted = {id(s) for _, s in slots}
    writer, error = None, None
    try:
        if engine.rank == 0:
            writer = CkptWriter(filepath, [(s.name, list(s.shape)) for _, s in slots])
    except Exception as e:  # noqa: BLE001 (every rank hears of it, then it is raised)
        error = e
    try:
        failed = write_units(engine, wanted, engine.full_fp32_values,
                             writer.add if writer is not None and error is None else None)
        error = error or failed
        if writer is not None and error is None:
            try:
                tied = {n: t for n, t in aliases(engine).items() if t in {s.name for _, s in slots}}
                buffers = {n: b.detach().cpu().clone() for n, b in persistent_buffers(engine.module).items()}
                writer.finish(extra, tied, buffers)
                writer = None
            except Exception as e:  # noqa: BLE001
                error = e
    finally:
        if writer is not None:
            writer.abort()
    agree(error, "save_checkpoint (save_full_weights, writing on rank 0)")


def load_full_weights(module: nn.Module, state_dict: Mapping[str, Any], strict: bool, is_rank_zero: bool) -> None:
    """`module.load_state_dict(state_dict)` one module's parameters gathered at a time; rank 0's
    values become every rank's (GatheredParameters(modifier_rank=0))."""
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def load(m: nn.Module, prefix: str) -> None:
        with GatheredParameters(list(m.parameters(recurse=False)), modifier_rank=0):
            if is_rank_zero:
                m._load_from_state_dict(state_dict, prefix, {}, True, missing, unexpected, errors)  # noqa: SLF001
        for name, child in m._modules.items():  # noqa: SLF001 (what load_state_dict walks)
            if child is not None:
                load(child, f"{prefix}{name}.")

    load(module, "")
    if errors or (strict and (missing or unexpected)):
        problems = errors + [f"missing key {k}" for k in missing] + [f"unexpected key {k}" for k in unexpected]
        raise RuntimeError(f"load_full_weights: the checkpoint's state_dict does not fit the model: "
                           f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}")
