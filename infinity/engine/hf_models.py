"""Hugging Face models under the engine: the chunked LM loss inside a causal LM's own forward, and
its gradient checkpointing through infinity's.

[Note: chunked loss for Hugging Face causal LMs]
A known family's `XForCausalLM.forward` runs the decoder, `self.lm_head(hidden_states)`, Gemma's
soft-capping, then `self.loss_function(logits, labels, vocab_size, **kwargs)`. While it trains
with `labels`, the engine runs that very forward with two things changed for the call: a pre-hook
on the head takes the hidden states and hands the head none of the tokens (a [batch, 0, vocab]
comes out, and the soft-capping runs on it), and the model's `loss_function` is the chunked loss
of those hidden states ([Note: the chunked LM loss] in zero/head_loss.py), with the labels,
`num_items_in_batch`, `ignore_index` and `shift_labels` Hugging Face's loss takes. The output is the
model's own output class with `logits` None, as Liger's fused loss leaves it. Everything else runs
the forward unchanged: eval and no-grad calls, no labels, `logits_to_keep`, `return_dict=False`, a
loss function of the user's or a `loss_type` other than ForCausalLM, and TRL's fused head
(`fused_lm_head=True`), which computes its per-token log-probabilities in chunks itself.
Label smoothing never reaches here: the Trainer then takes the labels out and smooths the logits.

[Note: Hugging Face's gradient checkpointing]
`model.gradient_checkpointing_enable()` (the Trainer's `--gradient_checkpointing`) gives each
layer `_gradient_checkpointing_func`: torch's `checkpoint` with `use_reentrant=False` (or the
user's kwargs) bound. Under the engine that function is `infinity.checkpointing.checkpoint`
instead, so what the `activation_checkpointing` section says (`nvme_path`: the checkpointed
inputs spilled to NVMe, `cpu_checkpointing`, `profile`) applies to those layers too. The torch
kwargs are dropped: infinity's checkpoint is the non-reentrant kind and restores the RNG state as
torch's does by default. Enabling after `initialize` is routed the same way (the model's
`_set_gradient_checkpointing` is wrapped); HF's own `offload` variant is left as the user chose.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from infinity.offload import checkpoint as checkpointing
from infinity.zero.head_loss import chunked_lm_loss
from infinity.zero.tiling import TiledLinear

log = logging.getLogger("infinity")

# Model types whose forward is the one the note describes (checked against transformers 5.24).
CHUNKED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})


def _hf_causal_lm_loss():
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def why_not_chunked(module: nn.Module) -> str | None:
    """None if `module` is a causal LM whose loss can be chunked, else why not (for the log)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if not type(module).__name__.endswith("ForCausalLM") or not hasattr(module, "get_output_embeddings"):
        return "not a Hugging Face causal LM"
    if model_type not in CHUNKED_FAMILIES:
        return f"model_type {model_type!r} is not one of {', '.join(sorted(CHUNKED_FAMILIES))}"
    head = module.get_output_embeddings()
    if not isinstance(head, (nn.Linear, TiledLinear)) or head.bias is not None:
        return "its output embedding is not an nn.Linear without bias"
    return None


def chunked_heads(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(causal LM, its head) of each module of `model` whose loss the engine can chunk: Hugging
    Face's known families, and modules that compute it themselves (`chunked_loss_head()`, the
    built-in Llama of `infinity finetune`)."""
    found = []
    for m in model.modules():
        own = getattr(m, "chunked_loss_head", None)
        if callable(own):
            found.append((m, own()))
        elif type(m).__name__.endswith("ForCausalLM"):
            why = why_not_chunked(m)
            if why is None:
                found.append((m, m.get_output_embeddings()))
            else:
                log.info("infinity: %s computes its logits whole: %s", type(m).__name__, why)
    return found


class ChunkedLoss:
    """[Note: chunked loss for Hugging Face causal LMs] Installed on one causal LM; `remove()`
    gives it its forward back."""

    def __init__(self, lm: nn.Module, chunk_bytes: int):
        self.lm = lm
        self.chunk_bytes = chunk_bytes
        self.hidden: torch.Tensor | None = None
        self._had_forward = "forward" in lm.__dict__
        self._forward = lm.forward
        lm.forward = self.forward

    def remove(self) -> None:
        if self._had_forward:
            self.lm.forward = self._forward
        else:
            del self.lm.forward

    def applies(self, kwargs: dict[str, Any]) -> bool:
        return (self.lm.training and torch.is_grad_enabled() and kwargs.get("labels") is not None
                and not kwargs.get("logits_to_keep") and not kwargs.get("fused_lm_head")
                and kwargs.get("return_dict") is not False and self.lm.loss_function is _hf_causal_lm_loss())

    def forward(self, *args, **kwargs):
        if not self.applies(kwargs):
            return self._forward(*args, **kwargs)
        lm = self.lm
        handle = lm.get_output_embeddings().register_forward_pre_hook(self._take_hidden)
        lm.loss_function = self._loss  # an instance attribute: Hugging Face's setter
        try:
            out = self._forward(*args, **kwargs)
        finally:
            handle.remove()
            del lm._loss_function
            self.hidden = None
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})

    def _take_hidden(self, head: nn.Module, args: tuple) -> tuple | None:
        if self.hidden is not None:  # the loss's own call of the head
            return None
        self.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])

    def _loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
              shift_labels=None, **kwargs) -> torch.Tensor:
        if self.hidden is None:
            raise RuntimeError(f"{type(self.lm).__name__}: its loss was asked for before its LM head ran; "
                               'set "chunked_loss": {"enabled": false} for this model')
        config = self.lm.config
        return chunked_lm_loss(self.lm.get_output_embeddings(), self.hidden, labels, chunk_bytes=self.chunk_bytes,
                               ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
                               shift_labels=shift_labels, softcap=getattr(config, "final_logit_softcapping", None))


# ---- gradient checkpointing ([Note: Hugging Face's gradient checkpointing]) ----------------------


def _through_infinity(function: Callable, *args: Any, **kwargs: Any) -> Any:
    return checkpointing.checkpoint(function, *args, **kwargs)


def _is_torchs(func: Any) -> bool:
    base = func.func if isinstance(func, functools.partial) else func
    return base is torch.utils.checkpoint.checkpoint


def _reroute(model: nn.Module) -> int:
    """Points every layer's torch checkpoint function at infinity's; returns how many."""
    count = 0
    for m in model.modules():
        if _is_torchs(m.__dict__.get("_gradient_checkpointing_func")):
            m._gradient_checkpointing_func = _through_infinity
            count += 1
    return count


def route_gradient_checkpointing(model: nn.Module) -> None:
    """[Note: Hugging Face's gradient checkpointing] on every Hugging Face model inside `model`:
    now, and whenever it is enabled later."""
    for m in model.modules():
        setter = getattr(m, "_set_gradient_checkpointing", None)
        if setter is None or getattr(setter, "_infinity", False):
            continue

        @functools.wraps(setter)
        def wrapped(*args, _setter=setter, _model=m, **kwargs):
            out = _setter(*args, **kwargs)
            _reroute(_model)
            return out

        wrapped._infinity = True
        m._set_gradient_checkpointing = wrapped
    _reroute(model)
