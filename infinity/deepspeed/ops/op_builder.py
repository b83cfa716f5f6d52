"""`deepspeed.ops.op_builder`: the one builder infinity has, `AsyncIOBuilder` (its handle is
compiled with the package; `load()` returns it)."""

from infinity.io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
