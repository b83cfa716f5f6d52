"""Where every shard's bytes live (device, host, NVMe) and how they move between tiers.

`BufferPool` (host buffers for transfers), `NvmeStore` (the files on NVMe), `HostCache`
(which idle shards stay in host memory) and `Swapper` (moves shards between host and NVMe,
asynchronously) are the mechanism; `ShardState` is a shard's place between host and NVMe.
The tiers built on them: `params/` (parameter shards), `optimizer/` (masters, moments and
gradient accumulators), `activations.py` (checkpointed inputs); `placement.py` decides what
lives in host memory and what on NVMe.
"""

from infinity.offload.cache import HostCache
from infinity.offload.pool import BufferPool, PoolStats
from infinity.offload.shard import FetchHandle, Transfer, WriteHandle
from infinity.offload.state import ShardState
from infinity.offload.stats import DirectionStats, SwapStats
from infinity.offload.store import Extent, NvmeStore
from infinity.offload.swapper import IOHandle, Swapper

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
