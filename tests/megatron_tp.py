"""A Megatron-style tensor-parallel model for the model-parallelism tests, written here: column-
and row-parallel linear layers with autograd-aware collectives over the tensor-parallel group, a
replicated embedding, layer norms and head, the `mpu` object DeepSpeed asks model-parallel
frameworks for, and the plain-PyTorch reference step (gradients averaged over the data-parallel
group, the clipping norm over the whole model with replicated parameters counted once).

Tensor-parallel parameters carry `tensor_model_parallel = True` and `model_parallel = True`
(Megatron's and DeepSpeed's markers); the replicated ones carry neither.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Mpu:
    """DeepSpeed's model-parallel unit for a (tensor-parallel x data-parallel) grid: ranks are
    numbered tensor-parallel first (ranks 2k and 2k+1 share a data-parallel index at TP 2)."""

    def __init__(self, tp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        assert world % tp == 0, (world, tp)
        self.tp, self.dp = tp, world // tp
        self.tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(self.dp)]
        self.dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        self.tp_rank, self.dp_rank = rank % tp, rank // tp

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_groups[self.dp_rank]

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_groups[self.tp_rank]


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The partial outputs summed over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mark(*params: nn.Parameter) -> None:
    for p in params:
        p.tensor_model_parallel = True
        p.model_parallel = True


class ColumnParallelLinear(nn.Module):
    """Y_i = X W_i^T + b_i: this rank's rows of the weight (out_features / tp), output split."""

    def __init__(self, full: nn.Linear, mpu: Mpu):
        super().__init__()
        rows = full.out_features // mpu.tp
        part = slice(mpu.tp_rank * rows, (mpu.tp_rank + 1) * rows)
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone())
        _mark(self.weight, self.bias)
        self.group = mpu.get_model_parallel_group()

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i W_i^T + b: this rank's columns of the weight (in_features / tp), input split,
    the bias replicated and added after the sum."""

    def __init__(self, full: nn.Linear, mpu: Mpu):
        super().__init__()
        cols = full.in_features // mpu.tp
        part = slice(mpu.tp_rank * cols, (mpu.tp_rank + 1) * cols)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        _mark(self.weight)
        self.group = mpu.get_model_parallel_group()

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks of LayerNorm + MLP, LayerNorm, head: the full (single-rank) model."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def parallelize(model: TinyLM, mpu: Mpu) -> TinyLM:
    """The same model with each block's MLP split over the tensor-parallel group (in place)."""
    for block in model.blocks:
        block.up, block.down = ColumnParallelLinear(block.up, mpu), RowParallelLinear(block.down, mpu)
    return model


def batch(step: int, rows: int, seq: int = 8, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: `rows` sequences; data-parallel rank d takes its share."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def clip_grad_norm_tp(model: nn.Module, max_norm: float, mpu: Mpu) -> float:
    """The global gradient norm of the whole model, each weight counted once: tensor-parallel
    shards summed over the TP group, replicated parameters taken from one TP rank; then clipped."""
    sharded = sum(p.grad.double().pow(2).sum() for p in model.parameters() if getattr(p, "model_parallel", False))
    replicated = sum(p.grad.double().pow(2).sum() for p in model.parameters()
                     if not getattr(p, "model_parallel", False))
    total = torch.as_tensor(sharded, dtype=torch.float64).clone()
    dist.all_reduce(total, group=mpu.get_model_parallel_group())
    norm = float((total + replicated).sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in model.parameters():
            p.grad.mul_(scale)
    return norm


def reference_steps(model: nn.Module, mpu: Mpu, steps: int, rows: int, lr: float = 1e-2,
                    clip: float = 1.0, loss_scale: float = 1.0, norms: list | None = None) -> list[float]:
    """Plain PyTorch at TP x DP: this DP rank's rows, gradients averaged over the DP group, the
    norm over the whole model, AdamW. Returns the global batch's loss of each step (the loss
    before `loss_scale`, which multiplies what is backpropagated); `norms` gets each step's
    gradient norm before clipping."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    share = rows // mpu.dp
    losses = []
    for step in range(steps):
        tokens, labels = batch(step, rows)
        mine = slice(mpu.dp_rank * share, (mpu.dp_rank + 1) * share)
        loss = model(tokens[mine], labels[mine])
        (loss * loss_scale).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mpu.get_data_parallel_group())
            p.grad.div_(mpu.dp)
        norm = clip_grad_norm_tp(model, clip, mpu)
        if norms is not None:
            norms.append(norm)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(total.item() / mpu.dp)
    return losses


def full_weights(model: nn.Module, mpu: Mpu) -> dict[str, torch.Tensor]:
    """The whole model's weights, the TP shards joined (every rank gets them)."""
    out = {}
    group = mpu.get_model_parallel_group()
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            dim = 0 if isinstance(module, ColumnParallelLinear) else 1
            parts = [torch.empty_like(module.weight) for _ in range(mpu.tp)]
            dist.all_gather(parts, module.weight.detach().contiguous(), group=group)
            out[f"{name}.weight"] = torch.cat(parts, dim)
            if isinstance(module, ColumnParallelLinear):
                bias = [torch.empty_like(module.bias) for _ in range(mpu.tp)]
                dist.all_gather(bias, module.bias.detach().contiguous(), group=group)
                out[f"{name}.bias"] = torch.cat(bias)
            else:
                out[f"{name}.bias"] = module.bias.detach().clone()
        elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            for pname, p in module.named_parameters(recurse=False):
                out[f"{name}.{pname}"] = p.detach().clone()
    return out


def engine_config(rows: int, mpu: Mpu, offload: str, nvme: str, lr: float, clip: float, stage: int = 3) -> dict:
    """infinity's ZeRO config for the reference's training: the same AdamW, this data-parallel
    rank's share of `rows` a micro-batch, every parameter partitioned (no persistence threshold)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_param"] = {"device": offload, "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme}
    return {"train_micro_batch_size_per_gpu": rows // mpu.dp, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}}


def engine_steps(engine, mpu: Mpu, steps: range, rows: int, loss_scale: float = 1.0) -> list[float]:
    """The reference's steps through an infinity engine: this data-parallel rank's rows of each
    step's batch; returns the data-parallel mean loss of each step (unscaled)."""
    share = rows // mpu.dp
    losses = []
    for step in steps:
        tokens, labels = batch(step, rows)
        mine = slice(mpu.dp_rank * share, (mpu.dp_rank + 1) * share)
        loss = engine(tokens[mine], labels[mine])
        engine.backward(loss * loss_scale)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(total.item() / mpu.dp)
    return losses
