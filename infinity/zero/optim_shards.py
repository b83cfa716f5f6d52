"""Optimizer state over unit shards: fp32 master, exp_avg, exp_avg_sq and the fp32 gradient
accumulator, kept in host memory (`offload_optimizer.device: cpu`) or on the compute device
(none). The NVMe tier (`infinity.zero.nvme_optim`) has the same methods.

[Note: one pass per shard]
The update of a shard is one call to the CPU Adam kernel per param-group segment: it reads
the gradient accumulator, applies the unscale/clip multiplier, updates master and moments and
writes the new compute-dtype parameter into the parameter tier's target buffer in the same pass.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from infinity.optim.functional import adam_update
from infinity.zero.unit import Unit


NORM_ROW = 1024  # elements; see [Note: gradient norm by rows]
_WIDEN_BLOCK = 256 * NORM_ROW


def row_norms_sq(g: torch.Tensor) -> torch.Tensor:
    """Squared 2-norms, in fp32, of `g`'s consecutive rows of NORM_ROW elements (the last row
    may be shorter); `g` may be any float dtype. Inf or nan where a row holds one.

    [Note: gradient norm by rows]
    The squared norm of a gradient shard is the sum of its row norms, summed in one call over
    the whole shard's rows. A spilled gradient meets the update piece by piece, but pieces
    start on row boundaries (PIECE_ALIGN), so their rows are the shard's rows: concatenated,
    they give the same vector and the same sum, to the bit, as the gradient whole in memory,
    and the clip coefficient does not depend on where the gradient lived or on sub_group_size.
    """
    n = g.numel()
    full = n // NORM_ROW * NORM_ROW
    out = torch.empty(-(-n // NORM_ROW), dtype=torch.float32, device=g.device)
    if g.dtype == torch.float32:
        torch.linalg.vector_norm(g[:full].view(-1, NORM_ROW), dim=1, out=out[:full // NORM_ROW])
    else:
        # Widened a block at a time into one small buffer: converting the whole shard would
        # allocate (and page-fault) 4 bytes an element, slower than the norm itself.
        scratch = torch.empty(min(full, _WIDEN_BLOCK), dtype=torch.float32, device=g.device)
        for lo in range(0, full, _WIDEN_BLOCK):
            hi = min(full, lo + _WIDEN_BLOCK)
            block = scratch[:hi - lo]
            block.copy_(g[lo:hi])
            torch.linalg.vector_norm(block.view(-1, NORM_ROW), dim=1, out=out[lo // NORM_ROW:hi // NORM_ROW])
    if full < n:
        out[-1] = torch.linalg.vector_norm(g[full:], dtype=torch.float32)
    return out.square_()


class AdamHyper(NamedTuple):
    """Hyper-parameters of one param group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool


