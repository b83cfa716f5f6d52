"""Where each unit's compute-dtype parameter shard lives between uses.

`ResidentParams` serves `offload_param.device` none (the shard stays on the compute device) and
cpu (the shard stays in host memory and is copied to the device on a side stream one unit
ahead). The NVMe tier (`infinity.zero.nvme_params`) has the same methods.

[Note: CPU as the device]
Without a GPU the compute device is the CPU: a host shard *is* on the device, so `fetch` hands
out views of the stored tensor, which the unit copies into its own gathered buffer (freed on
release, so the live budget holds on the CPU as on a GPU).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from infinity.io import aligned_empty
from infinity.zero.unit import ShardParts, Unit


class ParamTier(Protocol):
    """What the fetcher and the optimizer need from a parameter tier."""

    def add(self, unit: Unit, values: torch.Tensor) -> None:
        """Takes ownership of the unit's first shard values (fp32, host)."""

    def prefetch(self, unit: Unit) -> bool:
        """Starts moving the shard toward the device and returns at once: True if a transfer
        was issued for the next `fetch`, False if none could be (one pending, or no buffer)."""

    def fetch(self, unit: Unit) -> ShardParts:
        """The shard on the compute device (waits for a prefetch in flight), valid until `done`."""

    def done(self, unit: Unit) -> None:
        """What `fetch` handed out has been copied into the gathered unit: its buffers may go."""

    def drop_prefetched(self) -> None:
        """Forgets prefetches not fetched (the schedule changed, or the step ended)."""

    def set_schedule(self, order: list[int]) -> None:
        """The recorded order of unit uses, for eviction by next use."""

    def flush(self) -> None:
        """Waits for writes of new values in flight; raises if one failed."""

    def update_target(self, unit: Unit) -> torch.Tensor:
        """A host tensor (compute dtype, `train_shard_numel` elements) the optimizer writes the
        new trainable part of the shard into; the frozen part never changes."""

    def commit(self, unit: Unit) -> None:
        """The new values in `update_target(unit)` are final: make them the shard's trainable part."""

    def replace(self, unit: Unit, shard: torch.Tensor) -> None:
        """Makes `shard` (host, compute dtype, both parts) the unit's shard, at once."""

    def host_copy(self, unit: Unit) -> torch.Tensor:
        """A host tensor with the shard's current values (for checkpoints)."""

    def close(self) -> None: ...


class _DeviceCopy(NamedTuple):
    """A host-to-device copy issued on the copy stream, and the event that marks it done."""

    tensor: torch.Tensor
    event: "torch.cuda.Event"


class ResidentParams:
    """Shards kept whole in memory: on the device (offload none) or in host memory (cpu)."""

    def __init__(self, device: torch.device, offload: bool, pin: bool):
        self.device = device
        self.offload = offload and device.type != "cpu"  # host == device without a GPU
        self.pin = pin
        self._shards: dict[int, torch.Tensor] = {}
        self._staging: dict[int, torch.Tensor] = {}  # host buffers for new values of device shards
        self._inflight: dict[int, _DeviceCopy] = {}
        # Copies host -> device for the next unit while the current one computes.
        self._copy_stream = torch.cuda.Stream(device) if self.offload else None

    def add(self, unit: Unit, values: torch.Tensor) -> None:
        if self.offload:
            shard = aligned_empty(unit.shard_numel, unit.dtype, pin=self.pin)
            shard.copy_(values)
        else:
            shard = values.to(device=self.device, dtype=unit.dtype, copy=True)
        self._shards[unit.index] = shard

    def prefetch(self, unit: Unit) -> bool:
        if not self.offload:
            return True  # already on the device
        if unit.index in self._inflight:
            return False
        with torch.profiler.record_function("infinity::h2d"), torch.cuda.stream(self._copy_stream):
            t = self._shards[unit.index].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._inflight[unit.index] = _DeviceCopy(t, event)
        return True

    def fetch(self, unit: Unit) -> ShardParts:
        if not self.offload:
            return unit.split(self._shards[unit.index])
        self.prefetch(unit)
        copy = self._inflight.pop(unit.index)
        torch.cuda.current_stream(self.device).wait_event(copy.event)
        copy.tensor.record_stream(torch.cuda.current_stream(self.device))
        return unit.split(copy.tensor)

    def done(self, unit: Unit) -> None:
        pass  # the device copy dies with its last reference

    def update_target(self, unit: Unit) -> torch.Tensor:
        shard = self._shards[unit.index]
        if shard.device.type == "cpu":
            return unit.split(shard).train
        if unit.index not in self._staging:
            self._staging[unit.index] = aligned_empty(unit.train_shard_numel, unit.dtype, pin=self.pin)
        return self._staging[unit.index]

    def commit(self, unit: Unit) -> None:
        shard = self._shards[unit.index]
        if shard.device.type != "cpu":
            unit.split(shard).train.copy_(self._staging[unit.index], non_blocking=True)

    def replace(self, unit: Unit, shard: torch.Tensor) -> None:
        self._shards[unit.index].copy_(shard)

    def host_copy(self, unit: Unit) -> torch.Tensor:
        return self._shards[unit.index].to("cpu", copy=True)

    def drop_prefetched(self) -> None:
        self._inflight.clear()

    def set_schedule(self, order: list[int]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._inflight.clear()
