"""A tiny GPT for engine tests: tied embeddings, a block called twice, optional checkpointing,
and the plain-PyTorch reference loop the engine must match."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        # No in-projection bias: its key part gets a mathematically zero gradient, and Adam turns
        # rounding noise there into lr-sized steps that no two implementations share.
        self.attn = nn.MultiheadAttention(d, 4, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 3, d: int = DIM, vocab: int = VOCAB, checkpointing: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: used by the root at two different times
        self.checkpointing = checkpointing
        nn.init.normal_(self.emb.weight, std=0.1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.size(1)]
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
            if i == 0:
                x = block(x)  # the first block runs twice per forward
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((idx, (idx * 7 + 3) % VOCAB))  # learnable from the current token
    return out


def reference_run(model: nn.Module, data, *, gas: int, lr: float = 3e-3, wd: float = 0.01, clip: float = 1.0,
                  world: int = 1, optimizer=None):
    """Plain PyTorch: AdamW + clip_grad_norm_, `gas` micro-batches per step. Returns per-step
    mean losses and the trained model. With `world` > 1 each micro-batch is cut in `world`
    slices whose gradients are summed, as data parallelism computes them: the same gradients up
    to rounding, and the rounding of a batch-2 matmul differs from a batch-4 one's by CPU.
    `optimizer`: params -> optimizer, in place of AdamW(lr, wd)."""
    model = copy.deepcopy(model)
    opt = (optimizer(model.parameters()) if optimizer is not None else
           torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd))
    losses = []
    for i in range(0, len(data), gas):
        total = 0.0
        for idx, tgt in data[i:i + gas]:
            n = idx.size(0) // world
            for r in range(world):
                loss = model(idx[r * n:(r + 1) * n], tgt[r * n:(r + 1) * n])
                (loss / (gas * world)).backward()
                total += loss.item() / (gas * world)
        if clip > 0:  # DeepSpeed's gradient_clipping 0 means no clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def config(stage: int = 3, param: str = "none", optim: str = "cpu", gas: int = 1, micro: int = 4,
           lr: float = 3e-3, wd: float = 0.01, clip: float = 1.0, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
        "zero_optimization": {"stage": stage, "offload_param": {"device": param},
                              "offload_optimizer": {"device": optim},
                              "stage3_param_persistence_threshold": 0, **zero},
    }


def engine_run(engine, data, *, gas: int, rank: int = 0, world: int = 1):
    """Trains on `data` (global micro-batches; each rank takes its slice). Returns per-step mean
    losses over all ranks."""
    losses = []
    for i in range(0, len(data), gas):
        total = torch.zeros(())
        for idx, tgt in data[i:i + gas]:
            n = idx.size(0) // world
            loss = engine(idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu() / gas
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def run_placements(script: str, tmp_path, timeout: int = 600, env: dict[str, str] | None = None) -> dict[str, dict]:
    """Runs `script` in a fresh process for each placement ("memory", "nvme"): argv is
    (nvme directory, this folder, placement); returns the JSON each printed last."""
    runs = {}
    for placement in ("memory", "nvme"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path), os.path.dirname(__file__), placement],
                             capture_output=True, text=True, cwd=tmp_path, timeout=timeout,
                             env={**os.environ, **(env or {})})
        assert out.returncode == 0, out.stderr
        runs[placement] = json.loads(out.stdout.strip().splitlines()[-1])
    return runs
