"""The built-in config of `infinity finetune` (no --config): ZeRO stage 3 with parameters and
optimizer state offloaded, its host pools sized for the model and the machine, and a line of what
the engine then sized itself."""

from __future__ import annotations

import psutil
from torch import nn

from infinity.offload.optimizer.sizing import STATE_KINDS, max_piece

DEFAULT_BATCH = 4  # sequences per step of the built-in config
BUILTIN_SHARE = 5  # [Note: the built-in config's host budget]: a fifth of the machine's memory
TILE_SIZE = 1 << 25  # zero_optimization.tile_size's default: no unit of the built-in config is larger
PIECE = 25_000_000  # sub_group_size: optimizer-state pieces of 100 MB of fp32 (bench/'s tuned value)
PARAM_BUFFERS = 6
OPTIMIZER_BUFFERS = 12  # the least optimizer pool: a piece reading, one updating, one writing, of each kind and the spilled gradient


def largest_unit_numel(model: nn.Module, trainable: bool = False) -> int:
    """Elements of the largest unit the engine will plan for `model` (with `trainable`, of the
    largest unit's trainable part): a block of a layer list (a transformer layer), or a tile
    ([Note: memory-centric tiling] in infinity/zero/tiling.py)."""
    from infinity.zero.tiling import weights_to_tile

    def counted(p: nn.Parameter) -> bool:
        return p.requires_grad or not trainable

    tiled = {id(w) for w, *_ in weights_to_tile(model, TILE_SIZE)}  # each tile is a unit of its own
    in_blocks: set[int] = set()
    blocks = []
    for m in model.modules():
        for block in (m if isinstance(m, nn.ModuleList) else ()):
            params = [p for p in block.parameters() if id(p) not in tiled]
            in_blocks.update(id(p) for p in params)
            blocks.append(sum(p.numel() for p in params if counted(p)))
    root = sum(p.numel() for p in model.parameters() if id(p) not in tiled | in_blocks and counted(p))
    tiles = [TILE_SIZE for w, *_ in weights_to_tile(model, TILE_SIZE) if counted(w)]
    return max([*tiles, *blocks, root])


