"""`infinity estimate`: what fits where, before a job is started.

    infinity estimate --params 70B --gpus 8 --gpu-mem 80G --cpu-mem 1T --nvme-free 8T --nvme-gbps 12
    infinity estimate --model llama-3b                 # this machine's memory and disk
    infinity estimate --model /models/Llama-3.1-8B --lora 16

For each offload choice (offload_param x offload_optimizer in {none, cpu, nvme}, all ZeRO stage
3, bf16, Adam) it prints the bytes one rank keeps on the device, in host memory and on NVMe,
whether that fits the machine, the NVMe bandwidth that keeps a step compute-bound, and the
`zero_optimization` block of the cheapest placement that fits, ready to paste.

[Note: byte accounting]
The figures follow how the engine stores things, per rank, with T trainable and Z frozen
parameter elements sharded over W ranks (t = T/W, z = Z/W):
  * parameter shards: 2 bytes (bf16) a parameter, t + z, in the offload_param tier;
  * trainable parameters only ([Note: frozen parameters] in infinity/zero/unit.py): fp32 master,
    exp_avg, exp_avg_sq (12 t) in the offload_optimizer tier, and an fp32 gradient accumulator
    (4 t): on the device for "none", in host memory for "cpu", in host memory up to
    `max_grad_in_cpu` elements for "nvme" and spilled to NVMe beyond ([Note: gradient spill] in
    infinity/offload/optimizer/nvme.py);
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

[Note: the peak of a finetune step]
On a CPU-only machine the device is the host, so everything a step holds is host memory, and
the estimate adds up what `infinity finetune`'s built-in config makes the engine hold ([Note: the
built-in config's host budget] in infinity/apps/finetune.py): the process itself (measured in the
estimate's own process, which has imported the same), the parameter pool and the optimizer
pool as the engine sizes them for this model, the fp32 gradient accumulators it keeps in memory,
two units gathered, one unit's gradients in backward, and the activations twice: autograd's
saved tensors (measured by running the model's shapes on the meta device, which allocates and
computes nothing) and, during backward, their gradients and what the allocator keeps of them.
Checked against /usr/bin/time's peak RSS of the recorded runs (bench/results/finetune_large.md)
and the `slow` test. Only the model enters through the largest unit and the activations.

[Note: preference order]
Placements are listed, and the recommendation chosen, by the slowest tier used (none, then cpu,
then nvme), then by how much is offloaded, then with the parameters closer to the device: they
cross the bus in every forward and backward, the optimizer state only once a step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple

import psutil
import torch

from infinity.config import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from infinity.device import gpu_memory
from infinity.io import PAGE_SIZE
from infinity.apps.models.presets import (
    SHAPE_KEYS,
    layer_linears,
    layer_param_count,
    preset,
    root_param_count,
)
from infinity.offload._messages import human_bytes
from infinity.offload.nvme_io import MIN_BUFFERS
from infinity.offload.optimizer.nvme import KINDS, choose_pieces, cut_pieces

HALF = 2  # bytes of a bf16 element, the compute dtype the recommended config enables
FP32 = 4
TIERS = ("none", "cpu", "nvme")
DEFAULT_GPU_TFLOPS = 100.0  # achieved per GPU in bf16 training, not the data sheet's peak
DEFAULT_UNITS = 32  # --params alone: units assumed P/32 each
TOKENS_PER_RANK = 16384  # default tokens per step and rank: 8 sequences of 2048
_COUNT_SUFFIXES = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


# ---- what is being trained ----------------------------------------------------------------------


class UnitSize(NamedTuple):
    """Parameter elements of one unit, whole (not sharded)."""

    trainable: int
    frozen: int

    @property
    def numel(self) -> int:
        return self.trainable + self.frozen


def _split(numel: int, frozen_fraction: float) -> UnitSize:
    frozen = round(numel * frozen_fraction)
    return UnitSize(numel - frozen, frozen)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    """What the estimate needs to know of a model: its units ([Note: choosing units] in
    infinity/zero/partitioner.py), each split into trainable and frozen elements."""

    name: str
    """What the user named: a preset or a model directory; empty for a parameter count."""
    layer: UnitSize
    """Each of the `num_layers` equal units (the decoder layers)."""
    num_layers: int
    root: UnitSize
    """What no layer holds: embeddings, final norm, LM head (less their tiles)."""
    exact: bool
    """Units from an architecture; False: assumed from a parameter count."""
    tiles: tuple[UnitSize, ...] = ()
    """Weights over `zero_optimization.tile_size`, as the engine tiles them ([Note: memory-centric
    tiling] in infinity/zero/tiling.py): each tile a unit of its own, taken out of its layer or root."""

    @property
    def units(self) -> list[UnitSize]:
        """Every unit with parameters, in backward order (the root, the tiles, then the last layer first)."""
        return [u for u in [self.root, *self.tiles] + [self.layer] * self.num_layers if u.numel]

    @property
    def trainable(self) -> int:
        return self.num_layers * self.layer.trainable + self.root.trainable + sum(t.trainable for t in self.tiles)

    @property
    def frozen(self) -> int:
        return self.num_layers * self.layer.frozen + self.root.frozen + sum(t.frozen for t in self.tiles)

    @property
    def numel(self) -> int:
        return self.trainable + self.frozen


def model_from_count(params: int, largest_unit: int | None = None, frozen_fraction: float = 0.0) -> ModelSize:
    """A model known by its parameter count only: units of `largest_unit` elements (default
    params/32), the remainder in the root unit; `frozen_fraction` of every unit frozen."""
    unit = largest_unit or -(-params // DEFAULT_UNITS)
    layers = params // unit
    return ModelSize(name="", layer=_split(unit, frozen_fraction), num_layers=layers,
                     root=_split(params - layers * unit, frozen_fraction), exact=False)


def lora_param_count(cfg: dict, rank: int) -> int:
    """LoRA adapter elements of one decoder layer: A (rank x in) and B (out x rank) on each of
    q, k, v, o, gate, up and down (PEFT's layout, no bias)."""
    return rank * sum(n_in + n_out for n_in, n_out in layer_linears(cfg).values())


def model_from_config(name: str, cfg: dict, lora_rank: int | None = None, frozen_fraction: float = 0.0) -> ModelSize:
    """A Llama-style model from its config: decoder layers and the root unit. `lora_rank`: only
    adapters of that rank are trainable, the base model is frozen; else `frozen_fraction` of
    every unit is frozen."""
    tile = ZeroConfig().tile_size
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    # (rows, columns) of the weights the engine tiles: the embedding and an untied head, and a
    # layer's projections over the tile size (under LoRA too: the wrapped projection is a child)
    roots = [(vocab, h)] * (1 if cfg.get("tie_word_embeddings", False) else 2)
    linears = [(n_out, n_in) for n_in, n_out in layer_linears(cfg).values()]
    root_tiled = [w for w in roots if tile and w[0] * w[1] > tile]
    layer_tiled = [w for w in linears if tile and w[0] * w[1] > tile]
    layer = layer_param_count(cfg) - sum(r * c for r, c in layer_tiled)
    root = root_param_count(cfg) - sum(r * c for r, c in root_tiled)
    tiles = [n for r, c in root_tiled for n in _tile_sizes(r, c, tile)]
    layer_tiles = [n for r, c in layer_tiled for n in _tile_sizes(r, c, tile)] * cfg["num_hidden_layers"]
    if lora_rank:
        layer_size, root_size = UnitSize(lora_param_count(cfg, lora_rank), layer), UnitSize(0, root)
        tile_sizes = tuple(UnitSize(0, n) for n in tiles + layer_tiles)
    else:
        layer_size, root_size = _split(layer, frozen_fraction), _split(root, frozen_fraction)
        tile_sizes = tuple(_split(n, frozen_fraction) for n in tiles + layer_tiles)
    return ModelSize(name=name, layer=layer_size, num_layers=cfg["num_hidden_layers"], root=root_size, exact=True,
                     tiles=tile_sizes)


def _tile_sizes(rows: int, cols: int, tile_size: int) -> list[int]:
    """Elements of each row tile of a rows x cols weight (the tiler's cut: whole rows, at most
    `tile_size` elements a tile)."""
    per = max(1, tile_size // cols)
    return [min(per, rows - r) * cols for r in range(0, rows, per)]


def load_architecture(spec: str) -> tuple[str, dict]:
    """(name, LlamaConfig keys) of a Hugging Face model directory (its config.json, read as
    JSON: no model code runs), a config.json itself, or a preset name."""
    path = spec if spec.endswith(".json") else os.path.join(spec, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object")
        bad = [k for k in SHAPE_KEYS if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int)
               or cfg[k] < 1]
        if bad:
            raise ValueError(f"{path}: not a Llama-style config: expected positive integers for {', '.join(bad)}")
        return spec, cfg
    if os.path.isdir(spec):
        raise ValueError(f"{spec}: a directory without config.json")
    if os.sep in spec or spec.endswith(".json"):
        raise ValueError(f"{spec}: no such file or directory")
    try:
        return spec, preset(spec)
    except ValueError as e:
        raise ValueError(f"{e}; or a Hugging Face model directory with a config.json") from None


# ---- the machine --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """One node: its GPUs, memory and NVMe drive."""

    gpus: int
    """GPUs, one rank each; 0: a CPU-only machine (one rank; the CPU is the device)."""
    gpu_bytes: int | None
    """Memory of each GPU; None: not known, the device is not checked."""
    cpu_bytes: int
    """Host memory, shared by the node's ranks (and on a CPU-only machine by the device)."""
    nvme_free: int
    """Free bytes under nvme_path, shared by the node's ranks."""
    nvme_path: str
    nvme_gbps: float | None
    """Sustained NVMe bandwidth of the node (GB/s); None: not known."""
    tflops: float
    """Achieved compute throughput of one device (TFLOP/s)."""
    described: tuple[str, ...] = ()
    """Where the figures came from, for the header (e.g. "host memory read here")."""

    @property
    def world(self) -> int:
        return max(1, self.gpus)


def measure_cpu_tflops(seconds: float = 0.2) -> float:
    """bf16 matmul throughput of this CPU with torch's threads (TFLOP/s), timed for `seconds`."""
    n = 1024
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm-up: thread pool, kernel choice
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * n ** 3 * count / elapsed / 1e12


def machine_from_args(args: argparse.Namespace) -> Machine:
    """The machine the arguments describe; what they leave out is read from this one."""
    notes = []
    gpus = args.gpus
    if gpus is None:
        gpus = 1 if args.gpu_mem else len(gpu_memory())
        if not args.gpu_mem:
            notes.append(f"{gpus} GPUs found here" if gpus else "no GPU here: a CPU-only machine")
    gpu_bytes = args.gpu_mem
    if gpus and gpu_bytes is None and gpu_memory():
        gpu_bytes = min(gpu_memory())
        notes.append("GPU memory read here")
    cpu_bytes = args.cpu_mem
    if cpu_bytes is None:
        cpu_bytes = psutil.virtual_memory().total
        notes.append("host memory read here")
    nvme_free = args.nvme_free
    if nvme_free is None:
        nvme_free = shutil.disk_usage(args.nvme_path).free
        notes.append(f"free space of {args.nvme_path} read here")
    tflops = args.tflops
    if tflops is None:
        if gpus:
            tflops = DEFAULT_GPU_TFLOPS
            notes.append(f"{tflops:g} TFLOP/s per GPU assumed (--tflops)")
        else:
            tflops = measure_cpu_tflops()
            notes.append(f"{tflops:.3g} TFLOP/s measured on this CPU in a bf16 matmul (--tflops)")
    return Machine(gpus=gpus, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, nvme_free=nvme_free, nvme_path=args.nvme_path,
                   nvme_gbps=args.nvme_gbps, tflops=tflops, described=tuple(notes))


# ---- placements ---------------------------------------------------------------------------------


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
    # shard where the host's free memory allows ([Note: the pool is a budget] in offload/optimizer/nvme.py).
    count = max(defaults.buffer_count, MIN_BUFFERS, 2 * per_unit)
    cached = min(len(parts), defaults.max_in_cpu // largest)  # max_in_cpu counts elements
    pool = (count + cached) * _page(largest * HALF)
    block = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": count,
             "buffer_size": max(defaults.buffer_size, largest), "max_in_cpu": defaults.max_in_cpu}
    items = [Item("nvme", "bf16 parameter shards", shards),
             Item("host", f"offload_param pool: {count} buffers + {cached} cached", pool)]
    return items, 2 * shards + HALF * t, block  # read in forward and backward, trainable part written


def _optimizer_items(model: ModelSize, world: int, optimizer: str, nvme_path: str) -> tuple[list[Item], int, dict]:
    """(items, NVMe bytes a step, offload_optimizer block) of the optimizer tier."""
    t = _per_rank(model.trainable, world)
    trains = [_per_rank(u.trainable, world) for u in model.units if u.trainable]  # backward order
    landing = Item("host", "gradient landing buffers", 2 * _page(HALF * max(trains, default=0)))
    if optimizer != "nvme":
        tier = "device" if optimizer == "none" else "host"
        items = [Item(tier, "fp32 master + exp_avg + exp_avg_sq", len(KINDS) * FP32 * t),
                 Item(tier, "fp32 gradient accumulators", FP32 * t)]
        return items + ([landing] if optimizer == "cpu" else []), 0, {"device": optimizer}
    defaults, zero = OffloadOptimizerConfig(), ZeroConfig()
    room, spilled = defaults.max_grad_in_cpu, 0
    for n in trains:  # accumulators in host memory in backward order while max_grad_in_cpu lasts
        if n <= room:
            room -= n
        else:
            spilled += n
    per_piece = len(KINDS) + (1 if spilled else 0)
    asked = max(defaults.buffer_count, 3 * per_piece)  # the knob; the engine cuts its bytes into `count` buffers
    # The pipeline's least pool: the engine grows it into what the knobs allow of the host's free
    # memory when it is built ([Note: the pool is a budget] in offload/optimizer/nvme.py).
    target, count = choose_pieces(trains, zero.sub_group_size, asked, per_piece, host_elements=1)
    piece = max((n for t in trains for _, n in cut_pieces(t, target)), default=1)  # [Note: the pool is a budget]
    items = [Item("nvme", "fp32 master + exp_avg + exp_avg_sq", len(KINDS) * FP32 * t),
             Item("host", "fp32 gradient accumulators", FP32 * (t - spilled)),
             Item("nvme", "spilled fp32 gradient accumulators", FP32 * spilled),
             Item("host", f"offload_optimizer pool: {count} buffers", count * _page(FP32 * piece)), landing]
    step = 2 * len(KINDS) * FP32 * t + 2 * FP32 * spilled  # state read and written; spill written and read
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


def placements(model: ModelSize, world: int, nvme_path: str) -> list[Placement]:
    """Every offload choice for ZeRO stage 3, in the order of preference."""
    out = []
    for param, optimizer in sorted(((p, o) for p in TIERS for o in TIERS), key=lambda po: _preference(*po)):
        param_items, param_io, param_block = _param_items(model, world, param, nvme_path)
        optim_items, optim_io, optim_block = _optimizer_items(model, world, optimizer, nvme_path)
        items = _working_set(model) + param_items + optim_items + _staging(model, world, param, optimizer)
        zero = {"stage": 3, "offload_param": param_block, "offload_optimizer": optim_block}
        if optimizer == "nvme":
            zero["sub_group_size"] = ZeroConfig().sub_group_size
        out.append(Placement(param=param, optimizer=optimizer, items=tuple(i for i in items if i.nbytes),
                             step_nvme_bytes=param_io + optim_io, zero=zero))
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
    return {"bf16": {"enabled": True}, "zero_optimization": p.zero}


# ---- the report ---------------------------------------------------------------------------------


def _count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def _describe_model(model: ModelSize) -> str:
    what = (f"{model.name + ': ' if model.name else ''}{_count(model.numel)} parameters "
            f"({_count(model.trainable)} trainable, {_count(model.frozen)} frozen)")
    layer = _count(model.layer.numel)
    if model.exact:
        tiles = (f" + {len(model.tiles)} tiles of at most {_count(max(t.numel for t in model.tiles))}"
                 if model.tiles else "")
        return f"{what}; units: {model.num_layers} layers of {layer} + root {_count(model.root.numel)}{tiles}"
    return f"{what}; units assumed: {model.num_layers} of {layer} (--largest-unit; --model knows them)"


def _describe_machine(m: Machine) -> str:
    if m.gpus == 0:
        device = "CPU only: the CPU computes, device and host share"
        memory = f"{human_bytes(m.cpu_bytes)} of memory"
    else:
        gpu = human_bytes(m.gpu_bytes) if m.gpu_bytes is not None else "unknown memory (not checked: --gpu-mem)"
        device = f"1 GPU of {gpu};" if m.gpus == 1 else f"{m.gpus} GPUs of {gpu}, a rank each;"
        memory = f"host memory {human_bytes(m.cpu_bytes)}"
    gbps = f", {m.nvme_gbps:g} GB/s" if m.nvme_gbps else ""
    return f"machine: {device} {memory}; NVMe {human_bytes(m.nvme_free)} free under {m.nvme_path}{gbps}"


def _table(options: list[Placement], model: ModelSize, machine: Machine, tokens: int) -> list[str]:
    head = (f"{'offload_param':<14} {'offload_optimizer':<18}{'device':>11}{'host':>11}{'NVMe':>11}  "
            f"{'fits':<16}{'NVMe GB/s for compute-bound':>28}")
    lines = [head, "-" * len(head)]
    for p in options:
        short = shortfalls(p, machine)
        fits = "yes" if not short else "no: " + ", ".join(short)
        need = ""
        if p.step_nvme_bytes and model.numel:
            gbps = nvme_gbps_needed(p, model, machine, tokens)
            need = f"{gbps:.3g}"
            if machine.nvme_gbps:
                need += " (ok)" if gbps <= machine.nvme_gbps else f" (I/O-bound x{gbps / machine.nvme_gbps:.3g})"
        lines.append(f"{p.param:<14} {p.optimizer:<18}{human_bytes(p.device):>11}{human_bytes(p.host):>11}"
                     f"{human_bytes(p.nvme):>11}  {fits:<16}{need:>28}".rstrip())
    return lines


NOTES = (
    ("device: the gathered units (root + 2 layers) and their bf16 gradients, plus what the row places there; "
     "activations come on top"),
    ("host and NVMe are the node's, shared by its ranks: a row fits when ranks x per-rank bytes fit; no headroom "
     "is kept"),
    "host includes the pinned pools of NVMe placements, sized as the recommended block sizes them",
    ("offload_optimizer nvme: fp32 gradient accumulators (for clipping, fp16 or accumulation) stay in host memory "
     "up to max_grad_in_cpu elements, the rest spill to NVMe; its pool holds 9 (12 with spills) pieces of about "
     "sub_group_size fp32 elements: a smaller sub_group_size shrinks it"),
)


def report(model: ModelSize, machine: Machine, tokens: int, finetune: list[tuple[str, int]] | None = None) -> str:
    """The whole printout: header, table, recommendation (a JSON block), `infinity finetune`'s
    peak (`finetune_host_peak`, where given), notes."""
    options = placements(model, machine.world, machine.nvme_path)
    flops = step_flops(model, tokens)
    unit = "GPU" if machine.gpus else "CPU"
    lines = [f"model: {_describe_model(model)}", _describe_machine(machine)]
    if machine.described:
        lines.append("  figures not given: " + "; ".join(machine.described))
    seconds = flops / (machine.world * machine.tflops * 1e12)
    lines.append(f"step: {tokens:,} tokens x (6 x trainable + 4 x frozen) = {flops:.3g} FLOPs; at "
                 f"{machine.tflops:.3g} TFLOP/s per {unit}: {seconds:.3g} s of compute")
    lines += [f"bytes per rank (world size {machine.world}), ZeRO stage 3, bf16, Adam; activations not counted:", ""]
    lines += _table(options, model, machine, tokens)
    best = recommend(options, machine)
    lines.append("")
    if best is None:
        lines.append("nothing fits this machine: more GPUs (--gpus) shard every tier, --lora or --frozen-fraction "
                     "leave fewer parameters with optimizer state, a smaller sub_group_size shrinks the host pools")
    else:
        lines.append(f"recommended: offload_param {best.param}, offload_optimizer {best.optimizer} "
                     "(the first row that fits; rows in order of preference)")
        lines.append(json.dumps(config_block(best), indent=2))
    if finetune:
        total = sum(n for _, n in finetune)
        fits = "fits" if total <= machine.cpu_bytes else "does not fit"
        lines += ["", f"infinity finetune with its built-in config (params and optimizer on NVMe), {tokens:,} tokens a "
                      f"step: peak host memory about {human_bytes(total)} ({fits} in {human_bytes(machine.cpu_bytes)}):"]
        lines += [f"  {human_bytes(n):>10}  {what}" for what, n in finetune]
    lines += ["", "notes:", *(f"  {note}" for note in NOTES)]
    return "\n".join(lines)


# ---- infinity finetune's built-in config ---------------------------------------------------------


def activation_bytes(cfg: dict, tokens: int, lora_rank: int | None = None) -> int:
    """What autograd saves for backward in a bf16 step of infinity's Llama with `cfg`'s shapes
    on `tokens` tokens (one sequence), parameters excluded: the model is run on the meta device
    (shapes only, no memory, no arithmetic) at one and two layers, and the tensors autograd
    packs are summed by storage; the second layer's share is multiplied by the depth."""
    from infinity.apps.finetune import add_lora
    from infinity.apps.models.llama import Llama

    def saved(layers: int) -> int:
        with torch.device("meta"):
            model = Llama({**cfg, "num_hidden_layers": layers}).to(torch.bfloat16)
        if lora_rank:
            add_lora(model, lora_rank)
            model.to("meta")
        params = {p.untyped_storage()._cdata for p in model.parameters()}  # noqa: SLF001
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata  # noqa: SLF001
            if key not in params:
                storages[key] = t.untyped_storage().nbytes()
            return t

        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, ids)
        return sum(storages.values())

    one, two = saved(1), saved(2)
    return one + (two - one) * (cfg["num_hidden_layers"] - 1)


def finetune_host_peak(model: ModelSize, cfg: dict, cpu_bytes: int, tokens: int,
                       lora_rank: int | None = None) -> list[tuple[str, int]]:
    """[Note: the peak of a finetune step] (what, bytes) of the host memory `infinity finetune`
    takes with its built-in config (params and optimizer state on NVMe) on a CPU-only machine
    of `cpu_bytes`, its peak being their sum."""
    from infinity.apps.finetune import OPTIMIZER_BUFFERS, PIECE, builtin_budget

    units = model.units
    largest = max(u.numel for u in units)
    largest_trainable = max(u.trainable for u in units)
    _, count, buffer, piece, grads = builtin_budget(cpu_bytes, largest, largest_trainable)
    shards = [u.trainable for u in units if u.trainable]
    per_piece = len(KINDS) + (1 if model.trainable > grads else 0)
    host = psutil.virtual_memory().available // 4 // FP32  # the tier's share of free memory (nvme_optim.HOST_SHARE)
    optimizer_pool = buffers = 0
    if shards:
        target, buffers = choose_pieces(shards, PIECE, OPTIMIZER_BUFFERS, per_piece, host)
        optimizer_pool = buffers * max(n for numel in shards for _, n in cut_pieces(numel, target)) * FP32
    return [
        ("the process (Python, torch, infinity: measured here)", psutil.Process().memory_info().rss),
        (f"parameter pool ({count} buffers of the largest unit)", count * buffer * HALF),
        (f"optimizer-state pool ({buffers} buffers)", optimizer_pool),
        ("fp32 gradient accumulators kept in memory", min(grads, model.trainable) * FP32),
        ("two units gathered (the one computing, the next)", 2 * largest * HALF),
        ("a unit's gradients in backward (bf16, and fp32 on their way to the accumulator)",
         largest_trainable * (HALF + FP32)),
        (f"activations of {tokens:,} tokens, twice (saved for backward, and their gradients)",
         2 * activation_bytes(cfg, tokens, lora_rank)),
    ]


# ---- the command line ---------------------------------------------------------------------------


def _parse_scaled(text: str, suffixes: dict[str, int], expected: str) -> int:
    """A number with an optional one-letter scale from `suffixes`, at least 1."""
    t = text.strip().upper()
    suffix = t[-1] if t and t[-1] in suffixes and not t[-1].isdigit() else ""
    try:
        value = float(t[:len(t) - len(suffix)]) * suffixes[suffix]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return int(value)


def parse_count(text: str) -> int:
    """'70B' -> 70_000_000_000; '1.5B', '125M', '7e9', '16K'. Decimal units, as model sizes are."""
    return _parse_scaled(text, _COUNT_SUFFIXES, "a count of at least 1 such as 70B, 1.5B, 125M or 7e9")


MAX_PARAMS = 10**15  # far past any model; the plan's pieces grow with the count


def parse_params(text: str) -> int:
    """`parse_count`, at most MAX_PARAMS."""
    count = parse_count(text)
    if count > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"expected at most 1000T parameters, got {text!r}")
    return count


