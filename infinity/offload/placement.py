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
activations, the parameters' transfer pool and gradient accumulators not yet allocated, and the
rest of the process (the larger of 2 GiB and a tenth of the machine's memory). Parameters come
first (2 bytes an element in bf16 save 4 bytes of reads a step, and forward and backward wait for
them), then optimizer state (12 bytes an element save 24). Where the whole optimizer state fits,
it all stays in host memory (no NVMe tier, no pool, every gradient accumulator in memory).
Where it does not, the room is used one of two ways, whichever leaves fewer elements of state to
stream each step (`streamed_elements`, from the same sizing the tier uses): whole units kept in
host memory beside the NVMe tier's pool as the knobs size it, or no unit kept whole and the room
given to the pool (`pool_elements`), which holds as many pieces from step to step as its bytes
allow ([Note: the pool is a budget] in optimizer/sizing.py). Keeping units beside a pool the
knobs left short made the 134M GPT move 375 MB a step where `max_in_cpu` 0 moved 223 MB (a pool
with the room holds pieces of every unit); with a few large units and a pool whose streaming
buffers would take most of the room, keeping units whole moves less. Either way "auto" moves no
more than 0: the room's pool has the knobs' bytes at least. The budget chosen is logged and kept
in `engine.chosen`.
"""

from __future__ import annotations

import dataclasses
import logging

import psutil

from infinity.config import InfinityConfig
from infinity.offload.optimizer.sizing import (host_elements, piece_buffers, pool_bytes, streamed_elements,
                                               streamed_floor, units_streaming)
from infinity.optim.rules import AdamRule
from infinity.offload.protocols import TierUnit

log = logging.getLogger("infinity")

OPTIMIZER_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq per element: AdamW's with fp32 moments
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


def _state_bytes(rule) -> float:
    """Bytes of optimizer state an element under `rule`: its fp32 master and its moments in their
    format ([Note: moment formats] in infinity/optim/formats.py)."""
    return 4 + len(rule.moments) * rule.format.bytes_per_value()


def _margin(config: InfinityConfig, units: list[TierUnit], total_memory: int, available: int, *,
            all_kept: bool = False, rule=None, streaming: int = 1) -> int:
    """Bytes kept back from the memory available: the pools and gradient accumulators the tiers
    are about to allocate, plus the larger of 2 GiB and a tenth of the machine's memory.
    `all_kept`: every unit's optimizer state in host memory, so no optimizer pool and every
    gradient accumulator in memory. With optimizer max_in_cpu "auto" the optimizer's pool is not
    kept back: it takes what remains (`resolve_max_in_cpu`). `rule`: the optimizer's (AdamW's
    with fp32 moments if None); `streaming`: `units_streaming` of the step's update mode."""
    zero, rule = config.zero, rule or AdamRule()
    margin = max(MIN_MARGIN, total_memory // 10)
    largest = max((u.shard_numel for u in units), default=0)
    itemsize = config.compute_dtype.itemsize
    if zero.offload_param.device == "nvme":
        margin += zero.offload_param.buffer_count * max(zero.offload_param.buffer_size, largest) * itemsize
    offload = zero.offload_optimizer
    if offload.device == "nvme":
        trains = [u.train_shard_numel for u in units if u.trainable]
        grads = sum(trains) if all_kept else min(sum(trains), offload.max_grad_in_cpu)
        # [Note: one pass keeps its own dtype] in offload/optimizer/accumulators.py
        margin += (itemsize if config.batch.gradient_accumulation_steps == 1 else 4) * grads
        if not all_kept and offload.max_in_cpu != "auto":  # the knobs' pool, as the tier will size it
            piece = piece_buffers(len(rule.moments), rule.format.bytes_per_value(), grads < sum(trains))
            margin += pool_bytes(trains, zero.sub_group_size, offload.buffer_count, piece,
                                 host_elements(available), min_streamed=streamed_floor(config.aio.min_request),
                                 streaming=streaming)
    return margin


def _optimizer_in_memory(config: InfinityConfig, units: list[TierUnit], room: int, available: int,
                         rule, streaming: int) -> tuple[int, int | None]:
    """(max_in_cpu, pool_elements) for optimizer state larger than `room` bytes of host memory:
    whole units kept there beside the knobs' pool, or the room given to the pool; whichever
    leaves fewer elements to stream each step ([Note: host memory before the disk])."""
    zero, offload = config.zero, config.zero.offload_optimizer
    shards = [u.train_shard_numel for u in units if u.trainable]
    if not shards or room <= 0:
        return 0, None
    piece = piece_buffers(len(rule.moments), rule.format.bytes_per_value(), sum(shards) > offload.max_grad_in_cpu)
    host, floor = host_elements(available), streamed_floor(config.aio.min_request)
    knobs = pool_bytes(shards, zero.sub_group_size, offload.buffer_count, piece, host, min_streamed=floor,
                       streaming=streaming)
    budget = int(max(0, room - knobs) // _state_bytes(rule))
    kept = units_in_memory([u for u in units if u.trainable], budget, [u.index for u in reversed(units)])
    rest = [u.train_shard_numel for u in units if u.trainable and u not in kept]
    split = streamed_elements(rest, zero.sub_group_size, offload.buffer_count, piece, host, min_streamed=floor,
                              streaming=streaming)
    pooled = streamed_elements(shards, zero.sub_group_size, offload.buffer_count, piece, host,
                               planned=room // 4, min_streamed=floor, streaming=streaming)
    return (budget, None) if kept and split < pooled else (0, room // 4)


def resolve_max_in_cpu(config: InfinityConfig, units: list[TierUnit], *, available: int | None = None,
                       total_memory: int | None = None, rule=None, in_backward: bool = False) -> InfinityConfig:
    """`config` with "auto" in either `max_in_cpu` replaced by elements ([Note: host memory
    before the disk]); as it is when neither says "auto". `rule`: the optimizer's update rule,
    whose moments' format sizes the state (AdamW's with fp32 moments if None); `in_backward`:
    the updates run in backward ([Note: update modes] in infinity/engine/step_policy.py)."""
    zero, rule, streaming = config.zero, rule or AdamRule(), units_streaming(in_backward)
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
    margin = _margin(config, units, total_memory, available, rule=rule, streaming=streaming)
    whole = False  # the whole optimizer state stays in host memory
    if optim_auto and state_wanted:
        lean = _margin(config, units, total_memory, available, all_kept=True, rule=rule)
        whole = params_wanted * config.compute_dtype.itemsize + state_wanted * _state_bytes(rule) <= available - lean
        if whole:
            margin = lean
    room = max(0, available - margin)
    param_bytes = 0
    if param_auto:
        itemsize = config.compute_dtype.itemsize
        elements = min(params_wanted, room // itemsize)
        param_bytes = elements * itemsize
        offload_param = dataclasses.replace(offload_param, max_in_cpu=elements)
    if optim_auto:
        kept, pool = (state_wanted, None) if whole else _optimizer_in_memory(config, units, room - param_bytes,
                                                                             available, rule, streaming)
        offload_optimizer = dataclasses.replace(offload_optimizer, max_in_cpu=kept, pool_elements=pool)
    log.info("infinity: max_in_cpu \"auto\": %.1f GiB of host memory available, %.1f GiB kept back (parameter "
             "pool, gradient accumulators, activations), so offload_param.max_in_cpu %s and "
             "offload_optimizer.max_in_cpu %s elements%s", available / 2**30, margin / 2**30,
             offload_param.max_in_cpu, offload_optimizer.max_in_cpu,
             "" if offload_optimizer.pool_elements is None else
             f", and the optimizer's NVMe pool up to {offload_optimizer.pool_elements * 4 / 2**30:.1f} GiB")
    zero = dataclasses.replace(zero, offload_param=offload_param, offload_optimizer=offload_optimizer)
    return dataclasses.replace(config, zero=zero)
