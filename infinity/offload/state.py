"""`ShardState`: where one shard's bytes are between host memory and NVMe.

The swapper (this package) moves a shard between `EMPTY`, `NVME`, `NVME_TO_HOST`, `HOST`,
`HOST_TO_NVME` and `INVALID`. It is one of the state enums of the data path, each with one
owner: a unit is gathered on the device or released (`UnitState` in infinity/zero/unit.py), an
optimizer piece is on disk, read, held or written (`PieceState` in
infinity/offload/optimizer/pieces.py), a checkpoint's inputs move (`Where` in
infinity/offload/activations.py), a unit's update waits or ran (`UpdateState` in
infinity/engine/step_policy.py), and a copy between host and device is an `InFlight` of the
device layer until it is waited for.
"""

from __future__ import annotations

import enum


class ShardState(enum.Enum):
    """The state of one shard, and the memory held in each.

    EMPTY:          an NVMe extent is reserved but nothing was ever written to it; no host
                    memory. Reading it is an error: its bytes are not the shard's.
    NVME:           the bytes are on NVMe only; no host memory.
    NVME_TO_HOST:   a read from NVMe into a pool buffer is in flight; the buffer is held and
                    neither read nor reused until the read is waited for.
    HOST:           the bytes are in a pool buffer (held by fetchers or kept by the host cache);
                    the NVMe copy is identical unless the shard was changed and not yet written.
    HOST_TO_NVME:   a write from a host buffer to NVMe is in flight; the buffer is held and must
                    not change, and the NVMe extent holds neither old nor new bytes for sure.
    INVALID:        a write failed; the NVMe extent holds unknown bytes and no host memory is
                    held. Reading raises until a later write succeeds.
    """

    EMPTY = "empty"
    NVME = "nvme"
    NVME_TO_HOST = "nvme_to_host"
    HOST = "host"
    HOST_TO_NVME = "host_to_nvme"
    INVALID = "invalid"
