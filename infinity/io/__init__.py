"""Asynchronous file I/O between host memory and NVMe (the Python face of infinity._aio)."""

from infinity.io.deepspeed_aio import AsyncIOBuilder, aio_handle
from infinity.io.handle import ENGINES, AsyncIOHandle, available_engines
from infinity.io.memory import PAGE_SIZE, aligned_empty

__all__ = ["ENGINES", "PAGE_SIZE", "AsyncIOBuilder", "AsyncIOHandle", "aio_handle", "aligned_empty",
           "available_engines"]
