"""Module and autograd hooks that gather units before they run and reduce their gradients after.

Forward: each module that gathers a unit (see [Note: choosing units] in partitioner.py) gets a
pre-hook (gather) and a post-hook (release, or keep; see [Note: recorded order] in fetcher.py).
The post-hook also threads the outputs that require grad through `_PreBackward`, an identity
whose backward gathers the unit again before autograd runs the unit's backward (autograd saved
views of the parameters; see [Note: releasing frees the memory] in unit.py).

[Note: when a unit's backward ends]
A unit's backward is over when autograd is done with it: every parameter of it that requires
grad has its gradient, and the gradients of the inputs of each of its calls that required grad
are computed (a frozen weight is still needed for the input gradient after the trainable
parameters next to it got theirs: a LoRA adapter beside a frozen projection). The pre-hook
registers a hook on the gradients of a call's inputs that require grad; the call counts as open
from the moment its backward starts (its `_PreBackward`, so a forward whose loss is never
backpropagated leaves nothing open) until that hook fires. The parameters' post-accumulate-grad
hooks count down the rest. When the unit has no open call and every parameter its gradient, its
gradients are handed on once (reduce-scatter, optimizer tier) and it is released; a later call's
backward gathers it again. A unit without trainable parameters whose inputs need gradients is
gathered for backward all the same (its outputs require grad through its inputs) and released
the same way. `finish_backward` finishes the units some of whose parameters got no gradient, in
unit order, so that every rank runs the same collectives.

During backward, forward hooks fire again for activation-checkpointing recomputation: the
pre-hook gathers as usual and the post-hook keeps the unit, whose backward is about to run.

[Note: between a unit's ops]
The tiers work between the unit hooks: a write issued at one unit's boundary finishes while the
next unit computes, and the buffer it gives back is reused only when a tier is called again. A
streaming optimizer tier wants to be called in between, to issue the reads that wait for those
buffers ([Note: reading ahead in the expected order] in offload/optimizer/nvme.py), so given
`between` the hooks call it inside each unit's compute: in forward before each module that holds
parameters of its own (but a unit's own module), in backward at each parameter's gradient and
between the row blocks of a tied weight's gradient product, the longest op of the tail of
backward (`_Stash._product` in tiling.py).
"""

from __future__ import annotations

import contextlib

import time
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from infinity.device.timeline import TIMELINE
from infinity.zero.fetcher import Fetcher
from infinity.zero.tiling import tied_stashes
from infinity.zero.unit import Unit


class _Call:
    """One call of a unit's module whose inputs require grad ([Note: when a unit's backward ends])."""

    __slots__ = ("unit", "generation", "open", "handle")

    def __init__(self, unit: Unit, generation: int):
        self.unit, self.generation = unit, generation
        self.open = False  # its backward started and its inputs' gradients are not computed yet
        self.handle: RemovableHandle | None = None


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hooks: "UnitHooks", unit: Unit, call: _Call | None, *tensors: torch.Tensor):
        ctx.hooks, ctx.unit, ctx.call = hooks, unit, call
        # detach, not view_as: autograd forbids in-place ops on a view made in a custom Function
        # (`ReLU(inplace=True)` after a unit, `y += h`); the version counter stays shared.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.hooks.pre_backward(ctx.unit, ctx.call)
        return (None, None, None, *grads)


