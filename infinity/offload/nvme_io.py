"""What both NVMe tiers share: the aio handle an `aio` section describes (or the disk's measured
setting, without one), how few pool buffers keep reads, compute and writes going, and the
per-step tally of their traffic for the report."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from infinity.config import InfinityConfig
from infinity.io import AsyncIOHandle, autotune
from infinity.offload import Swapper

log = logging.getLogger("infinity")

MIN_BUFFERS = 3  # the next unit being read, one read on demand, and one for an update


def elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_count(count: int, minimum: int = MIN_BUFFERS, name: str = "offload_param") -> int:
    if count >= minimum:
        return count
    warnings.warn(f"zero_optimization.{name}.buffer_count: raised from {count} to {minimum}, the fewest "
                  "that keep reads, compute and writes going at once", UserWarning, stacklevel=3)
    return minimum


def make_handle(aio) -> AsyncIOHandle:
    """The I/O handle an `aio` config section describes; its errors name the config key."""
    try:
        return AsyncIOHandle(block_size=aio.block_size, queue_depth=aio.queue_depth, thread_count=aio.thread_count,
                             single_submit=aio.single_submit, overlap_events=aio.overlap_events, engine=aio.engine)
    except ValueError as e:
        raise ValueError(f"aio.{e}") from None


def with_measured_aio(config: InfinityConfig) -> InfinityConfig:
    """`config` with the `aio` setting measured for its NVMe disk when it gives none ([Note: the
    disk tunes itself] in infinity/io/autotune.py); as it is otherwise. The disk measured is the
    optimizer state's when both offloads go to NVMe: it moves 28 of the 32 bytes a parameter
    costs a step."""
    zero = config.zero
    nvme = [o.nvme_path for o in (zero.offload_optimizer, zero.offload_param) if o.device == "nvme"]
    if not config.aio.tune or not nvme:
        return config
    try:
        choice = autotune.choose(str(nvme[0]))
    except OSError as e:  # not a directory it can write into: the store says so, naming the key
        log.info("infinity: aio: %s could not be measured (%s); using the aio section's defaults", nvme[0], e)
        return dataclasses.replace(config, aio=dataclasses.replace(config.aio, tune=False))
    if choice is None:
        log.info("infinity: aio: %s refuses O_DIRECT (tmpfs?), so the disk was not measured; using the aio "
                 "section's defaults", nvme[0])
        return dataclasses.replace(config, aio=dataclasses.replace(config.aio, tune=False))
    log.info("infinity: aio for %s (no aio section in the config): %s", nvme[0], choice.describe())
    aio = dataclasses.replace(config.aio, tune=False, min_request=choice.min_request, **choice.setting.aio_block())
    return dataclasses.replace(config, aio=aio)


class IOTally:
    """A swapper's traffic since the last `take()`, for the per-step report."""

    def __init__(self, swapper: Swapper):
        self._swapper = swapper
        self._mark = swapper.stats

    def take(self) -> dict[str, float]:
        now = self._swapper.stats
        before, self._mark = self._mark, now
        return io_delta("nvme", now, before)


def io_delta(prefix: str, now, before) -> dict[str, float]:
    """The report's figures for one tier between two `Swapper.stats` snapshots: bytes issued in
    each direction, GB/s over the wall time that direction had transfers in flight, seconds the
    compute thread waited, and the overlap fraction: 1 - waited / wall time with any I/O in flight."""
    read_b = now.nvme_to_host.submitted_bytes - before.nvme_to_host.submitted_bytes
    write_b = now.host_to_nvme.submitted_bytes - before.host_to_nvme.submitted_bytes
    done_r = now.nvme_to_host.bytes - before.nvme_to_host.bytes
    done_w = now.host_to_nvme.bytes - before.host_to_nvme.bytes
    busy_r = now.nvme_to_host.busy_seconds - before.nvme_to_host.busy_seconds
    busy_w = now.host_to_nvme.busy_seconds - before.host_to_nvme.busy_seconds
    busy = now.busy_seconds - before.busy_seconds
    waited = (now.nvme_to_host.wait_seconds - before.nvme_to_host.wait_seconds
              + now.host_to_nvme.wait_seconds - before.host_to_nvme.wait_seconds)
    return {
        f"{prefix}_read_bytes": read_b, f"{prefix}_write_bytes": write_b,
        f"{prefix}_read_gbps": done_r / busy_r / 1e9 if busy_r else 0.0,
        f"{prefix}_write_gbps": done_w / busy_w / 1e9 if busy_w else 0.0,
        f"{prefix}_io_seconds": busy, f"{prefix}_wait_seconds": waited,
        "overlap_fraction": max(0.0, 1.0 - waited / busy) if busy else 1.0,
    }