def parse_bytes(text: str) -> int:
    """'80G' -> 80 GiB; '512G', '3.6T', '1048576'. Binary units (a drive sold as 4 TB is 3.6T)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return _parse_scaled(t, _SIZE_SUFFIXES, "")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a size such as 80G, 512G or 4T, got {text!r}") from None


def _number(low: float, high: float | None = None, integer: bool = False, what: str = "a number"):
    def parse(text: str) -> float | int:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= low and (high is None or value < high)):
            bounds = f"at least {low:g}" + (f" and below {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `infinity estimate`."""
    parser.description = ("Bytes per rank on the device, in host memory and on NVMe for each offload choice "
                          "(ZeRO stage 3, bf16, Adam), which fit the machine, the NVMe bandwidth a step needs, "
                          "and the config block of the cheapest one that fits. Machine figures not given are read "
                          "from this machine.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="COUNT", type=parse_params, help="number of parameters: 70B, 1.5B, 125M, 7e9")
    what.add_argument("--model", metavar="PRESET_OR_DIR",
                      help="a preset (llama-tiny ... llama-70b) or a Hugging Face model directory with config.json "
                           "(Llama-style shapes)")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--gpus", metavar="N", type=_number(0, integer=True, what="a whole number of GPUs"),
                       help="GPUs on the node, one rank each; 0: CPU only (default: this machine's)")
    ranks.add_argument("--world-size", dest="gpus", metavar="N",
                       type=_number(1, integer=True, what="a whole number of ranks"),
                       help="the same as --gpus, for one or more ranks")
    parser.add_argument("--gpu-mem", metavar="SIZE", type=parse_bytes,
                        help="memory of each GPU, e.g. 80G (default: this machine's)")
    parser.add_argument("--cpu-mem", metavar="SIZE", type=parse_bytes,
                        help="host memory of the node, e.g. 512G (default: this machine's)")
    parser.add_argument("--nvme-free", metavar="SIZE", type=parse_bytes,
                        help="free space for the offload files, e.g. 4T (default: what --nvme-path has free)")
    parser.add_argument("--nvme-gbps", metavar="GBPS", type=_number(1e-3, what="GB/s"),
                        help="sustained NVMe bandwidth of the node (aio_bench_sweep measures it)")
    parser.add_argument("--nvme-path", metavar="DIR", default=tempfile.gettempdir(),
                        help="the offload directory (default: %(default)s)")
    parser.add_argument("--tokens-per-step", metavar="COUNT", type=parse_count,
                        help=f"tokens per optimizer step over all ranks (default {TOKENS_PER_RANK} per rank)")
    parser.add_argument("--tflops", metavar="TFLOPS", type=_number(1e-6, what="TFLOP/s"),
                        help=f"achieved TFLOP/s of one device (default {DEFAULT_GPU_TFLOPS:g} for a GPU, measured "
                             "for a CPU)")
    parser.add_argument("--lora", metavar="RANK", type=_number(1, integer=True, what="a LoRA rank"),
                        help="train only LoRA adapters of this rank on q,k,v,o,gate,up,down (needs --model)")
    parser.add_argument("--frozen-fraction", metavar="F", type=_number(0, 1, what="a fraction"),
                        help="freeze this fraction of every unit's parameters")
    parser.add_argument("--largest-unit", metavar="COUNT", type=parse_params,
                        help="with --params: parameters of the largest unit (default params/32)")


