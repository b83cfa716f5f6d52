"""What `infinity estimate` knows of a model: its units ([Note: choosing units] in
infinity/zero/partitioner.py), each split into trainable and frozen elements, from a parameter
count, a preset or a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

from infinity.config import ZeroConfig
from infinity.apps.models.presets import (
    SHAPE_KEYS,
    layer_linears,
    layer_param_count,
    preset,
    root_param_count,
)

DEFAULT_UNITS = 32  # --params alone: units assumed P/32 each


class UnitSize(NamedTuple):
    """Parameter elements of one unit, whole (not sharded)."""

    trainable: int
    frozen: int

    @property
    def numel(self) -> int:
        return self.trainable + self.frozen


def _split(numel: int, frozen_fraction: float) -> UnitSize:
    frozen = round(numel * frozen_fraction)
    return UnitSize(numel - frozen, frozen)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    """What the estimate needs to know of a model: its units ([Note: choosing units] in
    infinity/zero/partitioner.py), each split into trainable and frozen elements."""

    name: str
    """What the user named: a preset or a model directory; empty for a parameter count."""
    layer: UnitSize
    """Each of the `num_layers` equal units (the decoder layers)."""
    num_layers: int
    root: UnitSize
    """What no layer holds: embeddings, final norm, LM head (less their tiles)."""
    exact: bool
    """Units from an architecture; False: assumed from a parameter count."""
    tiles: tuple[UnitSize, ...] = ()
    """Weights over `zero_optimization.tile_size`, as the engine tiles them ([Note: memory-centric
    tiling] in infinity/zero/tiling.py): each tile a unit of its own, taken out of its layer or root."""

    @property
    def units(self) -> list[UnitSize]:
        """Every unit with parameters, in backward order (the root, the tiles, then the last layer first)."""
        return [u for u in [self.root, *self.tiles] + [self.layer] * self.num_layers if u.numel]

    @property
    def trainable(self) -> int:
        return self.num_layers * self.layer.trainable + self.root.trainable + sum(t.trainable for t in self.tiles)

    @property
    def frozen(self) -> int:
        return self.num_layers * self.layer.frozen + self.root.frozen + sum(t.frozen for t in self.tiles)

    @property
    def numel(self) -> int:
        return self.trainable + self.frozen


def model_from_count(params: int, largest_unit: int | None = None, frozen_fraction: float = 0.0) -> ModelSize:
    """A model known by its parameter count only: units of `largest_unit` elements (default
    params/32), the remainder in the root unit; `frozen_fraction` of every unit frozen."""
    unit = largest_unit or -(-params // DEFAULT_UNITS)
    layers = params // unit
    return ModelSize(name="", layer=_split(unit, frozen_fraction), num_layers=layers,
                     root=_split(params - layers * unit, frozen_fraction), exact=False)


def lora_param_count(cfg: dict, rank: int) -> int:
    """LoRA adapter elements of one decoder layer: A (rank x in) and B (out x rank) on each of
    q, k, v, o, gate, up and down (PEFT's layout, no bias)."""
    return rank * sum(n_in + n_out for n_in, n_out in layer_linears(cfg).values())


def model_from_config(name: str, cfg: dict, lora_rank: int | None = None, frozen_fraction: float = 0.0) -> ModelSize:
    """A Llama-style model from its config: decoder layers and the root unit. `lora_rank`: only
    adapters of that rank are trainable, the base model is frozen; else `frozen_fraction` of
    every unit is frozen."""
    tile = ZeroConfig().tile_size
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    # (rows, columns) of the weights the engine tiles: the embedding and an untied head, and a
    # layer's projections over the tile size (under LoRA too: the wrapped projection is a child)
    roots = [(vocab, h)] * (1 if cfg.get("tie_word_embeddings", False) else 2)
    linears = [(n_out, n_in) for n_in, n_out in layer_linears(cfg).values()]
    root_tiled = [w for w in roots if tile and w[0] * w[1] > tile]
    layer_tiled = [w for w in linears if tile and w[0] * w[1] > tile]
    layer = layer_param_count(cfg) - sum(r * c for r, c in layer_tiled)
    root = root_param_count(cfg) - sum(r * c for r, c in root_tiled)
    tiles = [n for r, c in root_tiled for n in _tile_sizes(r, c, tile)]
    layer_tiles = [n for r, c in layer_tiled for n in _tile_sizes(r, c, tile)] * cfg["num_hidden_layers"]
    if lora_rank:
        layer_size, root_size = UnitSize(lora_param_count(cfg, lora_rank), layer), UnitSize(0, root)
        tile_sizes = tuple(UnitSize(0, n) for n in tiles + layer_tiles)
    else:
        layer_size, root_size = _split(layer, frozen_fraction), _split(root, frozen_fraction)
        tile_sizes = tuple(_split(n, frozen_fraction) for n in tiles + layer_tiles)
    return ModelSize(name=name, layer=layer_size, num_layers=cfg["num_hidden_layers"], root=root_size, exact=True,
                     tiles=tile_sizes)


def _tile_sizes(rows: int, cols: int, tile_size: int) -> list[int]:
    """Elements of each row tile of a rows x cols weight (the tiler's cut: whole rows, at most
    `tile_size` elements a tile)."""
    per = max(1, tile_size // cols)
    return [min(per, rows - r) * cols for r in range(0, rows, per)]


def load_architecture(spec: str) -> tuple[str, dict]:
    """(name, LlamaConfig keys) of a Hugging Face model directory (its config.json, read as
    JSON: no model code runs), a config.json itself, or a preset name."""
    path = spec if spec.endswith(".json") else os.path.join(spec, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object")
        bad = [k for k in SHAPE_KEYS if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int)
               or cfg[k] < 1]
        if bad:
            raise ValueError(f"{path}: not a Llama-style config: expected positive integers for {', '.join(bad)}")
        return spec, cfg
    if os.path.isdir(spec):
        raise ValueError(f"{spec}: a directory without config.json")
    if os.sep in spec or spec.endswith(".json"):
        raise ValueError(f"{spec}: no such file or directory")
    try:
        return spec, preset(spec)
    except ValueError as e:
        raise ValueError(f"{e}; or a Hugging Face model directory with a config.json") from None
