"""Text for `infinity finetune`: a byte-level tokenizer, the corpus every machine already has
(the Python standard library's own source), text and JSONL files, packed into sequences."""

from __future__ import annotations

import json
import os
import sysconfig

import torch


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, and 256 as end of document."""

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int) -> list[str]:
    """Source files of the running Python's standard library, in a fixed order, up to `max_bytes`."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(text)
            total += len(text)
            if total >= max_bytes:
                return texts
    return texts


def read_texts(path: str) -> list[str]:
    """Documents of a text file (the whole file is one) or a JSONL file (each line's "text", or
    its string values joined)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data: no file {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return _jsonl_texts(f, path) if path.endswith((".jsonl", ".json")) else [f.read()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--data: {path} is not UTF-8 text ({e.reason} 0x{e.object[e.start]:02x})") from None


def _jsonl_texts(lines, path: str) -> list[str]:
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--data: {path} line {number} is not JSON ({e})") from None
        if isinstance(row, dict):
            texts.append(row["text"] if isinstance(row.get("text"), str)
                         else "\n".join(v for v in row.values() if isinstance(v, str)))
        elif isinstance(row, str):
            texts.append(row)
    return texts


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Every document's tokens end to end (end-of-document between them), cut into rows of
    `seq_len` tokens; the last partial row is dropped."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for text in texts:
        ids.extend(tokenizer.encode(text))
        if eos is not None:
            ids.append(eos)
    rows = len(ids) // seq_len
    if rows == 0:
        raise ValueError(f"--data: {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[:rows * seq_len], dtype=torch.int64).view(rows, seq_len)


def batch(rows: torch.Tensor, step: int, size: int) -> torch.Tensor:
    """The rows of step `step`: a fixed permutation walked in order, so a resume at step k takes
    exactly the batches an uninterrupted run would have."""
    order = torch.randperm(rows.size(0), generator=torch.Generator().manual_seed(0))
    picks = [(step * size + i) % rows.size(0) for i in range(size)]
    return rows[order[picks]]
