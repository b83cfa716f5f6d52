"""Automatic tiling: a weight larger than the tile size becomes row tiles, each its own unit.

[Note: memory-centric tiling]
Every buffer of the data path (the parameter pool, the gradient landing, the gathered unit) is
sized by the largest unit, and an embedding or LM head of a 128k-256k vocabulary is larger than
any transformer layer. Before units are planned, `tile_model` replaces each `nn.Linear` and
`nn.Embedding` whose weight has more than `zero_optimization.tile_size` elements, in place, by a
module that holds the weight as row tiles (output features of a Linear, rows of an Embedding),
each tile a module with its own parameter. The partitioner makes every tile its own unit, so a
tile is stored, fetched, gathered, reduced, updated and released like any unit, and the pools
are sized by the tile. The tiled module computes tile by tile: a Linear concatenates the tiles'
outputs (only the order of the input-gradient sum changes), an Embedding looks up each tile's
rows in the tile and calls only the tiles whose rows the lookup needs. A weight shared by an
Embedding and a Linear (tied embeddings) is tiled once and the tiles are shared.

Each tile gets its own alias of the input (`x.view_as(x)`): the unit hooks close a call when its
inputs' gradients are computed ([Note: when a unit's backward ends] in hooks.py), and a tensor
shared by all tiles has its gradient only once every tile's backward ran, which would keep every
tile gathered until the last.

Names and shapes stay the user's: the tiled module's `state_dict()` holds `weight` (the tiles
concatenated, on demand), `load_state_dict()` cuts it again, and `.weight` reads as the
concatenation (for export and inspection: under an engine a released tile is empty, so
`.weight` is only whole inside `GatheredParameters`). A model whose forward reads `.weight` of
such a module itself (`h @ self.emb.weight.t()`) cannot be tiled: set `tile_size` to 0.

[Note: tied tiles]
The gradient of a tied weight is the sum of the head's part (early in backward) and the
embedding's (last). A unit stays gathered until every parameter of it has its gradient, so
computing the head's part through the tile units would keep every tile gathered from the head's
backward to the embedding's: the whole weight again. Instead, while an embedding call of the
tie is waiting for its backward, the head runs as one autograd function (`_TiedHead`): forward
calls each tile without autograd (the hooks gather and release it as usual); backward gathers
each tile once more (`GatheredParameters`) for its share of the input gradient and leaves the
tile's weight-gradient part in a stash (the output-gradient slice and the input, or their
product when that is smaller); each embedding tile's output passes an identity (`_HeadGradSink`)
whose backward hands the stash to autograd as that tile's gradient, which autograd adds to the
lookup's. So the tile gets one gradient, the same sum as plain PyTorch's, one tile at a time.
Every tile of a tied embedding is called with grad on (zero rows where the lookup needs none) so
that every tile has a sink.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from infinity.zero.head_loss import HeadLinear, ScoredTokens, TiedLoss, TileLoss
from infinity.zero.registry import GatheredParameters

log = logging.getLogger("infinity")


class LinearTile(HeadLinear):
    """Rows `row_start:row_start + out_features` of a tiled Linear's weight (no bias);
    `forward(x, "loss", tokens)` is its part of a chunked loss ([Note: the chunked LM loss])."""

    row_start: int


class EmbeddingTile(nn.Embedding):
    """Rows of a tiled Embedding's weight (or of a tied embedding and head); `forward(ids)` looks
    up local row indices, `forward(x, "linear")` is the head's product with these rows."""

    row_start: int
    stash: "_Stash | None"  # set when the weight is tied to a head ([Note: tied tiles])
    index: int  # this tile's position in its tiled module

    def forward(self, inp: torch.Tensor, op: str = "embedding", tokens: "ScoredTokens | None" = None) -> torch.Tensor:
        if op == "linear":
            return F.linear(inp, self.weight)
        if op == "loss":  # [Note: the chunked LM loss]
            return TileLoss.apply(inp, self.weight, tokens, self, self.row_start)
        if op == "score":  # the same inside a tied head's TiedLoss, without autograd
            tokens.score(self.weight, self.row_start)
            return inp.new_zeros(())
        out = F.embedding(inp, self.weight, self.padding_idx)
        if self.stash is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            out = _HeadGradSink.apply(self.weight, out, self.stash, self.index)
        return out


