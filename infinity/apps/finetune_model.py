"""The model a finetune job trains: read from --model (or the built-in default), built, adapted
with LoRA, checked against the flags its shapes bound, and sampled from before and after."""

from __future__ import annotations

import math
import os

import psutil
import torch
from torch import nn

from infinity.apps.finetune_config import DEFAULT_BATCH

DEFAULT_MODEL = {"vocab_size": 257, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "import os\n\n\ndef "
SAMPLE_WINDOW = 256  # the most tokens `generate` feeds the model at once


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

    chunked = True
    if args.config is None:
        micro, named = args.batch or DEFAULT_BATCH, "--batch"
    else:
        from infinity.config import load_config
        world = int(os.environ.get("WORLD_SIZE", "1"))
        loaded = load_config(args.config, world_size=world)
        micro, chunked = loaded.batch.train_micro_batch_size_per_gpu, loaded.chunked_loss.enabled
        named = "train_micro_batch_size_per_gpu"
    if device_kind() == "cuda":
        where, have = "this GPU's memory", min(gpu_memory())
    else:
        where, have = "this machine's memory", psutil.virtual_memory().total
    checkpointing = getattr(args, "gradient_checkpointing", False)
    need = activation_floor_bytes(shapes, micro * args.seq_len, chunked, checkpointing)
    if need > have:
        formula = "(hidden + intermediate) x 2" if checkpointing else "layers x (hidden + intermediate) x 2"
        formula += "" if chunked else " + vocab x 6"
        raise ValueError(f"--seq-len {args.seq_len} x {named} {micro}: a step's activations need at least "
                         f"{need / 2**30:.1f} GiB (tokens x ({formula}) bytes), more than the "
                         f"{have / 2**30:.1f} GiB of {where}; give a shorter --seq-len or a smaller batch"
                         + ("" if checkpointing else ", or --gradient-checkpointing"))


def _check_token_ids(args, config, tokenizer, rows: torch.Tensor) -> None:
    """The tokenizer's ids must index the model's embedding (an IndexError deep in the forward otherwise)."""
    vocab = config["vocab_size"] if isinstance(config, dict) else getattr(config, "vocab_size", None)
    top = max([int(rows.max())] + (tokenizer.encode(PROMPT) if args.sample_tokens else []))
    if vocab is not None and top >= vocab:
        raise ValueError(f"--model {args.model}: its tokenizer gives token ids up to {top}, beyond the model's "
                         f"vocabulary of {vocab} (vocab_size in its config.json)")


def _logits(out):
    return getattr(out, "logits", out)


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
