"""`infinity finetune`: fine-tune a causal language model with parameters and optimizer state
offloaded, from a Hugging Face model directory or a preset architecture, on a text/JSONL file or
the Python standard library's own source, with checkpoints, resume, LoRA and export.

With no arguments it runs the embedded default: a small Llama-architecture model with a byte
tokenizer, parameters and optimizer state on NVMe in a temporary directory, a sample generated
before and after, and a table of what lived where and what moved per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time

import psutil
import torch
from torch import nn
from tqdm import tqdm

DEFAULT_MODEL = {"vocab_size": 257, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "import os\n\n\ndef "
DEFAULT_BATCH = 4  # sequences per step of the built-in config
SAMPLE_WINDOW = 256  # the most tokens `generate` feeds the model at once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a Hugging Face model directory (needs transformers) or a preset name "
                                   "(default: a small built-in Llama-style model)")
    p.add_argument("--data", help="a text or JSONL file (default: the Python standard library's source)")
    p.add_argument("--config", help="DeepSpeed JSON config (default: a built-in one, NVMe offload)")
    p.add_argument("--lora", type=_non_negative, default=0, help="LoRA rank on the attention and MLP projections "
                                                                 "(0: train every weight)")
    p.add_argument("--steps", type=_positive, default=200)
    p.add_argument("--batch", type=_positive, help=f"sequences per step for the built-in config (default {DEFAULT_BATCH})")
    p.add_argument("--seq-len", type=_positive, default=128)
    p.add_argument("--lr", type=_positive_float, help="for the built-in config: default 3e-3, or 1e-4 for a "
                   "pretrained model")
    p.add_argument("--save", help="checkpoint directory: every --save-every steps, on SIGTERM, and at the end")
    p.add_argument("--save-every", type=_positive, default=50)
    p.add_argument("--save-total-limit", type=_positive, help="keep only the newest N checkpoints under --save "
                   "(the config's checkpoint.save_total_limit; default: all)")
    p.add_argument("--resume", help="a checkpoint directory to continue from (its `latest` tag)")
    p.add_argument("--export", help="write the fine-tuned model here (Hugging Face layout)")
    p.add_argument("--plot", help="draw the loss and per-step I/O into this image (needs matplotlib)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(), action=_Given,
                   help="directory for the offload files of the built-in config (with --config, "
                        "set nvme_path in its JSON)")
    p.add_argument("--offload", choices=["cpu", "nvme"], help="tier for the built-in config (default nvme)")
    p.add_argument("--trace", help="write a timeline of steps 2-4 here (Chrome trace JSON; the config's `trace` section)")
    p.add_argument("--sample-tokens", type=_non_negative, default=48)
    p.add_argument("--seed", type=_seed, default=0)
    p.set_defaults(nvme_path_given=False)


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given: a default that is a real directory
    cannot tell `--nvme-path /tmp` from no flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _integer(text: str, low: int, high: int | None, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1, None, "a positive integer")


def _seed(text: str) -> int:
    return _integer(text, -2**63, 2**64 - 1, "an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative(text: str) -> int:
    return _integer(text, 0, None, "a non-negative integer")


class LoRALinear(nn.Module):
    """A frozen projection plus a trainable low-rank update B @ A (scaled by alpha / r). The
    projection is kept as it is, as the child `base_layer` (peft's name): the engine may tile it
    like any nn.Linear, a pretrained checkpoint's `M.weight` loads into it as into a peft model,
    and the exports merge the update into `M.weight` again."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_layer = base
        base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device="cpu"))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device="cpu"))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / r
        # Saved with the checkpoint's buffers, so that `infinity consolidate` can merge the adapters.
        self.register_buffer("lora_scale", torch.tensor(self.scale, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def add_lora(model: nn.Module, r: int) -> list[str]:
    """Wraps every target projection; freezes everything else. Returns the wrapped modules' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in LORA_TARGETS and type(child) is nn.Linear:
                setattr(module, child_name, LoRALinear(child, r, alpha=2.0 * r))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    if not wrapped:
        raise ValueError(f"--lora: the model has no nn.Linear named any of {', '.join(LORA_TARGETS)}")
    return wrapped


HOST_SHARE = 5  # [Note: the built-in config's host budget]: a fifth of the machine's memory
TILE_SIZE = 1 << 25  # zero_optimization.tile_size's default: no unit of the built-in config is larger
PIECE = 25_000_000  # sub_group_size: optimizer-state pieces of 100 MB of fp32 (bench/'s tuned value)
PARAM_BUFFERS = 6
OPTIMIZER_BUFFERS = 12  # a piece reading, one updating, one writing, of each kind and the spilled gradient


def largest_unit_numel(model: nn.Module, trainable: bool = False) -> int:
    """Elements of the largest unit the engine will plan for `model` (with `trainable`, of the
    largest unit's trainable part): a block of a layer list (a transformer layer), or a tile
    ([Note: memory-centric tiling] in infinity/zero/tiling.py)."""
    from infinity.zero.tiling import weights_to_tile

    def counted(p: nn.Parameter) -> bool:
        return p.requires_grad or not trainable

    tiled = {id(w) for w, _ in weights_to_tile(model, TILE_SIZE)}  # each tile is a unit of its own
    in_blocks: set[int] = set()
    blocks = []
    for m in model.modules():
        for block in (m if isinstance(m, nn.ModuleList) else ()):
            params = [p for p in block.parameters() if id(p) not in tiled]
            in_blocks.update(id(p) for p in params)
            blocks.append(sum(p.numel() for p in params if counted(p)))
    root = sum(p.numel() for p in model.parameters() if id(p) not in tiled | in_blocks and counted(p))
    tiles = [TILE_SIZE for w, _ in weights_to_tile(model, TILE_SIZE) if counted(w)]
    return max([*tiles, *blocks, root])


def builtin_budget(total_memory: int, largest_unit: int, largest_trainable: int) -> tuple[int, int, int, int, int]:
    """[Note: the built-in config's host budget] for a machine of `total_memory` bytes and a
    model whose largest unit has these elements (in all, trainable): (budget in bytes, parameter
    buffers, elements a buffer, optimizer piece elements, gradient elements kept in memory)."""
    budget = total_memory // HOST_SHARE
    largest = -(-max(largest_unit, 1) // (1 << 20)) << 20  # with room for the shard's alignment padding
    # Six buffers where they fit in a third of the budget (a 3B model's layers), down to the four
    # a unit with frozen and trainable parts needs (LoRA over a 20B base: a layer of 1.1 GB in bf16).
    count = max(4, min(PARAM_BUFFERS, budget // 3 // (2 * largest)))
    param_pool = count * largest * 2  # bf16
    piece = min(int(1.5 * PIECE), largest_trainable)  # at most 1.5x sub_group_size
    optimizer_pool = OPTIMIZER_BUFFERS * piece * 4
    return budget, count, largest, piece, max(0, budget - param_pool - optimizer_pool) // 4


def _default_config(nvme_path: str, offload: str, batch: int, lr: float, model: nn.Module | None = None,
                    total_memory: int | None = None) -> tuple[dict, str]:
    """The built-in config for `model` on this machine, and a line saying what it chose.

    [Note: the built-in config's host budget]
    With parameters and optimizer state on NVMe, host memory holds the parameter pool, the
    optimizer-state pool and the fp32 gradient accumulators that wait for the step's norm
    (clipping 1.0); what is not kept spills to NVMe. The built-in config gives these a fifth of
    the machine's memory: the pools are sized by the largest unit (tiles keep it at a layer's
    size, whatever the vocabulary) and by 100 MB pieces of optimizer state, and the
    accumulators take what is left of the budget (`offload_optimizer.max_grad_in_cpu`), so a
    step's peak RSS is that budget plus the gathered units (at most two of the largest:
    `stage3_max_live_parameters`) and the activations, not a function of the model's size.
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
    if offload != "nvme" or model is None:
        return config, f"built-in config: parameters and optimizer state in {offload} memory"
    total = psutil.virtual_memory().total if total_memory is None else total_memory
    unit = max(largest_unit_numel(model), 1)
    budget, count, largest, piece, grads = builtin_budget(total, unit, largest_unit_numel(model, trainable=True))
    zero = config["zero_optimization"]
    zero["sub_group_size"] = PIECE
    zero["offload_param"].update(buffer_count=count, buffer_size=largest, max_in_cpu=0)
    zero["stage3_max_live_parameters"] = 2 * largest  # the unit computing and the one gathered next
    zero["offload_optimizer"].update(buffer_count=OPTIMIZER_BUFFERS, max_grad_in_cpu=grads)
    gib = 1 << 30
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    spilled = max(0, trainable - grads)
    return config, (f"built-in config: host budget {budget / gib:.1f} GiB (a fifth of {total / gib:.1f} GiB): "
                    f"parameter pool {count} x {largest * 2 / 1e6:.0f} MB (largest unit {unit / 1e6:.1f}M), "
                    f"optimizer pieces of up to {piece / 1e6:.1f}M ({OPTIMIZER_BUFFERS} x {piece * 4 / 1e6:.0f} MB), "
                    f"gradient accumulators in memory up to {grads / 1e6:.0f}M elements"
                    + (f" ({spilled / 1e6:.0f}M spill to NVMe)" if spilled else "")
                    + "; aio: measured for the disk")


def describe_choices(chosen: dict) -> str:
    """One line of what the engine sized itself (`engine.chosen`)."""
    parts = []
    if "aio" in chosen:
        a = chosen["aio"]
        parts.append(f"aio {a['block_size'] >> 10} KiB blocks, queue depth {a['queue_depth']}, {a['thread_count']} "
                     f"thread(s), {a['engine']} (measured for the disk)")
    if "offload_optimizer" in chosen:
        o = chosen["offload_optimizer"]
        parts.append(f"optimizer pool {o['buffers']} buffers of {o['piece_elements'] * 4 / 1e6:.0f} MB "
                     f"holding {o['pieces_held']} of the state's {o['pieces']} pieces from step to step")
    parts += [f"{key} {value / 1e6:.0f}M elements" for key, value in chosen.items() if key.endswith("max_in_cpu")]
    return "; ".join(parts)


def read_model(args) -> tuple[object, object, str | None]:
    """(config, tokenizer, Hugging Face directory to load weights from) of --model, read before
    anything is built: a transformers config, or a preset's dict for infinity's Llama."""
    from infinity.apps.data import ByteTokenizer

    if args.model and os.path.isdir(args.model):
        try:
            import transformers
        except ImportError:
            raise ValueError("--model: a Hugging Face model directory needs transformers: "
                             "pip install 'infinity[hf]'") from None
        config = transformers.AutoConfig.from_pretrained(args.model)
        has_tokenizer = any(os.path.exists(os.path.join(args.model, f))
                            for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
        if not has_tokenizer and config.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"--model {args.model}: no tokenizer and a vocabulary of {config.vocab_size}, "
                             f"too small for the byte tokenizer ({ByteTokenizer.vocab_size})")
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model) if has_tokenizer else ByteTokenizer()
        return config, tokenizer, args.model
    if args.model:
        from infinity.apps.models.presets import preset
        config = dict(preset(args.model))
    else:
        config = dict(DEFAULT_MODEL)
    config["vocab_size"] = max(config["vocab_size"], ByteTokenizer.vocab_size)
    return config, ByteTokenizer(), None


def build_model(config) -> nn.Module:
    """The model of a config from `read_model`, on the meta device."""
    import infinity
    from infinity.apps.models.llama import Llama

    with infinity.Init():
        if isinstance(config, dict):
            return Llama(config)
        import transformers
        return transformers.AutoModelForCausalLM.from_config(config)


def check_arguments(args) -> None:
    """What can be checked before anything is read or built: the flags only the built-in config
    reads, where the results go, what to resume from. Raises ValueError or OSError naming the flag."""
    from infinity.checkpoint.layout import LATEST

    if args.config and args.nvme_path_given:
        raise ValueError("--nvme-path: only sets the built-in config; with --config, set "
                         "zero_optimization.offload_param.nvme_path and offload_optimizer.nvme_path in its JSON")
    for flag, path, directory in (("--save", args.save, True), ("--export", args.export, True),
                                  ("--trace", args.trace, False), ("--plot", args.plot, False)):
        if path is not None:
            _check_destination(flag, path, directory)
    if args.resume is not None:
        if not os.path.isdir(args.resume):
            raise ValueError(f"--resume {args.resume}: not a directory")
        if not os.path.isfile(os.path.join(args.resume, LATEST)):
            raise ValueError(f"--resume {args.resume}: no checkpoint in it (no '{LATEST}' file): "
                             "give the directory --save wrote")


def _check_destination(flag: str, path: str, directory: bool) -> None:
    """Fails now where writing `path` (a directory or a file) after the last step would: it exists
    as the other kind, or nothing can be created where it goes. Creates nothing."""
    if os.path.exists(path) and os.path.isdir(path) != directory:
        raise ValueError(f"{flag} {path}: " + ("exists and is not a directory" if directory
                                               else "is a directory; give a file's name"))
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise OSError(f"{flag} {path}: cannot create files in {parent} ({e.strerror})") from None


def check_model_sizes(args, config, tokenizer) -> None:
    """The flags the model's shapes bound, checked before it is built: --seq-len and the sample
    within its positions, --lora within its projections' rank, and a step's activations within
    the memory of the device that computes them. Raises ValueError naming the flag."""
    from infinity.apps.models.presets import layer_linears

    shapes = _shapes(config)
    positions = shapes["max_position_embeddings"]
    if positions and args.seq_len > positions:
        raise ValueError(f"--seq-len {args.seq_len}: above the model's max_position_embeddings {positions}, "
                         f"the longest sequence it is built for; give at most {positions}")
    if positions and args.sample_tokens:
        prompt = len(tokenizer.encode(PROMPT))
        if min(SAMPLE_WINDOW, prompt + args.sample_tokens - 1) > positions:
            raise ValueError(f"--sample-tokens {args.sample_tokens}: the prompt ({prompt} tokens) and the sample "
                             f"go beyond the model's max_position_embeddings {positions}; give at most "
                             f"{max(positions - prompt + 1, 0)}")
    if args.lora and all(shapes[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")):
        most = min(min(dims) for dims in layer_linears(shapes).values())
        if args.lora > most:
            raise ValueError(f"--lora {args.lora}: a LoRA update B @ A has at most the rank of its projection, "
                             f"min(in, out), and this model's smallest is {most}; give at most {most}")
    _check_activations(args, shapes)


def _shapes(config) -> dict:
    """A preset dict's or a transformers config's architecture keys (None where it has none)."""
    from infinity.apps.models.llama import DEFAULTS

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
    if isinstance(config, dict):
        return {k: config.get(k, DEFAULTS.get(k)) for k in keys}
    return {k: getattr(config, k, None) for k in keys}


def _check_activations(args, shapes: dict) -> None:
    """Refuses a micro-batch whose activations alone cannot fit the compute device's memory
    ([Note: activation floor] in infinity/apps/models/presets.py: a lower bound, so nothing that fits
    is refused)."""
    from infinity.device import device_kind, gpu_memory
    from infinity.apps.models.presets import activation_floor_bytes

    if args.config is None:
        micro, named = args.batch or DEFAULT_BATCH, "--batch"
    else:
        from infinity.config import load_config
        world = int(os.environ.get("WORLD_SIZE", "1"))
        micro = load_config(args.config, world_size=world).batch.train_micro_batch_size_per_gpu
        named = "train_micro_batch_size_per_gpu"
    if device_kind() == "cuda":
        where, have = "this GPU's memory", min(gpu_memory())
    else:
        where, have = "this machine's memory", psutil.virtual_memory().total
    need = activation_floor_bytes(shapes, micro * args.seq_len)
    if need > have:
        raise ValueError(f"--seq-len {args.seq_len} x {named} {micro}: a step's activations need at least "
                         f"{need / 2**30:.1f} GiB (tokens x (layers x (hidden + intermediate) x 2 + vocab x 6) "
                         f"bytes), more than the {have / 2**30:.1f} GiB of {where}; give a shorter --seq-len "
                         "or a smaller batch")


def _check_token_ids(args, config, tokenizer, rows: torch.Tensor) -> None:
    """The tokenizer's ids must index the model's embedding (an IndexError deep in the forward otherwise)."""
    vocab = config["vocab_size"] if isinstance(config, dict) else getattr(config, "vocab_size", None)
    top = max([int(rows.max())] + (tokenizer.encode(PROMPT) if args.sample_tokens else []))
    if vocab is not None and top >= vocab:
        raise ValueError(f"--model {args.model}: its tokenizer gives token ids up to {top}, beyond the model's "
                         f"vocabulary of {vocab} (vocab_size in its config.json)")


def _logits(out):
    return getattr(out, "logits", out)


def _loss(out):
    return getattr(out, "loss", out)


def generate(engine, tokenizer, prompt: str, n: int, temperature: float = 0.7) -> str:
    """A continuation of `prompt`, sampled at `temperature` from a fixed seed (no cache: one
    forward per token), so the samples before and after training are comparable."""
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    engine.eval()
    with torch.no_grad():
        for _ in range(n):
            logits = _logits(engine(input_ids=ids[:, -SAMPLE_WINDOW:]))[:, -1].float().cpu()
            token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g)
            ids = torch.cat([ids, token], dim=1)
    engine.train()
    return tokenizer.decode(ids[0].tolist())


def export_model(engine, directory: str, lora: list[str], tokenizer) -> None:
    """The model's weights in Hugging Face's layout, with each LoRA update merged into its weight,
    and the run's tokenizer when it is a Hugging Face one (so the directory is a --model again)."""
    if not lora:
        engine.save_16bit_model(directory)  # config.json too
    else:
        _export_merged(engine, directory, set(lora))
        if engine.rank == 0:
            from infinity.checkpoint.export import write_model_config
            write_model_config(engine.module, directory)
    if engine.rank == 0 and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def _export_merged(engine, directory: str, lora: set[str]) -> None:
    """Each LoRALinear's `M.base_layer.weight` + B @ A * scale written as `M.weight`, tile by tile
    where the engine tiled it ([Note: tiles in an export] in infinity/checkpoint/export.py), one
    unit in memory at a time. The adapters are taken as their units pass; only those whose unit
    comes after one of their weight's (none in the engine's unit order: layers, then tiles) are
    read ahead."""
    from infinity.checkpoint.export import RowMerger, base_layer_names, untiled_entries
    from infinity.checkpoint.safetensors_io import ShardedWriter
    from infinity.zero.tiling import tiled_weights
    modules = dict(engine.module.named_modules())
    adapters = {f"{m}.lora_{x}" for m in lora for x in "AB"}
    bases = {f"{m}.base_layer.weight": m for m in lora}  # the merged weight's name -> its LoRA module
    entries, tile_of = untiled_entries([(s.name, u.dtype, list(s.shape)) for u in engine.units for s in u.slots
                                        if s.name not in adapters], tiled_weights(engine.module))
    out_name = base_layer_names([n for n, _, _ in entries], lora)
    entries = [(out_name.get(n, n), dtype, shape) for n, dtype, shape in entries]
    unit_of = {s.name: i for i, u in enumerate(engine.units) for s in u.slots}
    first_base: dict[str, int] = {}  # LoRA module -> the first unit holding its weight or a tile of it
    for name, i in unit_of.items():
        if (owner := bases.get(tile_of.get(name, name))) is not None:
            first_base[owner] = min(i, first_base.get(owner, i))
    ahead = {unit_of[a] for a in adapters if unit_of[a] > first_base.get(a.rsplit(".", 1)[0], unit_of[a])}
    factors = {}

    def take_adapters(u, full) -> None:
        factors.update({s.name: u.param_values(full, s).float() for s in u.slots if s.name in adapters})

    for i in sorted(ahead):
        take_adapters(engine.units[i], engine.full_compute_values(engine.units[i]))
    writer = ShardedWriter(directory, "model.safetensors", entries, 5 * 10 ** 9) if engine.rank == 0 else None
    merge = RowMerger()
    try:
        for i, u in enumerate(engine.units):
            if all(s.name in adapters for s in u.slots) and i in ahead:
                continue
            full = engine.full_compute_values(u)
            take_adapters(u, full)
            if writer is None:
                continue
            for s in u.slots:
                if s.name in adapters:
                    continue
                name, value = tile_of.get(s.name, s.name), u.param_values(full, s)
                owner = bases.get(name)
                if owner is not None:  # these rows of the weight, with theirs of B @ A
                    value = merge(name, value, factors[f"{owner}.lora_A"], factors[f"{owner}.lora_B"],
                                  modules[owner].scale).to(value.dtype)
                writer.add(out_name.get(name, name), value)
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()  # what was not published (nothing after close): a failed export leaves no temporaries


def _table(engine, steps_s: list[float], moved: list[int]) -> str:
    from infinity.offload._messages import human_bytes
    device = engine.peak_gathered_bytes()
    host = sum(p.buffer_count * p.buffer_size for p in (getattr(engine.params, "pool", None),
                                                        getattr(engine.optim_state, "pool", None)) if p is not None)
    nvme = 0
    for tier in (engine.params, engine.optim_state):  # the disk the job's store directories take
        store = getattr(tier, "store", None)
        for root, _, files in os.walk(store.directory) if store is not None else ():
            nvme += sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files)
    last = engine.report.last
    read_gbps = last.get("nvme_read_gbps", 0.0) + last.get("optimizer_nvme_read_gbps", 0.0)
    rows = [("device (gathered units, peak)", human_bytes(device)),
            ("host (pinned pools)", human_bytes(host)),
            ("NVMe (parameter and optimizer files)", human_bytes(nvme)),
            ("moved per step (NVMe read + write, median)", human_bytes(sorted(moved)[len(moved) // 2]) if moved else "-"),
            ("NVMe read / write GB/s (last step)",
             f"{read_gbps:.2f} / {last.get('optimizer_nvme_write_gbps', 0.0):.2f}"),
            ("I/O hidden behind compute (last step)", f"{last.get('overlap_fraction', 1.0):.0%}"),
            ("step time (median)", f"{sorted(steps_s)[len(steps_s) // 2]:.3f} s" if steps_s else "-")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _train(engine, rows: torch.Tensor, start: int, args) -> tuple[list[float], list[float], list[int]]:
    """Steps `start` to `args.steps`, checkpointing every `--save-every` and after the last step;
    returns per-step losses, seconds and NVMe bytes moved."""
    from infinity.apps.data import batch

    size = engine.config.batch.train_micro_batch_size_per_gpu * engine.config.batch.gradient_accumulation_steps
    losses, steps_s, moved = [], [], []
    gas = engine.config.batch.gradient_accumulation_steps
    micro = engine.config.batch.train_micro_batch_size_per_gpu
    bar = tqdm(range(start, args.steps), desc="finetune", unit="step", initial=start, total=args.steps)
    for step in bar:
        t0 = time.perf_counter()
        ids = batch(rows, step, size)
        total = 0.0
        for k in range(gas):
            part = ids[k * micro:(k + 1) * micro]
            loss = _loss(engine(input_ids=part, labels=part))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        dt = time.perf_counter() - t0
        last = engine.report.last
        io = sum(last.get(k, 0) for k in ("nvme_read_bytes", "nvme_write_bytes", "optimizer_nvme_read_bytes",
                                          "optimizer_nvme_write_bytes"))
        losses.append(total)
        steps_s.append(dt)
        moved.append(io)
        bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{ids.numel() / dt:.0f}", step_s=f"{dt:.2f}")
        if args.save and (engine.global_steps % args.save_every == 0 or step == args.steps - 1):
            engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
    bar.close()
    return losses, steps_s, moved


def run(args) -> int:
    import infinity
    from infinity.apps.data import pack, read_texts, stdlib_corpus

    check_arguments(args)
    torch.manual_seed(args.seed)
    model_config, tokenizer, pretrained = read_model(args)
    check_model_sizes(args, model_config, tokenizer)
    texts = read_texts(args.data) if args.data else stdlib_corpus(4 << 20)
    rows = pack(texts, tokenizer, args.seq_len)
    _check_token_ids(args, model_config, tokenizer, rows)
    model = build_model(model_config)
    lora = add_lora(model, args.lora) if args.lora else []
    lr = args.lr if args.lr is not None else (1e-4 if pretrained else 3e-3)
    # The stores go straight under --nvme-path, where the next run and `infinity clean` look for
    # what a killed run left ([Note: cleanup on exit] in infinity/offload/store.py).
    config = args.config
    if config is None:
        config, chose = _default_config(args.nvme_path, args.offload or "nvme", args.batch or DEFAULT_BATCH, lr,
                                        model)
        print(chose)
    if args.trace or args.save_total_limit:
        if not isinstance(config, dict):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
    if args.trace:
        config = {**config, "trace": {**config.get("trace", {}), "path": args.trace}}
    if args.save_total_limit:
        config = {**config, "checkpoint": {**config.get("checkpoint", {}), "save_total_limit": args.save_total_limit}}
    engine, *_ = infinity.initialize(model=model, config=config)
    if engine.chosen:
        print("the engine chose: " + describe_choices(engine.chosen))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if pretrained:
            infinity.load_pretrained(engine, pretrained, missing_ok=lambda name: ".lora_" in name)
        print(f"model: {engine.trainable_numel / 1e6:.2f}M trainable and {engine.frozen_numel / 1e6:.2f}M frozen "
              f"parameters in {len(engine.units)} units; offload param={engine.config.zero.offload_param.device}, "
              f"optimizer={engine.config.zero.offload_optimizer.device}; data: {rows.numel() / 1e6:.2f}M tokens")
        start = 0
        if args.resume:
            _, client = engine.load_checkpoint(args.resume)
            start = client.get("next_step", engine.global_steps)  # saved through the API: its step count
            print(f"resumed from {args.resume} at step {start}")
            if start >= args.steps:
                print(f"--steps {args.steps}: the checkpoint is at step {start} already; nothing to train")
        if args.save:
            def preempted(signum, frame):  # runs at the end of the step it arrived in
                engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
                print(f"\nsignal {signum}: saved {engine.last_checkpoint['path']}; exiting", flush=True)
                engine.close()
                sys.exit(128 + signum)
            signal.signal(signal.SIGTERM, preempted)
        if args.sample_tokens:
            print(f"sample before: {generate(engine, tokenizer, PROMPT, args.sample_tokens)!r}")
        losses, steps_s, moved = _train(engine, rows, start, args) if start < args.steps else ([], [], [])
        if losses:
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {start}-{args.steps - 1}")
        if args.sample_tokens:
            print(f"sample after:  {generate(engine, tokenizer, PROMPT, args.sample_tokens)!r}")
        if args.save and losses:  # _train saved after the last step
            ck = engine.last_checkpoint
            print(f"checkpoint {ck['path']}: {ck['bytes'] / 1e6:.1f} MB in {ck['seconds']:.2f} s")
        print("what lived where and what moved:")
        print(_table(engine, steps_s, moved))
        if args.plot and losses:
            _plot(args.plot, list(range(start, start + len(losses))), losses, moved)
        if args.export:
            export_model(engine, args.export, lora, tokenizer)
            print(f"exported to {args.export}")
    finally:
        if args.save:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)  # None: not set from Python
        engine.close()
    return 0


def _plot(path: str, steps: list[int], losses: list[float], moved: list[int]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: needs matplotlib (pip install 'infinity[plot]'); skipped", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, losses)
    a.set_ylabel("loss")
    b.bar(steps, [m / 2 ** 20 for m in moved])
    b.set_ylabel("NVMe MiB per step")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
