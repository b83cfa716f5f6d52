"""The nn.Module face of the engine: DeepSpeed's engine is a Module whose one child is the
model, and frameworks and DeepSpeed's own tests walk it as one (`named_parameters()`,
`modules()`, accelerate's `unwrap_model` reading `_modules`). Each call answers for the model
the engine wraps; the engine adds no parameter or buffer of its own."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from infinity.zero.tiling import merge_tiles


def named_state(module: nn.Module, values: dict[int, torch.Tensor], *, keep_unlisted: bool) -> dict[str, torch.Tensor]:
    """A state dict of `module` under its state_dict names: each parameter's tensor from `values`
    (by id; one not listed is left out, or with `keep_unlisted` taken as it is), persistent
    buffers copied, a tiled weight's tiles joined under the weight's own name ([Note: tiles in
    an export] in infinity/checkpoint/export.py)."""
    out: dict[str, torch.Tensor] = {}
    for module_name, m in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in m.named_parameters(recurse=False):
            if id(p) in values or keep_unlisted:
                out.setdefault(prefix + name, values[id(p)] if id(p) in values else p.detach().cpu())
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:  # noqa: SLF001 (what state_dict skips)
                out[prefix + name] = b.detach().cpu().clone()
    return merge_tiles(module, out)


class ModuleSurface:
    module: nn.Module

    @property
    def _modules(self) -> dict[str, nn.Module]:
        """nn.Module's table of children: the model, under DeepSpeed's name for it."""
        return {"module": self.module}

    @property
    def training(self) -> bool:
        return self.module.training

    def children(self) -> Iterator[nn.Module]:
        yield self.module

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        yield "module", self.module

    def modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def named_modules(self, *args, **kwargs) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters by the model's names (DeepSpeed's engine prefixes none either:
        its forward and save paths strip "module.")."""
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(*args, **kwargs)
