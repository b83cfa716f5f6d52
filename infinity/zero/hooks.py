"""Module and autograd hooks that gather units before they run and reduce their gradients after.

Forward: a unit's module gets a pre-hook (gather) and a post-hook (release, or keep; see
[Note: recorded order] in fetcher.py). The post-hook also threads the outputs that require grad
through `_PreBackward`, an identity whose backward gathers the unit again before autograd runs
the unit's backward (autograd saved the parameters by reference; see [Note: parameter storage
swap] in unit.py).

Backward: each parameter has a post-accumulate-grad hook; when every parameter of a unit that
requires grad has its gradient, the unit's gradient is reduce-scattered and handed to the
optimizer tier, and the unit is released. `finish_backward` does the same for units some of
whose parameters got no gradient, in unit order, so that every rank runs the same collectives.

During backward, forward hooks fire again for activation-checkpointing recomputation: the
pre-hook gathers as usual and the post-hook keeps the unit, whose backward is about to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from infinity.zero.fetcher import Fetcher
from infinity.zero.unit import Unit


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hooks: "UnitHooks", unit: Unit, *tensors: torch.Tensor):
        ctx.hooks, ctx.unit = hooks, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.hooks.pre_backward(ctx.unit)
        return (None, None, *grads)


class UnitHooks:
    def __init__(self, units: list[Unit], modules: list[torch.nn.Module], fetcher: Fetcher,
                 on_unit_grads: Callable[[Unit], None]):
        self.units = units
        self.fetcher = fetcher
        self.on_unit_grads = on_unit_grads
        self.in_backward = False
        self.reduce_seconds = 0.0
        self._pending: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._handles: list[RemovableHandle] = []
        for unit, module in zip(units, modules):
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
                self._handles.append(module.register_forward_hook(self._post_forward(unit)))
            for slot in unit.slots:
                if slot.param.requires_grad:
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(unit)))
        self.reset_backward()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- forward --------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            self.fetcher.acquire(unit)
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if not self.in_backward:
                self.fetcher.release(unit)
            if not torch.is_grad_enabled():
                return output
            flat, spec = pytree.tree_flatten(output)
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return output
            wrapped = _PreBackward.apply(self, unit, *(flat[i] for i in idx))
            for i, t in zip(idx, wrapped):
                flat[i] = t
            return pytree.tree_unflatten(flat, spec)
        return hook

    # ---- backward -------------------------------------------------------------------------

    def reset_backward(self) -> None:
        self._pending = {u.index: u.params_requiring_grad() for u in self.units}
        self._reduced = set()

    def pre_backward(self, unit: Unit) -> None:
        self.fetcher.acquire(unit)

    def _grad_ready(self, unit: Unit):
        def hook(param):
            self._pending[unit.index] -= 1
            if self._pending[unit.index] == 0:
                self._reduce(unit)
        return hook

    def _reduce(self, unit: Unit) -> None:
        t0 = time.perf_counter()
        self.on_unit_grads(unit)
        self.reduce_seconds += time.perf_counter() - t0
        self._reduced.add(unit.index)
        self.fetcher.release(unit, keep_if_reused=False, force=True)

    def finish_backward(self) -> None:
        """Reduces what the hooks did not (parameters without a gradient this pass)."""
        for unit in self.units:
            if unit.index not in self._reduced and unit.params_requiring_grad() > 0:
                self._reduce(unit)
        self.reset_backward()
