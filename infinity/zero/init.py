"""Building a model too large for host memory: `infinity.Init` (DeepSpeed's `zero.Init`).

[Note: deferred initialisation]
Inside `with infinity.Init():` modules are created on the meta device (torch's own
`torch.device("meta")` mode: no global of torch or nn.Module is patched), so constructing a
model of any size costs no memory. `initialize` then builds it one unit at a time
(`DeferredInit.materialize`): the modules that hold the unit's parameters get real host memory,
filled with NaN; the model's own initialisation runs on them (a Hugging Face model's
`_init_weights(module)`, else the module's `reset_parameters()`; a tiled Linear's bias through an
nn.Linear stand-in, since neither knows the tiled module); the unit's shard is cut and
handed to its tiers, and the unit's memory is freed before the next unit is built. Peak host
memory is about one unit plus the tiers' pools. A parameter that nothing initialised is still
NaN, and that is an error naming it, never a silent garbage weight. Buffers of modules that hold
no parameters (rotary tables) are built the same way at the end. Parameters keep their identity
(`torch.utils.swap_tensors`), so tied weights stay tied and the units' references stay valid.

[Note: values written before initialize]
Hugging Face's ZeRO-3 `from_pretrained` builds the model under `deepspeed.zero.Init` and then,
module by module, gathers the parameters with `GatheredParameters(params, modifier_rank=0)`,
writes the checkpoint's values into them on rank 0, and expects the exit to keep them
(`from_config` runs the model's init the same way). Before `initialize` there is no unit to
gather, so `GatheredParameters` on meta parameters (`written_before_initialize`) gives each one
host memory for the body of the `with` (the values an earlier such block wrote, else NaN),
and at the exit broadcasts the modifier's values, keeps a host copy of what was written (a
parameter still all NaN was not written) and puts the parameter back on meta. Memory at a time
is the block's parameters, plus the copies kept; `initialize` builds each unit from the copies
(the model's init runs only for parameters nobody wrote) and drops them as it goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from infinity.zero import dist as zdist

# [Note: values written before initialize]: meta parameter -> its values (host), until its unit is built
_written: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Init:
    """`with infinity.Init(config=...): model = Model(...)`: the model is built on the meta
    device; `infinity.initialize` materialises it unit by unit ([Note: deferred initialisation]).
    `config` (a DeepSpeed config, dict or path) and DeepSpeed's other arguments are accepted for
    compatibility; what they describe is decided by the config given to `initialize`."""

    def __init__(self, module: nn.Module | None = None, config: Any = None, enabled: bool = True,
                 config_dict_or_path: Any = None, **deepspeed_options: Any):
        if module is not None:
            raise TypeError("module: infinity.Init builds models created inside its `with` block; an existing "
                            "module is partitioned by infinity.initialize itself")
        self.enabled = enabled
        self._device: torch.device | None = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


def is_deferred(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


class DeferredInit:
    """Materialises a meta-device model's modules on the host as their units are built."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self.owners: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(m)
        hf_init = getattr(model, "_init_weights", None)
        self._init = hf_init if callable(hf_init) else None
        self._lora = _lora_layers(model)  # [Note: peft adapters under Init]

    def materialize(self, params: list[nn.Parameter]) -> None:
        """Builds and initialises every module holding one of `params` that is still on meta."""
        modules = {id(m): m for p in params for m in self.owners.get(id(p), ())}
        for m in modules.values():
            self._build(m)
        self._reset_lora()

    def _reset_lora(self) -> None:
        """[Note: peft adapters under Init]: the LoRA layers now wholly built."""
        for key, (layer, adapters) in list(self._lora.items()):
            if any(p.is_meta for p in layer.parameters()):
                continue
            with torch.no_grad():
                for adapter, init in adapters.items():
                    layer.reset_lora_parameters(adapter, init)
            del self._lora[key]

    def finish(self) -> None:
        """The modules left on meta (those holding only buffers), then a check that none is."""
        for m in self.model.modules():
            self._build(m)
        self._reset_lora()

    def _build(self, module: nn.Module) -> None:
        fresh: list[tuple[str, torch.Tensor]] = []
        written: list[tuple[nn.Parameter, torch.Tensor]] = []
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                value = _written.pop(p, None)  # [Note: values written before initialize]
                _give_memory(p, _nan_empty(p))
                if value is None:
                    fresh.append((name, p))
                else:
                    written.append((p, value))
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                module._buffers[name] = _nan_empty(b)  # noqa: SLF001 (what Module.to_empty does)
                fresh.append((name, module._buffers[name]))  # noqa: SLF001
        if fresh:
            self._initialise(module, fresh)
        with torch.no_grad():  # after the model's init, which runs on the whole module: what was written wins
            for p, value in written:
                p.copy_(value)

    def _initialise(self, module: nn.Module, fresh: list[tuple[str, torch.Tensor]]) -> None:
        stand_in = getattr(module, "init_stand_in", None)  # a tiled Linear (zero/tiling.py): its bias
        target = stand_in() if stand_in is not None else module
        with torch.no_grad():
            if self._init is not None:
                self._init(target)
            elif hasattr(target, "reset_parameters"):
                target.reset_parameters()
            elif hasattr(target, "_reset_parameters"):  # nn.MultiheadAttention
                target._reset_parameters()  # noqa: SLF001
        for name, t in fresh:
            if t.is_floating_point() and torch.isnan(t).any():
                where = self.names.get(id(module), type(module).__name__)
                how = ("the model's _init_weights(module) left it unset" if self._init is not None
                       else f"{type(module).__name__} has no reset_parameters()")
                raise ValueError(f"{where}.{name}: built under infinity.Init, but nothing initialised it ({how}); "
                                 "give the module a reset_parameters() method or the model an "
                                 "_init_weights(module) method, or build the model without Init")


