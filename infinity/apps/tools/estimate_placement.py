"""What each offload choice keeps per rank on the device, in host memory and on NVMe, the NVMe
traffic of its step, and whether it fits a machine: the arithmetic of `infinity estimate`.

[Note: byte accounting]
The figures follow how the engine stores things, per rank, with T trainable and Z frozen
parameter elements sharded over W ranks (t = T/W, z = Z/W):
  * parameter shards: 2 bytes (bf16) a parameter, t + z, in the offload_param tier;
  * trainable parameters only ([Note: frozen parameters] in infinity/zero/unit.py): fp32 master,
    exp_avg, exp_avg_sq (12 t with fp32 moments, 8 t with bf16 ones, about 6 t with 8-bit ones:
    [Note: moment formats] in infinity/optim/formats.py) in the offload_optimizer tier, and a gradient accumulator:
    fp32 (4 t) on the device for "none"; in the compute dtype with one pass a step (2 t, the
    config's default: [Note: one pass keeps its own dtype] in
    infinity/offload/optimizer/accumulators.py) in host memory for "cpu", and in host memory up to
    `max_grad_in_cpu` elements for "nvme", spilled to NVMe beyond ([Note: gradient spill]);
  * the new bf16 values of a shard staged on the optimizer's side when the shard lives on the
    other side (offload_param none with the optimizer offloaded, or cpu with it on the device;
    `ResidentParams.update_target`): 2 t;
  * host buffers that are allocated whole: the offload_param pool (buffer_count plus the
    `max_in_cpu` cache, each buffer as large as the largest shard part), the offload_optimizer
    pool (buffer_count, at least 3 per kind, of the largest sub-group piece in fp32) and two
    landing buffers for gradients on their way to the host (the largest trainable shard, bf16);
  * the device's working set, not sharded: the root unit (embeddings, final norm, LM head:
    gathered for the model's whole forward) and two layer units gathered (the one computing and
    the one gathered ahead), and bf16 gradients: the flat reduce buffer of each unit size and
    autograd's .grad of the unit in backward.
Activations are not counted (they depend on batch, sequence length and checkpointing), nor
the padding of each unit's shard to 4 KiB per rank and per region (a few KiB a unit).
With only a parameter count (--params) the units are assumed equal, P/32 each (--largest-unit),
and the root unit holds what is left over.

[Note: FLOP model]
A step costs 6 FLOPs per trainable parameter and token (forward 2, input gradient 2, weight
gradient 2) and 4 per frozen one (no weight gradient; the input gradient still flows through it,
as through a base model under LoRA): 6 T + 4 Z per token. Activation checkpointing would add a
forward (2 per parameter and token). At the device's assumed throughput this gives the compute
time of a step; the NVMe traffic of a step (parameter shards read in forward and backward,
trainable ones written back; optimizer state read and written; spilled gradients written and
read) over that time is the bandwidth that keeps the disk from being the bottleneck
([Note: one step] in infinity/engine/step_policy.py). Reads served from the max_in_cpu cache are
not subtracted: the figure is an upper bound.

[Note: preference order]
Placements are listed, and the recommendation chosen, by the slowest tier used (none, then cpu,
then nvme), then by how much is offloaded, then with the parameters closer to the device: they
cross the bus in every forward and backward, the optimizer state only once a step.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import NamedTuple

from infinity.config import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from infinity.io import PAGE_SIZE
from infinity.apps.tools.estimate_machine import Machine
from infinity.apps.tools.estimate_model import ModelSize, UnitSize
from infinity.offload.nvme_io import MIN_BUFFERS
from infinity.optim.formats import FORMATS
from infinity.offload.optimizer.sizing import choose_pieces, cut_pieces, piece_buffers

HALF = 2  # bytes of a bf16 element, the compute dtype the recommended config enables
FP32 = 4
TIERS = ("none", "cpu", "nvme")


class Item(NamedTuple):
    """Bytes one rank keeps in one tier for one purpose."""

    tier: str  # "device", "host" or "nvme"
    what: str
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One offload choice: what each tier holds per rank, the NVMe traffic of a step, and the
    zero_optimization block that asks the engine for it."""

    param: str
    optimizer: str
    items: tuple[Item, ...]
    step_nvme_bytes: int
    """Bytes one rank reads and writes on NVMe in a step ([Note: FLOP model])."""
    zero: dict
    moment_format: str = "fp32"  # the optimizer's moments ([Note: moment formats] in infinity/optim/formats.py)

    def tier_bytes(self, tier: str) -> int:
        return sum(i.nbytes for i in self.items if i.tier == tier)

    @property
    def device(self) -> int:
        return self.tier_bytes("device")

    @property
    def host(self) -> int:
        return self.tier_bytes("host")

    @property
    def nvme(self) -> int:
        return self.tier_bytes("nvme")


