"""The host memory `infinity finetune` peaks at on a CPU-only machine, as `infinity estimate`
reports it.

[Note: the peak of a finetune step]
On a CPU-only machine the device is the host, so everything a step holds is host memory, and
the estimate adds up what `infinity finetune`'s built-in config makes the engine hold
([Note: the built-in config's host budget] in infinity/apps/finetune_config.py): the process
itself (measured in the estimate's own process, which has imported the same), the parameter
pool and the optimizer pool as the engine sizes them for this model, the fp32 gradient
accumulators it keeps in memory, two units gathered, one unit's gradients in backward, and the
activations ([Note: the activations of a finetune step]), and what the C allocator keeps of
freed memory (ALLOCATOR_SLACK, fitted). Checked against /usr/bin/time's peak RSS of the recorded runs
(bench/results/finetune_large.md) and the `slow` test. Only the model enters through the
largest unit and the activations.
"""

from __future__ import annotations

import psutil
import torch
import torch.nn.functional as F

from infinity.apps.tools.estimate_model import ModelSize
from infinity.apps.finetune_config import TILE_SIZE
from infinity.apps.tools.estimate_placement import FP32, HALF
from infinity.config.sections import ChunkedLossConfig
from infinity.offload.optimizer.sizing import host_elements, piece_buffers, pool_size


CHUNK_BYTES = ChunkedLossConfig().chunk_bytes
SEQ_LEN = 2048  # `infinity estimate`'s default sequence: its default 16,384 tokens are 8 of them
# [Note: the peak of a finetune step]: glibc keeps freed blocks below its mmap threshold (which
# grows to 32 MiB) in its heap, 0.3-0.8 GiB of [heap] in /proc/self/smaps of the runs checked:
# counted as the lesser of 600 MiB and a quarter of the rest, fitted to llama-125m at 512 tokens
# (full and LoRA) and 4 layers of llama-1b at 1k-16k tokens (bench/results/long_sequence.md).
ALLOCATOR_SLACK, SLACK_SHARE = 600 << 20, 0.25


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Scaled dot-product attention on the meta device as CPU and GPU run it: the flash kernel,
    which saves q, k, v, the output and a log-sum-exp a query, never the [tokens, tokens] scores
    (the meta device's own dispatch takes the math path, which saves them)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                      scale=scale)[0]


def saved_bytes(cfg: dict, layers: int, seq_len: int, lora_rank: int | None = None, labels: bool = False) -> int:
    """Bytes autograd saves for backward in a bf16 forward of infinity's Llama with `cfg`'s shapes
    and `layers` layers over one sequence of `seq_len` tokens, parameters excluded, measured on the
    meta device (shapes only: no memory, no arithmetic). Without `labels` the forward stops at the
    logits (the head's input is saved, the logits not); with them it takes the loss over the whole
    logits, as with chunked_loss off."""
    from infinity.apps.finetune_model import add_lora
    from infinity.apps.models.llama import Llama

    with torch.device("meta"):
        model = Llama({**cfg, "num_hidden_layers": layers}).to(torch.bfloat16)
    model.chunk_bytes = 0  # meta tensors cannot be chunked (the chunked head is counted apart)
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

    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, ids if labels else None)
    finally:
        F.scaled_dot_product_attention = sdpa
    return sum(storages.values())


