"""A causal LM's head and cross-entropy, block by block: the whole logits are never held.

[Note: the chunked LM loss]
A causal LM's logits are [tokens, vocabulary]: at 8k tokens and a 128k vocabulary, 4 GiB in fp32,
their gradient as much again, whatever the model's size. The loss needs only two numbers a token
from them: the log-sum-exp of its row and its target's logit. So the head runs over blocks of its
rows (a tile of a tiled head, [Note: memory-centric tiling] in tiling.py, or the whole weight of
an untiled one), each cut into blocks of `chunk_bytes` of fp32 logits -- rows first, all tokens at
once where 1024 rows of them fit, so that a block's weight gradient is one product over all the
tokens (summing it over many small token chunks rewrote the whole weight gradient each time, and
made backward 1.4x slower than the plain head's): each block's logits are
computed as the model's own forward computes them (its dtype, then Gemma's soft-capping, then
fp32, as Hugging Face's loss upcasts), each token's running log-sum-exp takes the block's
(`logaddexp`), and the token whose label falls in the block keeps its target logit. Only tokens
whose shifted label is not `ignore_index` are scored (a prompt's tokens cost nothing). The loss is
sum(lse - target) / (the scored tokens, or `num_items_in_batch`): Hugging Face's `ForCausalLMLoss`.

Backward recomputes each block's logits (one matmul more than a plain head: the price of never
keeping them), turns them into their gradient (softmax - onehot, times the loss's gradient over
the denominator) and runs the block's own autograd for the input gradient and the block's weight
gradient, both summed in fp32 over blocks. The arithmetic is the plain head's in
another order, so the loss and gradients equal Hugging Face's to fp32 rounding.

Under ZeRO-3 each block is a tile and so a unit. Forward calls each tile once (op "loss"): its
hooks gather and release it as for any call, and the call's output, a zero that carries the graph,
is what the loss adds; its backward gathers the tile again (the hooks' `_PreBackward`) and the
weight gradient reaches the tile's parameter through autograd, one tile at a time. A tied head's
tiles take the tie's path ([Note: tied tiles]): the blocks are scored without autograd, and one
function's backward gathers each tile for its share and leaves the weight part in the stash.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infinity.zero.registry import GatheredParameters

_MIN_ROWS = 1024  # backward's smallest block of rows: below it, the products lose their speed


class ScoredTokens:
    """The scored tokens of one loss, and what forward learns of them."""

    def __init__(self, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None, chunk_bytes: int,
                 denominator: torch.Tensor):
        self.h = hidden.detach()  # (n, d), the model's dtype
        self.labels = labels  # (n,), each in [0, vocabulary)
        self.softcap = softcap
        self.chunk_bytes = chunk_bytes
        self.denominator = denominator
        self.lse = torch.full((hidden.shape[0],), -torch.inf, dtype=torch.float32, device=hidden.device)
        self.target = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    def _local(self, s: slice, row_start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's tokens whose label is one of these rows, and the label's row in them."""
        local = self.labels[s] - row_start
        mine = ((local >= 0) & (local < rows)).nonzero().squeeze(1)
        return mine, local[mine]

    def score(self, weight: torch.Tensor, row_start: int) -> None:
        """Adds the rows `row_start:` (`weight`) to each token's log-sum-exp and target."""
        with torch.no_grad():
            for r, token_chunks in self.blocks(weight.shape[0]):
                for s in token_chunks:
                    z = logits(self.h[s], weight[r], self.softcap)
                    self.lse[s] = torch.logaddexp(self.lse[s], torch.logsumexp(z, -1))
                    mine, local = self._local(s, row_start + r.start, r.stop - r.start)
                    if mine.numel():
                        self.target[s.start + mine] = z[mine, local]

    def blocks(self, rows: int) -> list[tuple[slice, list[slice]]]:
        """Backward's blocks: row ranges, each with token ranges, whose fp32 logits fit `chunk_bytes`.
        Rows first, all tokens at once where they fit: the weight gradient of a block of rows is
        then one product over all tokens, written once, not summed over many token chunks."""
        n = max(1, self.h.shape[0])
        block = min(rows, max(_MIN_ROWS, self.chunk_bytes // (4 * n)))
        size = max(1, self.chunk_bytes // (4 * block))
        tokens = [slice(lo, min(n, lo + size)) for lo in range(0, n, size)]
        return [(slice(r, min(rows, r + block)), tokens) for r in range(0, rows, block)]

    def backward(self, weight: torch.Tensor, row_start: int, grad: torch.Tensor, grad_h: torch.Tensor,
                 weight_grad: bool) -> torch.Tensor | None:
        """The rows' share of the input gradient, added to `grad_h` (fp32), and their weight
        gradient (fp32; None unless `weight_grad`)."""
        rows = weight.shape[0]
        scale = grad / self.denominator
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        for r, token_chunks in self.blocks(rows):
            w = weight[r].detach().requires_grad_(weight_grad)
            for s in token_chunks:
                with torch.enable_grad():
                    h = self.h[s].detach().requires_grad_()
                    z = logits(h, w, self.softcap)
                dz = torch.exp(z.detach() - self.lse[s, None])
                mine, local = self._local(s, row_start + r.start, r.stop - r.start)
                dz[mine, local] -= 1
                dz *= scale
                parts = torch.autograd.grad(z, (h, w) if weight_grad else (h,), dz)
                grad_h[s] += parts[0]
                if weight_grad:
                    gw[r] += parts[1]
        return gw

    def input_grad(self) -> torch.Tensor:
        """A zero fp32 gradient for the scored hidden states, which each block's backward adds to."""
        return torch.zeros(self.h.shape, dtype=torch.float32, device=self.h.device)

    def loss(self) -> torch.Tensor:
        return (self.lse - self.target).sum() / self.denominator


def logits(h: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """A chunk's logits as the model computes them, then in fp32 as Hugging Face's loss reads them."""
    z = F.linear(h, weight)
    if softcap is not None:  # Gemma 2 and 3: the same three ops as their forward
        z = z / softcap
        z = torch.tanh(z)
        z = z * softcap
    return z.float()


class TileLoss(torch.autograd.Function):
    """One tile's (or block's) part of the loss: scores its rows; a zero that carries the graph."""

    @staticmethod
    def forward(ctx, x, weight, tokens: ScoredTokens, tile: nn.Module, row_start: int):
        tokens.score(weight, row_start)
        ctx.tokens, ctx.tile, ctx.row_start = tokens, tile, row_start
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        tokens = ctx.tokens
        grad_h = tokens.input_grad()
        weight = ctx.tile.weight  # gathered again by the tile's hooks for this backward
        gw = tokens.backward(weight, ctx.row_start, grad, grad_h, ctx.needs_input_grad[1])
        return (grad_h.to(tokens.h.dtype), None if gw is None else gw.to(weight.dtype), None, None, None)


class HeadLinear(nn.Linear):
    """An nn.Linear (an LM head whose loss is chunked: the engine gives an untiled head this class)
    whose `forward(x, "loss", tokens)` scores its rows inside its own call, so that under ZeRO-3
    its unit's hooks gather it for the call and for its backward, as for a tile."""

    row_start = 0

    def forward(self, inp: torch.Tensor, op: str = "linear", tokens: ScoredTokens | None = None) -> torch.Tensor:
        if op == "loss":
            return TileLoss.apply(inp, self.weight, tokens, self, self.row_start)
        return F.linear(inp, self.weight, self.bias)


class TiedLoss(torch.autograd.Function):
    """A tied head's loss ([Note: tied tiles]): forward scores each tile without autograd (its
    hooks gather and release it); backward gathers each tile once more for its share of the input
    gradient and leaves its weight part in the stash for the embedding's backward."""

    @staticmethod
    def forward(ctx, x, tiles, tokens: ScoredTokens, stash):
        for t in tiles:
            t(x.view_as(x), "score", tokens)
        ctx.tiles, ctx.tokens, ctx.stash = tiles, tokens, stash
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        tokens = ctx.tokens
        grad_h = tokens.input_grad()
        for t in ctx.tiles:
            with GatheredParameters([t.weight]):
                gw = tokens.backward(t.weight, t.row_start, grad, grad_h, t.weight.requires_grad)
                if gw is not None:
                    ctx.stash.parts[t.index].append((gw.to(t.weight.dtype), None))
        return grad_h.to(tokens.h.dtype), None, None, None


def chunked_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None, *, chunk_bytes: int,
                    ignore_index: int = -100, num_items_in_batch: torch.Tensor | int | None = None,
                    shift_labels: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """[Note: the chunked LM loss] Hugging Face's `ForCausalLMLoss` of `head(hidden)` against
    `labels` (shifted here; or `shift_labels`, already shifted), without the logits. `head`: a
    tiled head (`TiledLinear`), a `HeadLinear`, or an nn.Linear without bias whose weight is whole
    here (no engine)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    if target.numel() != flat.shape[0]:
        raise ValueError(f"labels: {tuple(shift_labels.shape)} does not match the hidden states' "
                         f"{tuple(hidden.shape[:-1])} tokens")
    keep = (target != ignore_index).nonzero().squeeze(1)
    h, target = flat.index_select(0, keep), target.index_select(0, keep)
    vocabulary = head.out_features
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocabulary):
        raise IndexError(f"labels: every label must be in [0, {vocabulary}) or be ignore_index ({ignore_index}); "
                         f"got {int(target.min())}..{int(target.max())}")
    if num_items_in_batch is None:
        denominator = torch.tensor(float(keep.numel()), device=hidden.device)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    tokens = ScoredTokens(h, target, softcap, chunk_bytes, denominator)
    if isinstance(getattr(head, "tiles", None), nn.ModuleList):  # a TiledLinear (tiling.py imports this module)
        zero = head.loss(h, tokens)
    elif isinstance(head, HeadLinear):  # inside its own call: its unit's hooks gather it
        zero = head(h, "loss", tokens)
    else:  # a plain nn.Linear, whole here: one block of all its rows
        zero = TileLoss.apply(h, head.weight, tokens, head, 0)
    return tokens.loss() + zero
