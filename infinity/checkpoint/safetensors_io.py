"""The safetensors format, written a tensor at a time and read without executing anything.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes. The header depends only on names, dtypes and shapes,
so a writer that knows those up front (from a checkpoint's manifest, or a model's parameters)
writes it first and then streams each tensor as it arrives: nothing but the tensor in hand is in
memory, however large the file. Hugging Face's sharded layout is several such files and a
`model.safetensors.index.json` mapping each name to its file.

An export is Hugging Face's layout (`ShardedWriter`), written into a staging directory and
published whole ([Note: publishing an export] in publish.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable

import torch

from infinity.checkpoint.files import STALE, naming, remove_file, write_durable, writer_status
from infinity.checkpoint.publish import Publisher

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
INDEX_SUFFIX = ".index.json"


def _code(dtype: torch.dtype, name: str) -> str:
    if dtype not in _CODES:
        raise TypeError(f"{name}: safetensors cannot hold dtype {dtype}")
    return _CODES[dtype]


def _nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class StreamWriter:
    """One safetensors file whose tensors are given one at a time, in the declared order."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in entries:
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": _code(dtype, name), "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path = path
        self._entries = list(entries)
        self._next = 0
        self._rows = 0  # rows of the next tensor written so far, when it comes in parts
        self._f = open(path, "wb")
        try:
            with naming(path):
                self._f.write(struct.pack("<Q", len(raw)))
                self._f.write(raw)
        except BaseException:
            self.abort()
            remove_file(path)  # not even its header: nothing to keep
            raise

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """The next declared tensor whole, or its next rows (the tiles of a tiled weight, in
        order: rows are contiguous in the file). True once the tensor is complete."""
        expected, dtype, shape = self._entries[self._next]
        whole = self._rows == 0 and list(tensor.shape) == list(shape)
        rows = tensor.shape[0] if tensor.dim() else 0
        part = (tensor.dim() == len(shape) > 0 and list(tensor.shape[1:]) == list(shape[1:])
                and self._rows + rows <= shape[0])
        if name != expected or tensor.dtype != dtype or not (whole or part):
            raise ValueError(f"{self.path}: expected {expected} {dtype} {list(shape)} next"
                             + (f" from row {self._rows}" if self._rows else "")
                             + f", got {name} {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        with naming(self.path):
            self._f.write(data.numpy().data)
        self._rows = 0 if whole else self._rows + rows
        if self._rows:
            if self._rows < shape[0]:
                return False
            self._rows = 0
        self._next += 1
        return True

    def close(self) -> None:
        if self._next != len(self._entries):
            self.abort()
            raise ValueError(f"{self.path}: {len(self._entries) - self._next} declared tensors were never written")
        try:
            with naming(self.path):
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self.abort()

    def abort(self) -> None:
        """Closes the file; what could not be written (a full disk) is dropped."""
        try:
            self._f.close()
        except OSError:
            pass  # the write that failed already said why


def check_filename(filename: str) -> None:
    if not isinstance(filename, str) or not filename.endswith(".safetensors") or os.sep in filename:
        raise ValueError(f"save_filename: expected a file name ending in .safetensors, got {filename!r} (infinity "
                         "writes safetensors, which loads without executing code)")


def check_out_dir(directory: str, what: str) -> None:
    """`directory` can hold an export: it is a directory or does not exist yet."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{what} {directory}: exists and is not a directory")


def _replaced(filename: str, extra: set[str]) -> Callable[[str], bool]:
    """Whether an entry of the directory belongs to an earlier export under `filename`, which the
    new one replaces (a single file would shadow new shards, old shards would outlive a new
    single file), as save_pretrained does: its layout's names, `extra` (the small files the new
    export brings), and temporaries of those written by processes that are gone."""
    stem = re.escape(filename.removesuffix(".safetensors"))
    index = re.escape(filename + INDEX_SUFFIX)
    ours = re.compile(rf"{re.escape(filename)}|{index}|{stem}-\d{{5}}-of-\d{{5}}\.safetensors")

    def replaced(name: str) -> bool:
        final, _, writer = name.rpartition(".tmp-")
        if ours.fullmatch(name) or name in extra:
            return True
        return bool(writer) and bool(ours.fullmatch(final) or final in extra) and writer_status(writer) == STALE
    return replaced


class ShardedWriter:
    """Hugging Face's layout in `directory`: `filename` alone when everything fits in
    `max_shard_bytes`, else `<stem>-00001-of-0000N.safetensors` files and `<filename>.index.json`;
    tensors are given one at a time in the declared order (a tensor whole or as consecutive row
    blocks), small files (config.json) whole.
    Nothing in `directory` changes before `close` publishes it all ([Note: publishing an
    export] in publish.py); `what` names `directory` in errors."""

    def __init__(self, directory: str, filename: str, entries: list[tuple[str, torch.dtype, list[int]]],
                 max_shard_bytes: int, what: str = "save_dir"):
        check_filename(filename)
        for name, dtype, _ in entries:
            _code(dtype, name)  # said before anything is written
        directory = os.fspath(directory)
        check_out_dir(directory, what)
        shards: list[list] = [[]]
        size = 0
        for entry in entries:
            n = _nbytes(entry[1], entry[2])
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += n
        stem = filename.removesuffix(".safetensors")
        if len(shards) == 1:
            names = [filename]
        else:
            names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.directory, self.filename = directory, filename
        self.total_bytes = sum(_nbytes(e[1], e[2]) for e in entries)
        self.files = [os.path.join(directory, n) for n in names]
        self._plan = list(zip(names, shards))
        self._shard = -1
        self._left = 0
        self._writer: StreamWriter | None = None
        self._weight_map = {e[0]: n for n, shard in self._plan for e in shard}
        self._extra: list[str] = []  # small files' names, published before the weights' entry point
        self._publisher = Publisher(directory)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        while self._left == 0:
            self._next_shard()
        if self._writer.add(name, tensor):
            self._left -= 1

    def _next_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._shard += 1
        file, entries = self._plan[self._shard]
        self._writer = None
        self._writer = StreamWriter(self._publisher.path(file), entries)
        self._left = len(entries)

    def add_file(self, name: str, data: bytes) -> None:
        """A small file published with the weights, replacing one of that name."""
        self._extra.append(name)
        write_durable(self._publisher.path(name), data)

    def close(self) -> None:
        """Finishes the last file, then publishes them all in place of the earlier export
        ([Note: publishing an export] in publish.py)."""
        while self._shard < len(self._plan) - 1:  # shards without tensors (an empty model)
            self._next_shard()
        self._writer.close()
        index_name = self.filename + INDEX_SUFFIX
        names = [name for name, _ in self._plan]
        if len(self._plan) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self._weight_map}
            write_durable(self._publisher.path(index_name), json.dumps(index, indent=2, sort_keys=True).encode())
            names += self._extra + [index_name]  # the entry point last
        else:
            names = self._extra + names
        self._publisher.commit(names, _replaced(self.filename, set(self._extra)), [index_name, self.filename])

    def abort(self) -> None:
        """Removes what was written and not published, and the directories this writer created
        if they are empty; what was in the directory stays as it was."""
        if self._writer is not None:
            self._writer.abort()
        self._publisher.abort()


def read_header(path: str) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: damaged safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def load_file(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a (small) safetensors file, on the CPU."""
    header, start = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            f.seek(start + lo)
            raw = bytearray(f.read(hi - lo))
            if len(raw) != hi - lo:
                raise ValueError(f"{path}: {name} runs past the end of the file")
            dtype = _DTYPES[info["dtype"]]
            out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(info["shape"]).clone() \
                if raw else torch.empty(info["shape"], dtype=dtype)
    return out