def is_tile(module: nn.Module) -> bool:
    return isinstance(module, (LinearTile, EmbeddingTile))


def tile_rows(tile: nn.Module) -> int:
    """A tile's rows, also while the engine holds its weight released (empty)."""
    return tile.out_features if isinstance(tile, LinearTile) else tile.num_embeddings


# ---- tied weights ([Note: tied tiles]) -------------------------------------------------------------


class _Pass:
    """An embedding call of a tie whose backward has not run (alive while its graph is)."""


class _Stash:
    """The head's weight-gradient parts of each tile, waiting for the embedding's backward."""

    def __init__(self, num_tiles: int):
        self.parts: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[] for _ in range(num_tiles)]
        self.passes: weakref.WeakSet = weakref.WeakSet()
        self.between: Callable[[], None] | None = None  # set by the unit hooks ([Note: between a unit's ops])

    def add(self, index: int, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
        g = grad_out.reshape(-1, grad_out.shape[-1])  # tokens x rows
        x = inp.reshape(-1, inp.shape[-1])  # tokens x cols
        if g.shape[0] < x.shape[1]:  # fewer tokens than columns: the slices are smaller than the product
            self.parts[index].append((g, x))
        else:
            self.parts[index].append((g.t() @ x, None))

    def take(self, index: int) -> torch.Tensor | None:
        total = None
        for a, b in self.parts[index]:
            part = a if b is None else self._product(a, b)
            total = part if total is None else total + part
        self.parts[index] = []
        return total

    def _product(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """g.t() @ x, the tile's weight-gradient part: one op of the tail of backward as long as a
        tile's update, so it runs in blocks of rows with `between` after each (the same values:
        each row is its own product)."""
        rows = max(1, _PRODUCT_BLOCK // x.shape[1])
        if self.between is None or g.shape[1] <= rows:
            return g.t() @ x
        out = torch.empty(g.shape[1], x.shape[1], dtype=torch.result_type(g, x), device=x.device)
        for r in range(0, g.shape[1], rows):
            torch.matmul(g[:, r:r + rows].t(), x, out=out[r:r + rows])
            self.between()
        return out


_PRODUCT_BLOCK = 1 << 21  # elements of a tile's weight-gradient product between two `between` calls


class _HeadGradSink(torch.autograd.Function):
    """Identity on an embedding tile's output; its backward adds the head's part of the tile's
    weight gradient."""

    @staticmethod
    def forward(ctx, weight, out, stash, index):
        ctx.stash, ctx.index = stash, index
        ctx.pass_ = _Pass()
        stash.passes.add(ctx.pass_)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        gw = ctx.stash.take(ctx.index)
        ctx.stash.passes.discard(ctx.pass_)
        return gw, grad, None, None


class _TiedHead(torch.autograd.Function):
    """The product of a tied head's input with every tile, one tile gathered at a time."""

    @staticmethod
    def forward(ctx, x, tiles, stash):
        outs = [t(x.view_as(x), "linear") for t in tiles]  # no autograd in here: the hooks release each
        ctx.tiles, ctx.stash = tiles, stash
        ctx.save_for_backward(x)
        return torch.cat(outs, -1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = None
        start = 0
        for t in ctx.tiles:
            g = grad[..., start:start + t.num_embeddings]
            start += t.num_embeddings
            with GatheredParameters([t.weight]):
                part = g @ t.weight
            dx = part if dx is None else dx + part
            ctx.stash.add(t.index, g, x)
        return dx, None, None


# ---- the tiled modules ---------------------------------------------------------------------------


def _merge_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict(): the tiles' rows under the original name `weight`."""
    keys = [f"{prefix}tiles.{i}.weight" for i in range(len(module.tiles))]
    if all(k in state_dict for k in keys):
        state_dict[prefix + "weight"] = torch.cat([state_dict.pop(k) for k in keys])


def _split_hook(module, state_dict, prefix, *args) -> None:
    """load_state_dict(): `weight` cut into the tiles' rows."""
    w = state_dict.pop(prefix + "weight", None)
    if w is not None:
        for i, t in enumerate(module.tiles):
            state_dict[f"{prefix}tiles.{i}.weight"] = w[t.row_start:t.row_start + tile_rows(t)]


class _Tiled(nn.Module):
    tiles: nn.ModuleList

    def _install_name_hooks(self) -> None:
        self.register_state_dict_post_hook(_merge_hook)
        self.register_load_state_dict_pre_hook(_split_hook)

    @property
    def weight(self) -> torch.Tensor:
        """The tiles concatenated ([Note: memory-centric tiling]: whole only where they are gathered)."""
        return torch.cat([t.weight for t in self.tiles])


class TiledLinear(_Tiled):
    """An nn.Linear whose weight is row tiles (`tiles`), `y = x W^T + b` tile by tile."""

    def __init__(self, tiles: list[nn.Module], in_features: int, bias: nn.Parameter | None,
                 stash: _Stash | None = None, tiles_module: nn.ModuleList | None = None):
        super().__init__()
        self.in_features = in_features
        self.tiles = tiles_module if tiles_module is not None else nn.ModuleList(tiles)
        self.out_features = sum(t.weight.shape[0] for t in self.tiles)
        self.bias = bias
        self._stash = stash
        self._install_name_hooks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # no tokens (a chunked loss took the hidden states): no tile is needed
            y = x.new_zeros(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self._stash is not None and torch.is_grad_enabled() and len(self._stash.passes):
            y = _TiedHead.apply(x, list(self.tiles), self._stash)  # [Note: tied tiles]
        elif self._stash is not None:
            y = torch.cat([t(x.view_as(x), "linear") for t in self.tiles], -1)
        else:
            y = torch.cat([t(x.view_as(x)) for t in self.tiles], -1)
        return y if self.bias is None else y + self.bias

    def loss(self, x: torch.Tensor, tokens: "ScoredTokens") -> torch.Tensor:
        """Each tile's part of a chunked loss of `x` ([Note: the chunked LM loss]): zeros that
        carry the graph."""
        if self.bias is not None:
            raise ValueError("a chunked loss needs a head without bias")
        if self._stash is not None and torch.is_grad_enabled() and len(self._stash.passes):
            return TiedLoss.apply(x, list(self.tiles), tokens, self._stash)  # [Note: tied tiles]
        zero = None
        for t in self.tiles:
            part = t(x.view_as(x), "loss", tokens)
            zero = part if zero is None else zero + part
        return zero

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"

    def init_stand_in(self) -> nn.Linear:
        """An nn.Linear of the original shape whose weight is on meta and whose bias is this
        module's: what a model's `_init_weights(module)` or `reset_parameters()` initialises in
        place of the tiled module, which neither knows ([Note: deferred initialisation] in
        zero/init.py). The tiles' rows are initialised as Linears of their own."""
        shell = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        shell.bias = self.bias
        return shell


class TiledEmbedding(_Tiled):
    """An nn.Embedding whose weight is row tiles; a lookup calls only the tiles it needs."""

    def __init__(self, tiles: nn.ModuleList, padding_idx: int | None, stash: _Stash | None,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.tiles = tiles
        self.num_embeddings = sum(t.weight.shape[0] for t in tiles)
        self.embedding_dim = tiles[0].weight.shape[1]
        self.padding_idx = padding_idx
        self._stash = stash
        # Gemma's scaled word embedding: the lookup times this (a buffer, as there)
        self.embed_scale = nn.Buffer(embed_scale, persistent=False) if embed_scale is not None else None
        self._install_name_hooks()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        every = self._stash is not None and torch.is_grad_enabled()  # [Note: tied tiles]: a sink per tile
        parts, where = [], []
        for t in self.tiles:
            lo, hi = t.row_start, t.row_start + t.num_embeddings
            pos = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if pos.numel() == 0 and not every:
                continue
            parts.append(t(flat[pos] - lo))
            where.append(pos)
        order = torch.cat(where) if where else flat.new_empty(0)
        if order.numel() != flat.numel():
            raise IndexError(f"index out of range in self: ids must be in [0, {self.num_embeddings})")
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = torch.cat(parts)[inverse].view(*ids.shape, self.embedding_dim)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tiles={len(self.tiles)}"


# ---- the transformation --------------------------------------------------------------------------


def _row_bounds(rows: int, cols: int, tile_size: int) -> list[tuple[int, int]]:
    per = max(1, tile_size // cols)
    count = -(-rows // per)
    per = -(-rows // count)  # equal tiles, the last one at most smaller
    return [(lo, min(rows, lo + per)) for lo in range(0, rows, per)]


def _rows(weight: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
    if weight.is_meta:  # built under infinity.Init: the tiles are initialised when their unit is built
        return torch.empty(hi - lo, weight.shape[1], dtype=weight.dtype, device="meta")
    return weight.detach()[lo:hi].clone()


def _make_tiles(kind: type, weight: nn.Parameter, bounds: list[tuple[int, int]], padding_idx: int | None,
                stash: _Stash | None) -> nn.ModuleList:
    tiles = []
    for i, (lo, hi) in enumerate(bounds):
        if kind is LinearTile:
            t = LinearTile(weight.shape[1], hi - lo, bias=False, device="meta")
        else:
            local = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
            t = EmbeddingTile(hi - lo, weight.shape[1], padding_idx=local, device="meta")
            t.stash, t.index = stash, i
        t.weight = nn.Parameter(_rows(weight, lo, hi), requires_grad=weight.requires_grad)
        t.row_start = lo
        tiles.append(t)
    return nn.ModuleList(tiles)


def _scaled_word_embedding(module: nn.Module) -> bool:
    """Gemma's `*ScaledWordEmbedding` (transformers): an nn.Embedding whose forward is the lookup
    times its `embed_scale` buffer."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and isinstance(getattr(module, "embed_scale", None), torch.Tensor))


def _tileable(module: nn.Module) -> bool:
    if type(module) is nn.Embedding or _scaled_word_embedding(module):  # other subclasses: their own forward
        return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return type(module) is nn.Linear


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for _, parent in model.named_modules(remove_duplicate=False):
        for name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, name, new)


def weights_to_tile(model: nn.Module, tile_size: int,
                    tied_size: int | None = None) -> list[tuple[nn.Parameter, list[nn.Module], int]]:
    """The weights `tile_model` tiles (each with the modules holding it and its tile size): 2-D
    weights of more than `tile_size` elements (`tied_size` for one an nn.Embedding and an
    nn.Linear share) held only by plain nn.Linear / nn.Embedding modules as `.weight`."""
    if tile_size <= 0:
        return []
    tied_size = tile_size if tied_size is None else min(tile_size, tied_size)
    holders: dict[int, list[nn.Module]] = {}
    weights: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(m)
            weights[id(p)] = p
    out = []
    for pid, mods in holders.items():
        w = weights[pid]
        tied = any(isinstance(m, nn.Embedding) for m in mods) and any(isinstance(m, nn.Linear) for m in mods)
        size = tied_size if tied else tile_size
        if (w.dim() == 2 and w.numel() > size and all(_tileable(m) and m.weight is w for m in mods)
                and sum(isinstance(m, nn.Embedding) for m in mods) <= 1 and sum(isinstance(m, nn.Linear) for m in mods) <= 1):
            out.append((w, mods, size))
    return out


def tile_model(model: nn.Module, tile_size: int, groups: list[dict] | None = None,
               tied_size: int | None = None) -> dict[int, list[nn.Parameter]]:
    """[Note: memory-centric tiling] Tiles every plain nn.Linear / nn.Embedding weight of more
    than `tile_size` elements (a tied one: `tied_size`, where smaller: [Note: a tied weight's
    tiles] in infinity/offload/optimizer/sizing.py), in place; 0 tiles nothing. The optimizer
    `groups` get the tiles in place of the weight. Returns id(original weight) -> its tiles."""
    done: dict[int, list[nn.Parameter]] = {}
    for w, mods, size in weights_to_tile(model, tile_size, tied_size):
        embeddings = [m for m in mods if isinstance(m, nn.Embedding)]
        linears = [m for m in mods if isinstance(m, nn.Linear)]
        bounds = _row_bounds(w.shape[0], w.shape[1], size)
        stash = _Stash(len(bounds)) if embeddings and linears else None
        if embeddings:
            e = embeddings[0]
            tiles = _make_tiles(EmbeddingTile, w, bounds, e.padding_idx, stash)
            scale = e.embed_scale if _scaled_word_embedding(e) else None
            _replace(model, e, TiledEmbedding(tiles, e.padding_idx, stash, scale))
        else:
            tiles = _make_tiles(LinearTile, w, bounds, None, None)
        if linears:
            lin = linears[0]
            _replace(model, lin, TiledLinear([], lin.in_features, lin.bias, stash, tiles_module=tiles))
        done[id(w)] = [t.weight for t in tiles]
        log.info("infinity: tiled a %s weight of %s into %d tiles of at most %d rows",
                 "tied" if stash else type(mods[0]).__name__, tuple(w.shape), len(bounds), bounds[0][1])
    if groups:
        _retarget_groups(groups, done)
    return done


def _retarget_groups(groups: Iterable[dict], done: dict[int, list[nn.Parameter]]) -> None:
    for g in groups:
        params = []
        for p in g["params"]:
            params += done.get(id(p), [p])
        g["params"] = params


# ---- names outside the module ------------------------------------------------------------------


def _tiled_modules(model: nn.Module) -> list[tuple[str, _Tiled, list[str]]]:
    """(name of each tiled module, under every name it has; it; its tiles' parameter names)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return [(name, m, [canonical[id(t.weight)] for t in m.tiles])
            for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, _Tiled)]


def merge_tiles(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict keyed by parameter names (the engine's, `consolidated_state_dict()`) with
    each tiled weight under its original names (a tied one under each, as the engine's own
    state dicts name a tied weight), its tiles concatenated."""
    out = dict(state)
    used: set[str] = set()
    merged: dict[tuple[str, ...], torch.Tensor] = {}  # a tied weight: one tensor under each name
    for name, _, keys in _tiled_modules(model):
        if all(k in state for k in keys):
            whole = merged.get(tuple(keys))
            if whole is None:
                whole = merged[tuple(keys)] = torch.cat([state[k] for k in keys])
            out[f"{name}.weight" if name else "weight"] = whole
            used.update(keys)
    for k in used:
        del out[k]
    return out


def tile_names(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """Original weight name -> (tile parameter name, first row, rows) of each tile: how a
    checkpoint or a Hugging Face file with the original names maps onto the tiles."""
    return {f"{name}.weight" if name else "weight":
            [(k, t.row_start, tile_rows(t)) for k, t in zip(keys, m.tiles)]
            for name, m, keys in _tiled_modules(model)}


def tied_stashes(modules: Iterable[nn.Module]) -> list[_Stash]:
    """The stashes of the tied weights among `modules` and their children, each once ([Note: tied
    tiles]): the unit hooks give them `between` ([Note: between a unit's ops] in hooks.py)."""
    found: dict[int, _Stash] = {}
    for module in modules:
        for m in module.modules():
            stash = m._stash if isinstance(m, _Tiled) else None
            if stash is not None:
                found[id(stash)] = stash
    return list(found.values())


def tiled_weights(model: nn.Module) -> dict[str, list[str]]:
    """Original weight name -> its tiles' parameter names in row order, each tiled weight once
    (a tied one under its first name, as an export names a tied weight): how an export writes
    the tiles back as the user's weight."""
    out: dict[str, list[str]] = {}
    seen: set[tuple[str, ...]] = set()
    for weight, parts in tile_names(model).items():
        keys = tuple(k for k, _, _ in parts)
        if keys not in seen:
            seen.add(keys)
            out[weight] = list(keys)
    return out
