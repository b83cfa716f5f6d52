"""`deepspeed.ops.aio`: infinity's aio handle under DeepSpeed's names (infinity/io/deepspeed_aio.py)."""

from infinity.io import AsyncIOBuilder, aio_handle

__all__ = ["AsyncIOBuilder", "aio_handle"]
