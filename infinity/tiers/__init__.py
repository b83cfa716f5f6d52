"""Where every shard's bytes live (device, host, NVMe) and how they move between tiers.

`BufferPool` (host buffers for transfers), `NvmeStore` (the files on NVMe), `HostCache`
(which idle shards stay in host memory) and `Swapper` (moves shards between host and NVMe,
asynchronously) are the pieces; `ShardState` is the one state enum every layer uses.
"""

from infinity.tiers.cache import HostCache
from infinity.tiers.pool import BufferPool, PoolStats
from infinity.tiers.shard import FetchHandle, Transfer, WriteHandle
from infinity.tiers.state import ShardState
from infinity.tiers.stats import DirectionStats, SwapStats
from infinity.tiers.store import Extent, NvmeStore
from infinity.tiers.swapper import IOHandle, Swapper

__all__ = [
    "BufferPool",
    "DirectionStats",
    "Extent",
    "FetchHandle",
    "HostCache",
    "IOHandle",
    "NvmeStore",
    "PoolStats",
    "ShardState",
    "SwapStats",
    "Swapper",
    "Transfer",
    "WriteHandle",
]