def model_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSize:
    """The model the arguments describe; a bad combination is an argparse error naming the argument."""
    if args.lora and args.frozen_fraction is not None:
        parser.error("--frozen-fraction: not with --lora, which freezes the whole base model")
    fraction = args.frozen_fraction or 0.0
    if args.model is None:
        if args.lora:
            parser.error("--lora: needs --model (the adapters' size depends on the layer shapes)")
        if args.largest_unit is not None and args.largest_unit > args.params:
            parser.error(f"--largest-unit: {args.largest_unit} is more than --params {args.params}")
        return model_from_count(args.params, args.largest_unit, fraction)
    if args.largest_unit is not None:
        parser.error("--largest-unit: only with --params (--model knows its units)")
    try:
        name, cfg = load_architecture(args.model)
    except (OSError, ValueError) as e:
        parser.error(f"--model: {e}")
    return model_from_config(name, cfg, args.lora, fraction)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`infinity estimate`: prints the report."""
    model = model_from_args(args, parser)
    if args.gpus == 0 and args.gpu_mem is not None:
        parser.error("--gpu-mem: given with --gpus 0 (a CPU-only machine)")
    if args.nvme_free is None and not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path}: not a directory (or give --nvme-free)")
    machine = machine_from_args(args)
    tokens = args.tokens_per_step or TOKENS_PER_RANK * machine.world
    finetune = None
    if args.model is not None and machine.gpus == 0:  # the device is the host: the whole step is host memory
        finetune = finetune_host_peak(model, load_architecture(args.model)[1], machine.cpu_bytes, tokens, args.lora)
    print(report(model, machine, tokens, finetune))
    return 0