def _per_rank(numel: int, world: int) -> int:
    return -(-numel // world)


def _page(nbytes: int) -> int:
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def _working_set(model: ModelSize) -> list[Item]:
    """The device's gathered units and bf16 gradients ([Note: byte accounting]), whole units."""
    root, layer = model.root, model.layer if model.num_layers else UnitSize(0, 0)
    tile = max(model.tiles, key=lambda t: t.numel, default=UnitSize(0, 0))
    return [Item("device", "gathered units: root + 2 layers (+ a tile)", HALF * (root.numel + 2 * layer.numel + tile.numel)),
            Item("device", "bf16 gradients: a reduce buffer per unit size, the .grad of a unit",
                 HALF * (root.trainable + layer.trainable + tile.trainable
                         + max(root.trainable, layer.trainable, tile.trainable)))]


def _param_items(model: ModelSize, world: int, param: str, nvme_path: str) -> tuple[list[Item], int, dict]:
    """(items, NVMe bytes a step, offload_param block) of the parameter tier."""
    t, z = _per_rank(model.trainable, world), _per_rank(model.frozen, world)
    shards = HALF * (t + z)
    if param != "nvme":
        tier = "device" if param == "none" else "host"
        return [Item(tier, "bf16 parameter shards", shards)], 0, {"device": param}
    defaults = OffloadParamConfig()
    # A shard is two extents, trainable and frozen ([Note: flat layout] in unit.py); the pool's
    # buffers hold the largest, and a fetch of a unit with both parts takes two.
    parts = [n for u in model.units for n in (_per_rank(u.trainable, world), _per_rank(u.frozen, world)) if n]
    largest = max(parts, default=1)
    per_unit = 2 if any(u.trainable and u.frozen for u in model.units) else 1
    # The pool's least: the engine cuts buffer_count x buffer_size into more buffers of the largest
    # shard where the host's free memory allows ([Note: the pool is a budget] in offload/optimizer/sizing.py).
    count = max(defaults.buffer_count, MIN_BUFFERS, 2 * per_unit)
    cached = min(len(parts), defaults.max_in_cpu // largest)  # max_in_cpu counts elements
    pool = (count + cached) * _page(largest * HALF)
    block = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": count,
             "buffer_size": max(defaults.buffer_size, largest), "max_in_cpu": defaults.max_in_cpu}
    items = [Item("nvme", "bf16 parameter shards", shards),
             Item("host", f"offload_param pool: {count} buffers + {cached} cached", pool)]
    return items, 2 * shards + HALF * t, block  # read in forward and backward, trainable part written


def _optimizer_items(model: ModelSize, world: int, optimizer: str, nvme_path: str,
                     fmt: str = "fp32") -> tuple[list[Item], int, dict]:
    """(items, NVMe bytes a step, offload_optimizer block) of the optimizer tier, its moments in `fmt`."""
    t = _per_rank(model.trainable, world)
    state = round((FP32 + 2 * FORMATS[fmt].bytes_per_value()) * t)  # the master and Adam's two moments
    what = f"fp32 master + exp_avg + exp_avg_sq ({fmt} moments)"
    trains = [_per_rank(u.trainable, world) for u in model.units if u.trainable]  # backward order
    landing = Item("host", "gradient landing buffers", 2 * _page(HALF * max(trains, default=0)))
    if optimizer != "nvme":
        tier = "device" if optimizer == "none" else "host"
        if optimizer == "cpu":  # one pass a step (the config's default): [Note: one pass keeps its own dtype]
            grads = Item(tier, "gradient accumulators (bf16: one pass a step)", HALF * t)
        else:  # on the device, where torch ops read them
            grads = Item(tier, "fp32 gradient accumulators", FP32 * t)
        items = [Item(tier, what, state), grads]
        return items + ([landing] if optimizer == "cpu" else []), 0, {"device": optimizer}
    defaults, zero = OffloadOptimizerConfig(), ZeroConfig()
    room, spilled = defaults.max_grad_in_cpu, 0
    for n in trains:  # accumulators in host memory in backward order while max_grad_in_cpu lasts
        if n <= room:
            room -= n
        else:
            spilled += n
    per_piece, kept = piece_buffers(2, FORMATS[fmt].bytes_per_value(), bool(spilled))  # Adam's two moments
    asked = max(defaults.buffer_count, math.ceil(3 * per_piece))  # the knob; the engine cuts its bytes into `count` buffers
    # The pipeline's least pool: the engine grows it into what the knobs allow of the host's free
    # memory when it is built ([Note: the pool is a budget] in offload/optimizer/sizing.py), its
    # buffers counted in fp32 ones of the largest piece ([Note: two sizes of buffer] in offload/pool.py).
    target, count = choose_pieces(trains, zero.sub_group_size, asked, per_piece, host_elements=1, kinds=kept)
    piece = max((n for t in trains for _, n in cut_pieces(t, target)), default=1)  # [Note: the pool is a budget]
    items = [Item("nvme", what, state),
             # one pass an accumulation (the config's default) keeps and spills bf16 ([Note: one pass
             # keeps its own dtype] in offload/optimizer/accumulators.py); accumulated passes, fp32
             Item("host", "gradient accumulators (bf16: one pass a step)", HALF * (t - spilled)),
             Item("nvme", "spilled gradients (bf16: one pass a step)", HALF * spilled),
             Item("host", f"offload_optimizer pool: {count:g} buffers' worth", round(count * _page(FP32 * piece))),
             landing]
    step = 2 * state + 2 * HALF * spilled  # state read and written; spill written and read
    return items, step, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": asked}


def _staging(model: ModelSize, world: int, param: str, optimizer: str) -> list[Item]:
    """New bf16 values staged on the optimizer's side of the bus (`ResidentParams.update_target`)."""
    t = _per_rank(model.trainable, world)
    if param == "none" and optimizer != "none":
        return [Item("host", "bf16 staging for device shards", HALF * t)]
    if param == "cpu" and optimizer == "none":
        return [Item("device", "bf16 staging for host shards", HALF * t)]
    return []


def _preference(param: str, optimizer: str) -> tuple[int, int, int]:
    """[Note: preference order]."""
    p, o = TIERS.index(param), TIERS.index(optimizer)
    return max(p, o), p + o, p


def placements(model: ModelSize, world: int, nvme_path: str, fmt: str = "fp32") -> list[Placement]:
    """Every offload choice for ZeRO stage 3, in the order of preference, with moments in `fmt`."""
    out = []
    for param, optimizer in sorted(((p, o) for p in TIERS for o in TIERS), key=lambda po: _preference(*po)):
        param_items, param_io, param_block = _param_items(model, world, param, nvme_path)
        optim_items, optim_io, optim_block = _optimizer_items(model, world, optimizer, nvme_path, fmt)
        items = _working_set(model) + param_items + optim_items + _staging(model, world, param, optimizer)
        zero = {"stage": 3, "offload_param": param_block, "offload_optimizer": optim_block}
        if optimizer == "nvme":
            zero["sub_group_size"] = ZeroConfig().sub_group_size
        out.append(Placement(param=param, optimizer=optimizer, items=tuple(i for i in items if i.nbytes),
                             step_nvme_bytes=param_io + optim_io, zero=zero, moment_format=fmt))
    return out


def shortfalls(p: Placement, machine: Machine) -> list[str]:
    """The tiers `p` does not fit in on `machine` (empty: it fits). Host memory and the NVMe drive
    are shared by the node's ranks; on a CPU-only machine the device is host memory too."""
    short = []
    if machine.gpus == 0:
        if p.device + p.host > machine.cpu_bytes:
            short.append("memory")
    else:
        if machine.gpu_bytes is not None and p.device > machine.gpu_bytes:
            short.append("device")
        if machine.world * p.host > machine.cpu_bytes:
            short.append("host")
    if machine.world * p.nvme > machine.nvme_free:
        short.append("nvme")
    return short


def step_flops(model: ModelSize, tokens: int) -> float:
    """[Note: FLOP model]: 6 per trainable and 4 per frozen parameter, per token."""
    return tokens * (6.0 * model.trainable + 4.0 * model.frozen)


def nvme_gbps_needed(p: Placement, model: ModelSize, machine: Machine, tokens: int) -> float:
    """GB/s the node's NVMe must sustain for its traffic to take no longer than the step's compute."""
    compute_s = step_flops(model, tokens) / (machine.world * machine.tflops * 1e12)
    return machine.world * p.step_nvme_bytes / compute_s / 1e9


def recommend(options: list[Placement], machine: Machine) -> Placement | None:
    """The first placement, in the order of preference, that fits the machine."""
    return next((p for p in options if not shortfalls(p, machine)), None)


def config_block(p: Placement) -> dict:
    """The part of a DeepSpeed config that asks for placement `p`."""
    block = {"bf16": {"enabled": True}, "zero_optimization": p.zero}
    if p.moment_format != "fp32":
        block["optimizer"] = {"type": "AdamW", "params": {"moment_format": p.moment_format}}
    return block