class OptimizerTier(Protocol):
    def add(self, unit: Unit, master: torch.Tensor) -> None: ...
    def accumulate(self, unit: Unit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> None:
        """Adds a reduced gradient shard into the fp32 accumulator (`first`: replaces it);
        `last`: the final micro-step's, so the unit's state may start moving for the step."""

    def begin_pass(self, last: bool) -> None:
        """A training forward starts; `last`: its micro-step ends an accumulation (its gradients are final)."""

    def step_order(self, units: list[Unit]) -> list[Unit]: ...
    def finish_step(self) -> None: ...
    def flush(self) -> None:
        """Completes the previous step's writes, raising a failed one."""
    def grad_sq(self, unit: Unit) -> torch.Tensor:
        """Squared 2-norm of the unit's final gradient ([Note: gradient norm by rows])."""
    def update(self, unit: Unit, hypers: list[AdamHyper], step: int, grad_scale: float,
               out: torch.Tensor) -> None: ...
    def master(self, unit: Unit) -> torch.Tensor: ...
    def set_master(self, unit: Unit, values: torch.Tensor) -> None: ...
    def state(self, unit: Unit) -> dict[str, torch.Tensor]: ...
    def grad(self, unit: Unit) -> torch.Tensor | None:
        """A host copy of the unit's accumulated (fp32, unscaled by nothing) gradient, if kept."""
    def load_state(self, unit: Unit, state: dict[str, torch.Tensor]) -> None: ...
    def close(self) -> None: ...


def adam_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamHyper,
                   step: int, grad_scale: float) -> None:
    """Adam/AdamW with torch ops, in torch's order of operations; for state on a GPU."""
    g = g * grad_scale
    if h.adamw_mode:
        p.mul_(1 - h.lr * h.weight_decay)
    elif h.weight_decay:
        g = g.add(p, alpha=h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bc1 = 1 - h.beta1 ** step if h.bias_correction else 1.0
    bc2 = 1 - h.beta2 ** step if h.bias_correction else 1.0
    denom = (v.sqrt() / bc2 ** 0.5).add_(h.eps)
    p.addcdiv_(m, denom, value=-h.lr / bc1)


class ResidentOptimizerState:
    """All state of every shard held in memory on `device` (the CPU when offloaded)."""

    KINDS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, device: torch.device):
        self.device = device
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}

    def add(self, unit: Unit, master: torch.Tensor) -> None:
        master = master.to(self.device, torch.float32, copy=True)
        self._state[unit.index] = {"master": master, "exp_avg": torch.zeros_like(master),
                                   "exp_avg_sq": torch.zeros_like(master)}
        self._grads[unit.index] = torch.zeros_like(master)

    def accumulate(self, unit: Unit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> None:
        acc = self._grads[unit.index]
        with torch.profiler.record_function("infinity::grad_accumulate"):
            # Blocking into host memory: a non-blocking copy from the GPU would be read before it landed.
            g = grad_shard.to(self.device, non_blocking=self.device.type != "cpu")
            acc.copy_(g) if first else acc.add_(g)

    def grad_sq(self, unit: Unit) -> torch.Tensor:
        return row_norms_sq(self._grads[unit.index]).sum()

    def update(self, unit: Unit, hypers: list[AdamHyper], step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        s, g = self._state[unit.index], self._grads[unit.index]
        half = out if out.dtype in (torch.bfloat16, torch.float16) and out.device.type == "cpu" else None
        with torch.profiler.record_function("infinity::adam"):
            for seg in unit.segments:
                h = hypers[seg.group]
                if self.device.type == "cpu":
                    adam_update(s["master"], g, s["exp_avg"], s["exp_avg_sq"], step=step, lr=h.lr,
                                beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                                adamw_mode=h.adamw_mode, bias_correction=h.bias_correction,
                                grad_scale=grad_scale, half_out=half, offset=seg.start, count=seg.count)
                else:
                    sl = slice(seg.start, seg.start + seg.count)
                    adam_reference(s["master"][sl], g[sl], s["exp_avg"][sl], s["exp_avg_sq"][sl], h, step,
                                   grad_scale)
            if half is None:
                out.copy_(s["master"], non_blocking=True)

    def begin_pass(self, last: bool) -> None:
        pass

    def step_order(self, units: list[Unit]) -> list[Unit]:
        return units

    def finish_step(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def master(self, unit: Unit) -> torch.Tensor:
        return self._state[unit.index]["master"]

    def set_master(self, unit: Unit, values: torch.Tensor) -> None:
        self._state[unit.index]["master"].copy_(values)

    def state(self, unit: Unit) -> dict[str, torch.Tensor]:
        return {k: t.to("cpu", copy=True) for k, t in self._state[unit.index].items()}

    def grad(self, unit: Unit) -> torch.Tensor | None:
        return self._grads[unit.index].to("cpu", copy=True)

    def load_state(self, unit: Unit, state: dict[str, torch.Tensor]) -> None:
        for k in self.KINDS:
            self._state[unit.index][k].copy_(state[k])

    def close(self) -> None:
        self._state.clear()
        self._grads.clear()