def _tensors_requiring_grad(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


class UnitHooks:
    def __init__(self, units: list[Unit], modules: list[list[torch.nn.Module]], fetcher: Fetcher,
                 on_unit_grads: Callable[[Unit], None], outside_backward: Callable[[], None] = lambda: None,
                 between: Callable[[], None] | None = None):
        self.units = units
        self.fetcher = fetcher
        self.on_unit_grads = on_unit_grads
        self.outside_backward = outside_backward  # a parameter's gradient arrives outside engine.backward
        self.between = between  # [Note: between a unit's ops]
        self.in_backward = False  # engine.backward runs
        self.reduce_seconds = 0.0
        self._awaiting_grad: dict[int, int] = {}  # unit -> hooked parameters still without a gradient
        self._open_calls: dict[int, int] = {}  # unit -> calls whose backward runs (input gradients pending)
        self._reduced: set[int] = set()
        self._calls: list[_Call] = []  # this pass's calls with an input-gradient hook
        self._current: dict[int, list[_Call | None]] = {}  # unit -> calls between pre- and post-hook
        self._generation = 0  # counts backward passes: a hook of an older graph changes nothing
        self._handles: list[RemovableHandle] = []
        self._stashes: list = []  # tied weights' stashes that call `between`
        self._hooked: dict[int, int] = {u.index: 0 for u in units}  # parameters with a gradient hook
        for unit, unit_modules in zip(units, modules):
            for module in unit_modules:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post_forward(unit)))
            for slot in unit.slots:
                if slot.param.requires_grad:
                    self._hooked[unit.index] += 1
                    self._handles.append(
                        slot.param.register_post_accumulate_grad_hook(self._grad_ready(unit, slot.group >= 0)))
        if between is not None:
            inner = {id(m) for ms in modules for m in ms}
            for module in {id(m): m for ms in modules for m in ms for m in m.modules()}.values():
                if id(module) not in inner and next(module.parameters(recurse=False), None) is not None:
                    self._handles.append(module.register_forward_pre_hook(lambda *_: between()))
            self._stashes = tied_stashes(m for ms in modules for m in ms)  # a tied weight's tail ([Note: tied tiles])
            for stash in self._stashes:
                stash.between = between
        self.reset_backward()

    @contextlib.contextmanager
    def running_backward(self):
        """engine.backward runs inside: gradients that arrive are the engine's to reduce."""
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for stash in self._stashes:
            stash.between = None
        self._stashes.clear()

    # ---- forward --------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            self.fetcher.acquire(unit)
            self._spans.setdefault(unit.index, []).append(TIMELINE.begin(f"forward {unit.name}", "units"))
            call = None
            if torch.is_grad_enabled():
                inputs = _tensors_requiring_grad((args, kwargs))
                if inputs:  # [Note: when a unit's backward ends]
                    call = _Call(unit, self._generation)
                    call.handle = torch.autograd.graph.register_multi_grad_hook(
                        inputs, self._inputs_done(call), mode="all")
                    self._calls.append(call)
            self._current.setdefault(unit.index, []).append(call)
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            stack = self._current.get(unit.index)
            call = stack.pop() if stack else None
            spans = self._spans.get(unit.index)
            TIMELINE.end(spans.pop() if spans else None, f"forward {unit.name}", "units")
            if not self.in_backward:
                self.fetcher.release(unit)
            if not torch.is_grad_enabled():
                return output
            flat, spec = pytree.tree_flatten(output)
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return output
            wrapped = _PreBackward.apply(self, unit, call, *(flat[i] for i in idx))
            for i, t in zip(idx, wrapped):
                flat[i] = t
            return pytree.tree_unflatten(flat, spec)
        return hook

    # ---- backward -------------------------------------------------------------------------

    def reset_backward(self) -> None:
        """Forgets the counts and hooks of the last pass; called before each training pass and
        after its backward."""
        self._generation += 1
        self._spans: dict[int, list] = {}  # unit -> its forward and backward slices open in the timeline
        for call in self._calls:
            call.handle.remove()
        self._calls = []
        self._current = {}
        self._awaiting_grad = dict(self._hooked)
        self._open_calls = {u.index: 0 for u in self.units}
        self._reduced = set()
        self._backward_spans: dict[int, int | None] = {}

    def pre_backward(self, unit: Unit, call: _Call | None) -> None:
        if call is not None and call.generation == self._generation and not call.open:
            call.open = True
            self._open_calls[unit.index] += 1
        self.fetcher.acquire(unit)
        if unit.index not in self._backward_spans:
            self._backward_spans[unit.index] = TIMELINE.begin(f"backward {unit.name}", "units")

    def _inputs_done(self, call: _Call):
        def hook(grads):
            call.handle.remove()
            if call.generation == self._generation and call.open:
                call.open = False
                self._open_calls[call.unit.index] -= 1
                self._maybe_finish(call.unit)
        return hook

    def _grad_ready(self, unit: Unit, trainable: bool):
        def hook(param):
            if not self.in_backward:
                self.outside_backward()  # raises: nothing of this pass is reduced or updated
            if not trainable:
                param.grad = None  # requires grad but is in no param group: frozen, nothing keeps it
            self._awaiting_grad[unit.index] -= 1
            if self.between is not None:
                self.between()
            self._maybe_finish(unit)
        return hook

    def _maybe_finish(self, unit: Unit) -> None:
        if self._awaiting_grad[unit.index] <= 0 and self._open_calls[unit.index] == 0:
            self._finish(unit)

    def _finish(self, unit: Unit) -> None:
        TIMELINE.end(self._backward_spans.pop(unit.index, None), f"backward {unit.name}", "units")
        if unit.trainable and unit.index not in self._reduced:
            self._reduced.add(unit.index)
            t0 = time.perf_counter()
            self.on_unit_grads(unit)
            self.reduce_seconds += time.perf_counter() - t0
        elif not unit.trainable:
            for slot in unit.slots:
                slot.param.grad = None  # made trainable after initialize: frozen all the same
        self.fetcher.release(unit, keep_if_reused=False, force=True)

    def finish_backward(self) -> None:
        """Finishes what the hooks did not (parameters without a gradient this pass)."""
        for unit in self.units:
            if unit.trainable and unit.index not in self._reduced:
                self._finish(unit)
        self.reset_backward()