def activation_parts(cfg: dict, tokens: int, seq_len: int = SEQ_LEN, lora_rank: int | None = None,
                     checkpointing: bool = False, spill: bool = True, chunk_bytes: int = CHUNK_BYTES,
                     tile_size: int = TILE_SIZE) -> list[tuple[str, int]]:
    """[Note: the activations of a finetune step] (what, bytes) of the activations `infinity
    finetune` holds at its peak over a micro-batch of `tokens` tokens in sequences of `seq_len`.

    [Note: the activations of a finetune step]
    What autograd saves is measured (`saved_bytes`, on the meta device with the flash attention
    kernel CPUs and GPUs run, so no [tokens, tokens] scores) for one and two layers: the second
    layer's share is a layer's, the rest the model's outside its layers; both grow with the
    sequences (attention saves nothing quadratic). At the start of backward all of it is held,
    with the gradients of the layer backward is in (as much as the layer saved: each saved tensor
    is freed once its layer's backward has used it). With gradient checkpointing a layer keeps
    only its input (on NVMe with activation_checkpointing.nvme_path, two of them in memory: the
    one written, the one read back ahead), and backward holds one layer's activations,
    recomputed. A tied head split into tiles keeps its weight gradient (bf16) from the loss's
    backward to the embedding's ([Note: tied tiles]). The chunked loss ([Note: the chunked LM
    loss]) holds a token's log-sum-exp and target, the scored hidden states and their fp32
    gradient, a block of fp32 logits with its exponent and gradient (`chunk_bytes` each, about),
    and one head tile's fp32 weight gradient; with it off, the whole logits are saved (measured).
    Checked against peak RSS measured in a child (bench/bench_long_sequence.py --estimate).
    """
    seq_len = min(seq_len, tokens)
    sequences = -(-tokens // seq_len)
    one, two = saved_bytes(cfg, 1, seq_len, lora_rank), saved_bytes(cfg, 2, seq_len, lora_rank)
    layer, root = (two - one) * sequences, (2 * one - two) * sequences
    layers, d, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shape = f"{tokens:,} tokens" + (f" ({sequences} sequences of {seq_len:,})" if sequences > 1 else "")
    if checkpointing:
        kept = tokens * d * HALF
        held = 2 * kept if spill else layers * kept
        parts = [(f"checkpointed layer inputs of {shape}" + (", on NVMe: two in memory" if spill else ""), held),
                 ("one layer's activations, recomputed in backward", layer),
                 ("the embedding's and the final norm's saved tensors", root)]
    else:
        parts = [(f"activations of {shape} saved for backward", layer * layers + root),
                 ("a layer's gradients in backward", layer)]
    tiled = vocab * d > tile_size
    if cfg.get("tie_word_embeddings") and tiled and chunk_bytes:  # [Note: tied tiles]: the stash
        parts.append(("the tied head's weight gradient, kept for the embedding's backward", vocab * d * HALF))
    if chunk_bytes:
        tile_rows = max(1, tile_size // d) if tiled else vocab
        block = min(chunk_bytes, tokens * tile_rows * FP32)
        parts.append(("the chunked loss (hidden states and their fp32 gradient, 3 blocks of logits, "
                      "a head tile's fp32 weight gradient)",
                      tokens * (d * (HALF + FP32) + 2 * FP32) + 3 * block + tile_rows * d * FP32))
    else:
        whole = (saved_bytes(cfg, 1, seq_len, lora_rank, labels=True) - one) * sequences
        parts.append(("the whole logits and their loss, with their gradient", 2 * whole))
    return parts


def finetune_host_peak(model: ModelSize, cfg: dict, cpu_bytes: int, tokens: int, lora_rank: int | None = None,
                       seq_len: int = SEQ_LEN, checkpointing: bool = False) -> list[tuple[str, int]]:
    """[Note: the peak of a finetune step] (what, bytes) of the host memory `infinity finetune`
    takes with its built-in config (params and optimizer state on NVMe) on a CPU-only machine
    of `cpu_bytes`, its peak being their sum."""
    from infinity.apps.finetune_config import PIECE, builtin_budget

    units = model.units
    largest = max(u.numel for u in units)
    largest_trainable = max(u.trainable for u in units)
    _, count, buffer, _, asked, grads = builtin_budget(cpu_bytes, largest, largest_trainable, model.trainable)
    shards = [u.trainable for u in units if u.trainable]
    piece = piece_buffers(spilled=model.trainable > grads)  # AdamW, fp32 moments: the built-in config's
    optimizer_pool = buffers = 0
    if shards:
        # As the tier does; the built-in config clips, so updates wait for the next forward (one unit streaming).
        buffers, elements = pool_size(shards, PIECE, asked, piece, host_elements())
        optimizer_pool = buffers * elements * FP32
    parts = [
        ("the process (Python, torch, infinity: measured here)", psutil.Process().memory_info().rss),
        (f"parameter pool ({count} buffers of the largest unit)", count * buffer * HALF),
        (f"optimizer-state pool ({buffers} buffers)", optimizer_pool),
        ("bf16 gradient accumulators kept in memory (one pass a step)", min(grads, model.trainable) * HALF),
        ("two units gathered (the one computing, the next)", 2 * largest * HALF),
        ("a unit's gradients in backward (bf16, and fp32 on their way to the accumulator)",
         largest_trainable * (HALF + FP32)),
        *activation_parts(cfg, tokens, seq_len, lora_rank, checkpointing),
    ]
    slack = min(ALLOCATOR_SLACK, int(SLACK_SHARE * sum(n for _, n in parts)))
    return parts + [("what the C allocator keeps of freed memory (glibc's heap; fitted to measured runs)", slack)]
