"""Optimizer state over unit shards: fp32 master, exp_avg, exp_avg_sq and the fp32 gradient
accumulator, kept in host memory (`offload_optimizer.device: cpu`) or on the compute device
(none). The NVMe tier (`infinity.offload.optimizer.nvme`) has the same methods.

[Note: one pass per shard]
The update of a shard is one call to the CPU Adam kernel per param-group segment: it reads
the gradient accumulator, applies the unscale/clip multiplier, updates master and moments and
writes the new compute-dtype parameter into the parameter tier's target buffer in the same pass.
"""

from __future__ import annotations


import torch

from infinity.device.timeline import TIMELINE
from infinity.device import Device, InFlight
from infinity.optim.functional import AdamHyper, adam_step
from infinity.offload.optimizer.accumulators import GRAD, GradientLanding, row_norms_sq
from infinity.offload.protocols import TierUnit

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
    """All state of every shard held in memory: on the compute device (offload none) or in host
    memory (cpu). In host memory the CPU Adam kernel updates it; on an accelerator torch ops do."""

    KINDS = ("master", "exp_avg", "exp_avg_sq")
    updates_can_wait = False  # nothing to overlap: every update runs in backward or in step()
    chosen = None  # no pool to size

    def __init__(self, device: Device, on_device: bool, units: list[TierUnit]):
        self.device = device
        self.on_device = on_device
        self._where = device.compute if on_device else torch.device("cpu")
        self._cpu_kernel = self._where.type == "cpu"  # decided once: where the state lives
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._landing = None if on_device else GradientLanding(device, units, "offload_optimizer")

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        master = master.to(torch.float32, copy=True)
        if self.on_device:
            master = self.device.move(master)
        self._state[unit.index] = {"master": master, "exp_avg": torch.zeros_like(master),
                                   "exp_avg_sq": torch.zeros_like(master)}
        self._grads[unit.index] = torch.zeros_like(master)

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight | None:
        acc = self._grads[unit.index]

        def consume(g: torch.Tensor) -> bool:
            with TIMELINE.span("grad_accumulate", unit=unit.index):
                acc.copy_(g) if first else acc.add_(g)
            return False

        if self._landing is None:
            consume(grad_shard)
            return None
        return self._landing.land(grad_shard, consume)

    def _consume_landed(self) -> None:
        if self._landing is not None:
            self._landing.consume_landed()

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        self._consume_landed()
        return self.device.host(row_norms_sq(self._grads[unit.index]).sum())

    def update(self, unit: TierUnit, hypers: list[AdamHyper], step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        self._consume_landed()
        s, g = self._state[unit.index], self._grads[unit.index]
        half = None if out.dtype == torch.float32 else out  # the kernel rounds into it in its pass
        with TIMELINE.span("adam", unit=unit.index):
            for seg in unit.segments:
                h = hypers[seg.group]
                if self._cpu_kernel:
                    adam_step(s["master"], g, s["exp_avg"], s["exp_avg_sq"], h, step=step, grad_scale=grad_scale,
                              half_out=half, offset=seg.start, count=seg.count)
                else:
                    sl = slice(seg.start, seg.start + seg.count)
                    adam_reference(s["master"][sl], g[sl], s["exp_avg"][sl], s["exp_avg_sq"][sl], h, step,
                                   grad_scale)
            if half is None or not self._cpu_kernel:
                out.copy_(s["master"])  # same memory side (update_target's contract): an ordinary copy

    def begin_pass(self, last: bool) -> None:
        pass

    def io_stats(self) -> dict[str, float]:
        return {}  # nothing crosses to NVMe

    def step_order(self, units: list[TierUnit]) -> list[TierUnit]:
        return units

    def abort_pass(self) -> None:
        if self._landing is not None:
            self._landing.discard()

    def finish_step(self) -> None:
        pass

    def drop_pending(self) -> None:
        pass  # updates never wait for the next forward here (`updates_can_wait` is False)

    def flush(self) -> None:
        self._consume_landed()

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor:
        if kind == GRAD:
            self._consume_landed()
            return self.device.host(self._grads[unit.index])
        return self.device.host(self._state[unit.index][kind])

    def write(self, unit: TierUnit, values: dict[str, torch.Tensor]) -> None:
        for k in self.KINDS:
            if k in values:
                self._state[unit.index][k].copy_(values[k])

    def close(self) -> None:
        self._consume_landed()
        self._state.clear()
        self._grads.clear()
