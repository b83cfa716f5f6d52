"""How much host memory the offloaded state may use: `max_in_cpu` in both offload sections,
"auto" resolved from the machine's free memory, and which units' optimizer state it holds.

[Note: host memory before the disk]
With `offload_optimizer.device: nvme`, every step reads and writes 24 bytes a trainable
parameter of optimizer state (fp32 master, exp_avg, exp_avg_sq, each way); a unit whose state
stays in host memory moves none of them. `offload_optimizer.max_in_cpu` (elements; infinity's own
key, DeepSpeed has one only for parameters) keeps whole units' state in host memory: every
element kept saves the same 24 bytes a step, so the units kept are chosen to fill the budget,
first-fit in the order the step updates them. The first units updated are the ones whose state
reads the NVMe pipeline can least hide (nothing runs before them to read under), so their
traffic is the first saved. The units kept are updated by the CPU-memory tier, the others by the
NVMe tier (`SplitOptimizerState` in split_optim.py); the numbers are the same, to the bit, as
with everything on NVMe (the same kernel over the same elements).

"auto" in either `max_in_cpu` asks for the budget to be derived from what the host has free at
start: the memory available (/proc/meminfo's MemAvailable) less a margin kept back for
activations, the transfer pools and gradient accumulators not yet allocated, and the rest of
the process (the larger of 2 GiB and a tenth of the machine's memory); where the whole
optimizer state fits without the optimizer's NVMe pool, that pool is not kept back, as no pool
is made (every gradient accumulator is then kept in memory instead). Parameters come first
(2 bytes an element in bf16 save 4 bytes of reads a step, and forward and backward wait for
them), then optimizer state (12 bytes an element save 24). The budget chosen is logged.
"""

from __future__ import annotations

import dataclasses
import logging

import psutil

from infinity.config import InfinityConfig
from infinity.offload.protocols import TierUnit

log = logging.getLogger("infinity")

OPTIMIZER_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq per element
MIN_MARGIN = 2 << 30


def units_in_memory(units: list[TierUnit], budget: int, order: list[int]) -> list[TierUnit]:
    """The units whose optimizer state stays in host memory within `budget` elements: first-fit
    in update `order` ([Note: host memory before the disk])."""
    place = {index: k for k, index in enumerate(order)}
    kept, room = [], budget
    for unit in sorted(units, key=lambda u: place.get(u.index, len(place) + u.index)):
        if unit.train_shard_numel <= room:
            kept.append(unit)
            room -= unit.train_shard_numel
    return kept


def _margin(config: InfinityConfig, units: list[TierUnit], total_memory: int, *, all_kept: bool = False) -> int:
    """Bytes kept back from the memory available: the NVMe pools and gradient accumulators the
    tiers are about to allocate, plus the larger of 2 GiB and a tenth of the machine's memory.
    `all_kept`: every unit's optimizer state in host memory, so no optimizer pool, and every
    gradient accumulator in memory."""
    zero = config.zero
    margin = max(MIN_MARGIN, total_memory // 10)
    largest = max((u.shard_numel for u in units), default=0)
    itemsize = config.compute_dtype.itemsize
    if zero.offload_param.device == "nvme":
        margin += zero.offload_param.buffer_count * max(zero.offload_param.buffer_size, largest) * itemsize
    if zero.offload_optimizer.device == "nvme":
        trainable = sum(u.train_shard_numel for u in units if u.trainable)
        if all_kept:
            return margin + 4 * trainable
        piece = min(max((u.train_shard_numel for u in units), default=0), int(1.5 * zero.sub_group_size))
        margin += max(zero.offload_optimizer.buffer_count, 9) * piece * 4
        margin += 4 * min(trainable, zero.offload_optimizer.max_grad_in_cpu)
    return margin


def resolve_max_in_cpu(config: InfinityConfig, units: list[TierUnit], *, available: int | None = None,
                       total_memory: int | None = None) -> InfinityConfig:
    """`config` with "auto" in either `max_in_cpu` replaced by elements ([Note: host memory
    before the disk]); as it is when neither says "auto"."""
    zero = config.zero
    param_auto = zero.offload_param.max_in_cpu == "auto"
    optim_auto = zero.offload_optimizer.max_in_cpu == "auto"
    if not (param_auto or optim_auto):
        return config
    memory = psutil.virtual_memory()
    available = memory.available if available is None else available
    total_memory = memory.total if total_memory is None else total_memory
    offload_param, offload_optimizer = zero.offload_param, zero.offload_optimizer
    params_wanted = sum(u.shard_numel for u in units) if param_auto and offload_param.device == "nvme" else 0
    state_wanted = sum(u.train_shard_numel for u in units if u.trainable) if offload_optimizer.device == "nvme" else 0
    margin = _margin(config, units, total_memory)
    if optim_auto and state_wanted:
        # Kept whole, the state needs no optimizer pool: the pool's bytes may hold state instead.
        lean = _margin(config, units, total_memory, all_kept=True)
        if params_wanted * config.compute_dtype.itemsize + state_wanted * OPTIMIZER_BYTES <= available - lean:
            margin = lean
    room = max(0, available - margin)
    param_bytes = 0
    if param_auto:
        itemsize = config.compute_dtype.itemsize
        elements = min(params_wanted, room // itemsize)
        param_bytes = elements * itemsize
        offload_param = dataclasses.replace(offload_param, max_in_cpu=elements)
    if optim_auto:
        elements = min(state_wanted, (room - param_bytes) // OPTIMIZER_BYTES)
        offload_optimizer = dataclasses.replace(offload_optimizer, max_in_cpu=elements)
    log.info("infinity: max_in_cpu \"auto\": %.1f GiB of host memory available, %.1f GiB kept back (pools, "
             "gradient accumulators, activations), so offload_param.max_in_cpu %s and offload_optimizer.max_in_cpu "
             "%s elements", available / 2**30, margin / 2**30, offload_param.max_in_cpu,
             offload_optimizer.max_in_cpu)
    zero = dataclasses.replace(zero, offload_param=offload_param, offload_optimizer=offload_optimizer)
    return dataclasses.replace(config, zero=zero)
