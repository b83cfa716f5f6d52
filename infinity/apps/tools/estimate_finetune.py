"""The host memory `infinity finetune` peaks at on a CPU-only machine, as `infinity estimate`
reports it.

[Note: the peak of a finetune step]
On a CPU-only machine the device is the host, so everything a step holds is host memory, and
the estimate adds up what `infinity finetune`'s built-in config makes the engine hold
([Note: the built-in config's host budget] in infinity/apps/finetune_config.py): the process
itself (measured in the estimate's own process, which has imported the same), the parameter
pool and the optimizer pool as the engine sizes them for this model, the fp32 gradient
accumulators it keeps in memory, two units gathered, one unit's gradients in backward, and the
activations twice: autograd's saved tensors (measured by running the model's shapes on the meta
device, which allocates and computes nothing) and, during backward, their gradients and what
the allocator keeps of them. Checked against /usr/bin/time's peak RSS of the recorded runs
(bench/results/finetune_large.md) and the `slow` test. Only the model enters through the
largest unit and the activations.
"""

from __future__ import annotations

import psutil
import torch

from infinity.apps.tools.estimate_model import ModelSize
from infinity.apps.tools.estimate_placement import FP32, HALF
from infinity.offload.optimizer.sizing import STATE_KINDS, host_elements, pool_size


def activation_bytes(cfg: dict, tokens: int, lora_rank: int | None = None) -> int:
    """What autograd saves for backward in a bf16 step of infinity's Llama with `cfg`'s shapes
    on `tokens` tokens (one sequence), parameters excluded: the model is run on the meta device
    (shapes only, no memory, no arithmetic) at one and two layers, and the tensors autograd
    packs are summed by storage; the second layer's share is multiplied by the depth."""
    from infinity.apps.finetune_model import add_lora
    from infinity.apps.models.llama import Llama

    def saved(layers: int) -> int:
        with torch.device("meta"):
            model = Llama({**cfg, "num_hidden_layers": layers}).to(torch.bfloat16)
        model.chunk_bytes = 0  # the whole logits, as counted before the chunked loss (meta tensors cannot chunk)
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
    from infinity.apps.finetune_config import OPTIMIZER_BUFFERS, PIECE, builtin_budget

    units = model.units
    largest = max(u.numel for u in units)
    largest_trainable = max(u.trainable for u in units)
    _, count, buffer, piece, grads = builtin_budget(cpu_bytes, largest, largest_trainable)
    shards = [u.trainable for u in units if u.trainable]
    per_piece = STATE_KINDS + (1 if model.trainable > grads else 0)
    optimizer_pool = buffers = 0
    if shards:
        buffers, elements = pool_size(shards, PIECE, OPTIMIZER_BUFFERS, per_piece, host_elements())  # as the tier does
        optimizer_pool = buffers * elements * FP32
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
