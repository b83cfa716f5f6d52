"""`offload_param.device` none and cpu: each unit's compute-dtype shard stays whole in memory,
on the compute device (none) or in page-locked host memory (cpu), copied to the device through
the device layer ([Note: in-flight copies] in `infinity.device`) one unit ahead. The NVMe tier
(`infinity.offload.params.nvme`) has the same methods (`ParamTier` in `infinity.offload.protocols`).

[Note: CPU as the device]
Without a GPU the compute device is the CPU (or the asynchronous test device): `fetch` hands out
the shard as the device layer delivers it, and the unit copies it into its own gathered buffer,
freed on release, so the live budget holds on the CPU as on a GPU.
"""

from __future__ import annotations

import torch

from infinity.device import Device, InFlight
from infinity.io import aligned_empty
from infinity.offload.protocols import ShardParts, TierUnit


class ResidentParams:
    """Shards kept whole in memory: on the device (offload none) or in host memory (cpu).

    `update_target(unit, on_device)`: the optimizer writes the new trainable part into the
    shard itself where it lives on the optimizer's side of the bus, else into a staging buffer
    on that side; `commit` copies staging into the shard, and the staging buffer is not handed
    out again before that copy has read it."""

    def __init__(self, device: Device, offload: bool):
        self.device = device
        self.offload = offload
        self._shards: dict[int, torch.Tensor] = {}  # host (offload) or device tensors
        self._staging: dict[int, torch.Tensor] = {}  # the other side's buffers for new values
        self._inflight: dict[int, InFlight] = {}  # prefetched host -> device copies, not yet fetched
        self._reading: dict[int, InFlight] = {}  # copies that read a host shard, until they are waited for
        self._commits: dict[int, InFlight] = {}  # staging -> shard copies, until the staging is reused

    def add(self, unit: TierUnit, values: torch.Tensor) -> None:
        if self.offload:
            shard = aligned_empty(unit.shard_numel, unit.dtype, pin=self.device.pin() or None)
            shard.copy_(values)
        else:
            shard = self.device.move(values.to(unit.dtype))
        self._shards[unit.index] = shard

    def prefetch(self, unit: TierUnit) -> bool:
        if not self.offload:
            return True  # already on the device
        if unit.index in self._inflight:
            return False
        self._wait_reading(unit.index)
        self._inflight[unit.index] = self.device.to_device(self._shards[unit.index])
        return True

    def ready(self, unit: TierUnit) -> bool:
        return not self.offload or unit.index in self._inflight

    def fetch(self, unit: TierUnit) -> ShardParts:
        if not self.offload:
            if unit.index in self._commits:  # new values still on their way in
                self.device.wait_compute(self._commits[unit.index])
            return unit.split(self._shards[unit.index])
        self.prefetch(unit)
        copy = self._inflight.pop(unit.index)
        # Kept for the host's wait before the shard changes, without the device copy itself,
        # which must die with the gathered unit's use of it.
        self._reading[unit.index] = InFlight(copy.source, copy.source, copy.fence)
        return unit.split(self.device.wait_compute(copy))

    def done(self, unit: TierUnit) -> None:
        pass  # the device copy dies with its last reference; `_reading` guards the host shard

    def _wait_reading(self, index: int) -> None:
        if index in self._reading:
            self.device.wait_host(self._reading.pop(index))

    def hold_writes(self) -> None:
        pass  # nothing is written: the values stay in memory

    def release_writes(self) -> None:
        pass

    def update_target(self, unit: TierUnit, on_device: bool) -> torch.Tensor:
        index = unit.index
        if on_device != self.offload:  # the shard is on the optimizer's side: write it in place
            self._wait_reading(index)
            return unit.split(self._shards[index]).train
        if index in self._commits:  # the last commit must have read the staging buffer
            self.device.wait_host(self._commits.pop(index))
        if index not in self._staging:
            n = unit.train_shard_numel
            self._staging[index] = (self.device.empty(n, unit.dtype) if on_device
                                    else aligned_empty(n, unit.dtype, pin=self.device.pin() or None))
        return self._staging[index]

    def commit(self, unit: TierUnit) -> None:
        index = unit.index
        staging = self._staging.get(index)
        if staging is None:
            return  # written in place
        train = unit.split(self._shards[index]).train
        if self.offload:  # device staging -> host shard: done before the next read of the shard
            self._wait_reading(index)
            self.device.wait_host(self.device.to_host(staging, train))
        else:
            self._commits[index] = self.device.to_device(staging, train)

    def replace(self, unit: TierUnit, shard: torch.Tensor) -> None:
        self.flush()
        self._shards[unit.index].copy_(shard)

    def host_copy(self, unit: TierUnit) -> torch.Tensor:
        self.flush()
        return self.device.host(self._shards[unit.index])

    def drop_prefetched(self) -> None:
        """Waits for the copies in flight, then forgets them (their host shards may change)."""
        for index, copy in self._inflight.items():
            self._reading[index] = copy
        self._inflight.clear()
        for index in list(self._reading):
            self._wait_reading(index)

    def set_schedule(self, order: list[int]) -> None:
        pass

    def io_stats(self) -> dict[str, float]:
        return {}  # nothing crosses to NVMe

    def flush(self) -> None:
        for index in list(self._commits):
            self.device.wait_host(self._commits.pop(index))
        self.drop_prefetched()

    def close(self) -> None:
        self.flush()