def builtin_budget(total_memory: int, largest_unit: int, largest_trainable: int,
                   trainable: int) -> tuple[int, int, int, int, int, int]:
    """The built-in config's host budget for a machine of `total_memory` bytes and a model whose
    largest unit has these elements (in all, trainable), `trainable` elements trained in all:
    (budget in bytes, parameter buffers, elements a buffer, optimizer piece elements, optimizer
    buffers, gradient elements kept in memory).

    [Note: the built-in config's host budget]
    With parameters and optimizer state on NVMe, host memory holds the parameter pool, the
    optimizer-state pool and the gradient accumulators that wait for the step's norm (clipping
    1.0; bf16, one pass a step: [Note: one pass keeps its own dtype] in
    offload/optimizer/accumulators.py); what is not kept spills to NVMe. The built-in config gives these a fifth of
    the machine's memory: the pools are sized by the largest unit (tiles keep it at a layer's
    size, whatever the vocabulary) and by 100 MB pieces of optimizer state. After the parameter
    pool, the optimizer pool takes the budget (`offload_optimizer.buffer_count`, at least
    `OPTIMIZER_BUFFERS`), up to the whole state and a pipeline besides, and the accumulators
    take what it leaves (`offload_optimizer.max_grad_in_cpu`). So a step's peak RSS is that
    budget plus the gathered units (at most two of the largest: `stage3_max_live_parameters`)
    and the activations, not a function of the model's size.

    The pool comes before the accumulators because its bytes save more. An accumulator kept in
    memory (2 bytes an element) saves its one-pass spill, 2 bytes each way, written and read under a backward that
    has the disk to spare. The pool's bytes hold pieces of state that then move neither way (12
    bytes each way an element), and they are the read-ahead of the updates that wait for the
    norm and run beside the next forward, where a step's waits are. On llama-3b's shapes with 12
    layers (bench/results/finetune_3b.md, an Intel host, runs interleaved), the step with the
    pool first was 0.90x the one with 12 buffers and 509M elements of accumulators.
    """
    budget = total_memory // BUILTIN_SHARE
    largest = -(-max(largest_unit, 1) // (1 << 20)) << 20  # with room for the shard's alignment padding
    # Six buffers where they fit in a third of the budget (a 3B model's layers), down to the four
    # a unit with frozen and trainable parts needs (LoRA over a 20B base: a layer of 1.1 GB in bf16).
    count = max(4, min(PARAM_BUFFERS, budget // 3 // (2 * largest)))
    param_pool = count * largest * 2  # bf16
    # A buffer as the tier counts `buffer_count` (`choose_pieces`): the largest piece of its cut,
    # or a sub-group where the state is larger, whichever is more.
    piece = max(1, min(max_piece(PIECE), largest_trainable), min(PIECE, trainable))
    # The optimizer's pool takes the rest, up to the whole state (its three fp32 kinds, a quarter
    # more for what pieces of unequal sizes waste of their buffers) and a pipeline's buffers
    # besides; the gradient accumulators get what it leaves.
    whole = -(-STATE_KINDS * 5 * max(trainable, 0) // (4 * piece)) + OPTIMIZER_BUFFERS
    buffers = max(OPTIMIZER_BUFFERS, min(whole, max(0, budget - param_pool) // (4 * piece)))
    return budget, count, largest, piece, buffers, max(0, budget - param_pool - buffers * piece * 4) // 2


def _default_config(nvme_path: str, offload: str, batch: int, lr: float, model: nn.Module | None = None,
                    total_memory: int | None = None, checkpointing: bool = False) -> tuple[dict, str]:
    """The built-in config for `model` on this machine, and a line saying what it chose.

    Its host memory: [Note: the built-in config's host budget] (`builtin_budget`).
    No `aio` section: the engine uses the setting measured for the disk.
    """
    device = {"device": offload, "nvme_path": nvme_path} if offload == "nvme" else {"device": offload}
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": dict(device),
            "offload_optimizer": dict(device),
        },
    }
    if checkpointing and offload == "nvme":  # --gradient-checkpointing: the layers' inputs on NVMe too
        config["activation_checkpointing"] = {"nvme_path": nvme_path}
    if offload != "nvme" or model is None:
        return config, f"built-in config: parameters and optimizer state in {offload} memory"
    total = psutil.virtual_memory().total if total_memory is None else total_memory
    unit = max(largest_unit_numel(model), 1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget, count, largest, piece, buffers, grads = builtin_budget(total, unit, largest_unit_numel(model, trainable=True),
                                                                   trainable)
    zero = config["zero_optimization"]
    zero["sub_group_size"] = PIECE
    zero["offload_param"].update(buffer_count=count, buffer_size=largest, max_in_cpu=0)
    zero["stage3_max_live_parameters"] = 2 * largest  # the unit computing and the one gathered next
    zero["offload_optimizer"].update(buffer_count=buffers, max_grad_in_cpu=grads)
    gib = 1 << 30
    spilled = max(0, trainable - grads)
    return config, (f"built-in config: host budget {budget / gib:.1f} GiB (a fifth of {total / gib:.1f} GiB): "
                    f"parameter pool {count} x {largest * 2 / 1e6:.0f} MB (largest unit {unit / 1e6:.1f}M), "
                    f"optimizer pieces of up to {piece / 1e6:.1f}M ({buffers} x {piece * 4 / 1e6:.0f} MB), "
                    f"gradient accumulators in memory up to {grads / 1e6:.0f}M elements"
                    + (f" ({spilled / 1e6:.0f}M spill to NVMe)" if spilled else "")
                    + "; aio: measured for the disk")


def describe_choices(chosen: dict) -> str:
    """One line of what the engine sized itself (`engine.chosen`)."""
    parts = []
    if "aio" in chosen:
        a = chosen["aio"]
        parts.append(f"aio {a['block_size'] >> 10} KiB blocks, queue depth {a['queue_depth']}, {a['thread_count']} "
                     f"thread(s), {a['engine']} (measured for the disk"
                     + (f", its pace from {a['min_request'] >> 10} KiB requests)" if a.get("min_request") else ")"))
    if "offload_optimizer" in chosen:
        o = chosen["offload_optimizer"]
        room = (f" (room for {o['units_streaming']} unit(s)' streamed pieces)"
                if o["pieces_held"] < o["pieces"] else "")  # [Note: the pool is a budget] in offload/optimizer/sizing.py
        parts.append(f"optimizer pool {o['buffers']} buffers of {o['piece_elements'] * 4 / 1e6:.0f} MB "
                     f"holding {o['pieces_held']} of the state's {o['pieces']} pieces from step to step{room}, "
                     f"{o['pieces_in_flight']} in flight, streamed ones no smaller than "
                     f"{o['least_streamed'] * 4 / 1e6:.1f} MB")
    parts += [f"{key} {value / 1e6:.0f}M elements" for key, value in chosen.items() if key.endswith("max_in_cpu")]
    return "; ".join(parts)
