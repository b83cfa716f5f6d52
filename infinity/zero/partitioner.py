"""Which modules become units.

[Note: choosing units]
By default the units are the modules of the class that fills the largest nn.ModuleList /
nn.Sequential whose children are all of one class (the transformer block of nearly every
model, a list of one included), wherever that class occurs outside another unit (so an
encoder-decoder's encoder and decoder blocks both are units); if a model has none, each direct
child holding parameters is a unit, and a child that is a ModuleList / ModuleDict gives its own
children instead, since a container is never called and its forward hook would never gather it.
The user can name module classes or pass a callable `(qualified_name, module) -> bool`
instead. Whatever no unit claims (embeddings, final norm, LM head) forms the root unit; it is
gathered for the root module's whole forward (which may use any of its parameters, also outside
the module that holds it: `h @ self.emb.weight.t()`) and by the forward of every module that
holds one of its parameters directly, so calling any submodule on its own
(`model.get_input_embeddings()(ids)`) gathers what it needs. A
parameter shared by modules of two units (tied embeddings) goes to the root unit too, because it
is used at two different times. Parameters of at most `persistence_threshold` elements form one
persistent unit that is never released (as DeepSpeed's stage3_param_persistence_threshold).

Each tile of a tiled weight ([Note: memory-centric tiling] in tiling.py) is a unit of its own,
gathered by the tile's forward, also where the tiled module sits inside a block (the block's
unit is then the rest of the block); a list of tiles is never taken for the list of blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Union

from torch import nn

from infinity.zero.tiling import is_tile

UnitPolicy = Union[Sequence[type], Callable[[str, nn.Module], bool], None]


class UnitPlan(NamedTuple):
    """Modules whose forward gathers each unit, and the named parameters of each unit."""

    name: str
    modules: list[nn.Module]  # the forward pre-hook of each gathers the unit
    params: list[tuple[str, nn.Parameter]]


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called: their children are


def _called_children(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of `module` holding parameters, with containers replaced by their children."""
    out = []
    for name, child in module.named_children():
        name = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS):
            out += _called_children(name, child)
        elif any(True for _ in child.parameters()):
            out.append((name, child))
    return out


def _auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    best_key = (0, 0)
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0:
            continue
        kids = list(m.named_children())
        if len({type(k) for _, k in kids}) != 1 or isinstance(kids[0][1], _CONTAINERS) or is_tile(kids[0][1]):
            continue  # mixed, containers that are never called themselves, or tiles (units already)
        key = (sum(p.numel() for p in m.parameters()), len(kids))  # a tie: the list with more blocks
        if key > best_key and key[0] > 0:
            best = [(f"{name}.{k}" if name else k, child) for k, child in kids]
            best_key = key
    if best:  # every list of that class: an encoder's blocks and a decoder's
        block = type(best[0][1])
        lists = {id(m) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0
                 and all(type(c) is block for c in m.children())}
        children = {id(c) for name, m in model.named_modules() if id(m) in lists for c in m.children()}
        return _select(model, lambda _name, module: id(module) in children)
    return _called_children("", model)


def _select(model: nn.Module, policy: UnitPolicy) -> list[tuple[str, nn.Module]]:
    if policy is None:
        return _auto_blocks(model)
    if callable(policy) and not isinstance(policy, (list, tuple)):
        match = policy
    else:
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) for c in classes):
            raise TypeError(f"units: expected module classes or a callable, got {policy!r}")
        match = lambda _name, module: isinstance(module, classes)  # noqa: E731
    chosen: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()
    for name, m in model.named_modules():
        if m is model or any(name.startswith(t + ".") for t in taken):
            continue  # outermost match wins: a unit is never nested in another
        if match(name, m):
            if isinstance(m, _CONTAINERS):
                raise ValueError(f"units: {name} is a {type(m).__name__}, which is never called, so its forward "
                                 f"could not gather it; name the class of its elements instead")
            chosen.append((name, m))
            taken.add(name)
    return chosen


def plan_units(model: nn.Module, policy: UnitPolicy = None, persistence_threshold: int = 0) -> tuple[
        list[UnitPlan], list[tuple[str, nn.Parameter]]]:
    """(units in module order, the last one the root; persistent parameters)."""
    blocks = _select(model, policy)
    tiles = [(name, m) for name, m in model.named_modules() if is_tile(m)]
    tiled = {id(m.weight) for _, m in tiles}
    blocks = [(name, m) for name, m in blocks if not is_tile(m)]
    owner: dict[int, int] = {}  # id(param) -> block index, or -1 when shared between blocks
    for i, (_, block) in enumerate(blocks):
        for p in block.parameters():
            if id(p) not in tiled:
                owner[id(p)] = i if owner.get(id(p), i) == i else -1

    per_block: list[list[tuple[str, nn.Parameter]]] = [[] for _ in blocks]
    root: list[tuple[str, nn.Parameter]] = []
    persistent: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():  # deduplicated: a tied parameter appears once
        if id(p) in tiled:
            continue
        if 0 < p.numel() <= persistence_threshold:
            persistent.append((name, p))
        elif owner.get(id(p), -1) >= 0:
            per_block[owner[id(p)]].append((name, p))
        else:
            root.append((name, p))
    plans = [UnitPlan(n, [m], ps) for (n, m), ps in zip(blocks, per_block) if ps]
    plans += [UnitPlan(name, [m], [(f"{name}.weight", m.weight)]) for name, m in tiles]
    in_root = {id(p) for _, p in root}
    owners = [m for m in model.modules() if m is model or any(id(p) in in_root for p in m.parameters(recurse=False))]
    plans.append(UnitPlan("<root>", owners, root))
    return plans, persistent
