"""Llama-style architectures by name, and their exact parameter counts.

    preset("llama-3b")          # a fresh dict: LlamaConfig(**preset("llama-3b")) builds the model
    param_count(preset("llama-70b"))   # 70_553_706_496, what LlamaForCausalLM holds

Each preset is a dict of Hugging Face `LlamaConfig` keys: vocab_size, hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
max_position_embeddings, tie_word_embeddings, plus rms_norm_eps and rope_theta so that a model
built from it computes like the one it is named after. The larger ones have the shapes of
published models (Llama 2 7B and 13B, Llama 3.2 1B and 3B, OpenLLaMA 3B, Mistral Small 24B, Llama 3 70B); "llama-tiny" and
"llama-125m" are small ones for tests and CPU runs. No weights, and nothing here imports
transformers: `param_count` works from the shapes alone, so it also counts a Hugging Face
config.json read with `json`.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # 4.0M parameters: a few seconds a step on a CPU.
    "llama-tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0),
    # 124M, GPT-2 small's width and depth with Llama's blocks and vocabulary.
    "llama-125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0),
    # 1.24B, Llama 3.2 1B's shapes.
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0),
    # 3.21B, Llama 3.2 3B's shapes.
    "llama-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0),
    # 3.43B, OpenLLaMA 3B's shapes (Llama 2's 32k vocabulary): about 55 GB of training state at 16
    # bytes a parameter, twice a 24 GiB machine's memory, with a root unit half of llama-3b's.
    "open-llama-3b": dict(vocab_size=32000, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0),
    # 6.74B, Llama 2 7B's shapes.
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                     tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0),
    # 13.0B, Llama 2 13B's shapes.
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0),
    # 23.6B, Mistral Small 24B's shapes (Mistral-Small-24B-Base-2501: Llama's blocks with a head
    # width of 128 at hidden size 5120); the LoRA-over-a-20B-base run of bench/results/finetune_large.md.
    "mistral-small-24b": dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-5,
                              rope_theta=100000000.0),
    # 70.6B, Llama 3 70B's shapes.
    "llama-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0),
}

# What `param_count` needs; the rest has LlamaConfig's defaults.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's LlamaConfig keys."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def layer_linears(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Linear in one decoder layer, by its Hugging Face name."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads  # None or absent: multi-head attention
    d = _head_dim(cfg)
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def layer_param_count(cfg: dict[str, Any]) -> int:
    """Parameters of one decoder layer: attention and MLP Linears (biases when the config asks for
    them), and the two RMSNorm weights."""
    linears = layer_linears(cfg)
    weights = sum(n_in * n_out for n_in, n_out in linears.values())
    biases = 0
    if cfg.get("attention_bias"):
        biases += sum(linears[k][1] for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if cfg.get("mlp_bias"):
        biases += sum(linears[k][1] for k in ("gate_proj", "up_proj", "down_proj"))
    return weights + biases + 2 * cfg["hidden_size"]


def root_param_count(cfg: dict[str, Any]) -> int:
    """Parameters outside the decoder layers: embeddings, the final RMSNorm, the LM head unless
    it is tied to the embeddings."""
    embeddings = cfg["vocab_size"] * cfg["hidden_size"]
    head = 0 if cfg.get("tie_word_embeddings", False) else embeddings
    return embeddings + cfg["hidden_size"] + head


def param_count(cfg: dict[str, Any]) -> int:
    """Exactly the parameters of `LlamaForCausalLM(LlamaConfig(**cfg))`, a tied weight once."""
    return cfg["num_hidden_layers"] * layer_param_count(cfg) + root_param_count(cfg)


def activation_floor_bytes(cfg: dict[str, Any], tokens: int, chunked: bool = True, checkpointing: bool = False) -> int:
    """Bytes a training step's forward must keep for backward over `tokens` tokens (micro-batch
    x sequence length), at the least: a lower bound, for refusing what cannot fit, never an
    estimate of what will.

    [Note: activation floor]
    Per token and decoder layer, backward needs at least the input of the attention projections
    and of down_proj (`hidden_size + intermediate_size` values, 2 bytes each in bf16/fp16: also
    true under LoRA, whose A matrices read those inputs); with gradient checkpointing, only one
    layer's at a time (the kept inputs may be on NVMe). The head's loss needs the logits in the
    compute dtype and in fp32 at once (`vocab_size` x 6 bytes) unless the loss is chunked ([Note:
    the chunked LM loss]: then nothing of the vocabulary's size a token). Attention's saved
    output, the MLP's other intermediates, norms and gradients come on top, so a step needs
    several times this. Keys it lacks (a config without intermediate_size) count as 0.
    """
    per_layer = (cfg.get("hidden_size") or 0) + (cfg.get("intermediate_size") or 0)
    layers = 1 if checkpointing else (cfg.get("num_hidden_layers") or 0)
    per_token = layers * per_layer * 2 + (0 if chunked else (cfg.get("vocab_size") or 0) * 6)
    return tokens * per_token
