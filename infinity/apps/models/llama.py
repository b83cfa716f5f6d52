"""A Llama-architecture causal LM (RMSNorm, rotary positions, grouped-query attention, SwiGLU)
with Hugging Face's parameter names and config keys, so that `infinity finetune` runs one without
`transformers` installed and its export loads with `LlamaForCausalLM.from_pretrained`.

The arithmetic follows transformers' LlamaForCausalLM (rotate-half rotary embedding, RMSNorm in
fp32, grouped-query attention by repeating key/value heads), so the same weights give the same
logits up to the attention kernel's rounding.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from infinity.config.sections import ChunkedLossConfig
from infinity.offload.checkpoint import checkpoint
from infinity.zero.head_loss import chunked_lm_loss

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
            "max_position_embeddings": 2048}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def head_dim(cfg: dict) -> int:
    """Per-head width: `head_dim` where the config gives one (Mistral Small 24B: 128 at width
    5120 over 32 heads), else hidden_size / num_attention_heads, as LlamaConfig has it."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = head_dim(cfg)
        d = cfg["hidden_size"]
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, inner = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class Llama(nn.Module):
    """`Llama(config)`: config is a dict of Hugging Face LlamaConfig keys (vocab_size,
    hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    and optionally rms_norm_eps, rope_theta, tie_word_embeddings, max_position_embeddings, head_dim)."""

    def __init__(self, config: dict):
        super().__init__()
        self.cfg = cfg = {**DEFAULTS, **config}
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.chunk_bytes = ChunkedLossConfig().chunk_bytes  # the engine sets its config's; 0: logits whole
        self.gradient_checkpointing = False  # each layer through infinity's checkpoint in training
        if cfg["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        for m in self.modules():
            self._init_weights(m)

    def _init_weights(self, module: nn.Module) -> None:
        """One module's initial values (Hugging Face's convention; `infinity.Init` calls it)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg["initializer_range"])
        elif isinstance(module, RMSNorm):
            module.reset_parameters()

    def _rotary(self, t: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = head_dim(self.cfg)
        inv_freq = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64,
                                                                   device=device).float() / d))
        freqs = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean next-token cross-entropy when `labels` (shifted inside, as Hugging
        Face does) are given."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rotary(input_ids.size(1), x.device, x.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            # [Note: what a checkpoint keeps]: only the layer's input is kept (on NVMe with
            # activation_checkpointing.nvme_path); its activations come back in backward
            x = checkpoint(layer, x, cos, sin) if recompute else layer(x, cos, sin)
        h = self.model.norm(x)
        if labels is not None and self.chunk_bytes:  # [Note: the chunked LM loss]: never the whole logits
            return chunked_lm_loss(self.lm_head, h, labels, chunk_bytes=self.chunk_bytes)
        logits = self.lm_head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))

    def chunked_loss_head(self) -> nn.Module:
        """The head whose loss this model chunks (the engine tiles it under ZeRO-3)."""
        return self.lm_head

    def save_config(self, directory: str) -> None:
        """A Hugging Face config.json, so `LlamaForCausalLM.from_pretrained(directory)` loads the weights."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "max_position_embeddings",
                "initializer_range")
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False, **{k: self.cfg[k] for k in keys},
                  "head_dim": head_dim(self.cfg)}
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