def _give_memory(param: nn.Parameter, data: torch.Tensor) -> None:
    """`param` (the same object: units, ties and a framework's references still point at it)
    now holds `data`; its attributes (transformers marks `_is_hf_initialized`) and class stay."""
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    new.__class__ = type(param)
    kept = _written.pop(param, None)  # swap_tensors refuses a tensor that a weak reference points at
    torch.utils.swap_tensors(param, new)  # swaps __dict__ and __class__ too: hence the copies above
    if kept is not None:
        _written[param] = kept


@contextmanager
def written_before_initialize(params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    """`GatheredParameters` on parameters built under Init and not built yet ([Note: values
    written before initialize]): host memory for the body; with `modifier_rank`, what that
    rank wrote is kept for `initialize`."""
    params = list({id(p): p for p in params}.values())
    for p in params:
        before = _written.get(p)
        _give_memory(p, before.clone() if before is not None else _nan_empty(p))
    try:
        yield
    finally:
        for p in params:
            value = p.detach()
            if modifier_rank is not None:
                zdist.broadcast(value, modifier_rank)
                if not (value.is_floating_point() and torch.isnan(value).all()):
                    _written[p] = value.clone()
            _give_memory(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def _lora_layers(model: nn.Module) -> dict[int, tuple[nn.Module, dict[str, Any]]]:
    """[Note: peft adapters under Init]
    peft sets a LoRA layer's adapters as it wraps the model (lora_A drawn, lora_B zero, so the
    adapted model starts as the base). Under Init that ran on meta tensors, and the model's own
    init would then draw both at random: once a layer is built, its adapters are set again the
    way peft sets them (`reset_lora_parameters` with the adapter's `init_lora_weights`).
    Initialisations computed from the base weights (PiSSA, OLoRA, LoftQ, DoRA's magnitudes)
    cannot run before those weights are loaded, nor are other tuners' layers set again: both are
    refused. Returns id -> (layer, adapter -> init) of the LoRA layers still on meta."""
    layers: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
    peft_config = getattr(model, "peft_config", None)
    for name, m in model.named_modules():
        if not any(p.is_meta for p in m.parameters()):
            continue
        lora = callable(getattr(m, "reset_lora_parameters", None))
        if hasattr(m, "adapter_layer_names") and not lora:
            raise ValueError(f"{name}: a peft {type(m).__name__} layer built under infinity.Init; only LoRA "
                             "adapters are set again once built: build this peft model without infinity.Init")
        if not lora:
            continue
        adapters = {}
        for adapter in getattr(m, "lora_A", {}).keys():
            cfg = peft_config.get(adapter) if isinstance(peft_config, dict) else None
            init = getattr(cfg, "init_lora_weights", None)
            what = "use_dora" if getattr(cfg, "use_dora", False) else f"init_lora_weights={init!r}"
            if what == "use_dora" or init not in (True, False, "gaussian"):
                raise ValueError(f"{name}: a peft adapter built under infinity.Init with {what}, which peft "
                                 "computes from base weights not loaded yet (under Init only init_lora_weights "
                                 "True, False and 'gaussian' can be set once the layer is built): build the "
                                 "peft model without infinity.Init")
            adapters[adapter] = init
        layers[id(m)] = (m, adapters)
    return layers


def _nan_empty(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if out.is_floating_point():
        out.fill_(float("nan"))
    return out
