"""Optimizer state over unit shards: fp32 master, exp_avg, exp_avg_sq and the fp32 gradient
accumulator, kept in host memory (`offload_optimizer.device: cpu`) or on the compute device
(none). The NVMe tier (`infinity.offload.optimizer.nvme`) has the same methods.

[Note: one pass per shard]
The update of a shard is one call to the CPU Adam kernel per param-group segment: it reads
the gradient accumulator, applies the unscale/clip multiplier, updates master and moments and
writes the new compute-dtype parameter into the parameter tier's target buffer in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infinity.device.timeline import TIMELINE
from infinity.device import Device, InFlight
from infinity.optim.functional import AdamHyper, adam_step
from infinity.offload import BufferPool
from infinity.offload.protocols import TierUnit

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


class GradientLanding:
    """Gradient shards on their way from the compute device into host memory.

    [Note: gradients to the host]
    A unit's reduced gradient shard is copied device -> host on the device's copy-out stream into
    a page-locked pool buffer (`land`), and the host consumes it (accumulation, spill, norm) one
    unit later (`consume_landed`, called by the next `land` and before anything reads the gradients), so
    the copy runs under the next unit's backward instead of stopping the compute for each unit.
    The copy reads the engine's reused gradient buffer: the engine waits for it
    (`Device.wait_compute`) before the next unit overwrites that buffer.
    """

    def __init__(self, device: Device, units: list[TierUnit], name: str):
        self.device = device
        largest = max((u.train_shard_numel * u.dtype.itemsize for u in units), default=1)
        # One buffer for the copy in flight, one for the gradient a host consumer still holds.
        self.pool = BufferPool(2, largest, pin=device.pin() or None, name=name, on_release=device.scribble)
        self._in_flight: list[tuple[InFlight, torch.Tensor, Callable[[torch.Tensor], bool]]] = []

    def land(self, grad_shard: torch.Tensor, consume: Callable[[torch.Tensor], bool]) -> InFlight:
        """Starts the copy of `grad_shard`; `consume(host_copy)` runs at the next `consume_landed` and
        returns True when it keeps the buffer (then `release` gives it back later)."""
        self.consume_landed()
        nbytes = grad_shard.numel() * grad_shard.element_size()
        buffer = self.pool.acquire(nbytes)
        copy = self.device.to_host(grad_shard, buffer.view(grad_shard.dtype))
        self._in_flight.append((copy, buffer, consume))
        return copy

    def consume_landed(self) -> None:
        """Consumes every gradient in flight (waiting for its copy). If a consumer raises (a
        spilled gradient's read failed), its buffer goes back and the rest stay pending."""
        while self._in_flight:
            copy, buffer, consume = self._in_flight.pop(0)
            with TIMELINE.span("gradient copy to host", "wait"):
                self.device.wait_host(copy)
            kept = False
            try:
                kept = consume(copy.tensor)
            finally:
                if not kept:
                    self.pool.release(buffer)

    def release(self, host_copy: torch.Tensor) -> None:
        self.pool.release(host_copy)

    def discard(self) -> None:
        """Drops the gradients in flight (a failed backward), once their copies have landed."""
        pending, self._in_flight = self._in_flight, []
        for copy, buffer, _ in pending:
            self.device.wait_host(copy)
            self.pool.release(buffer)


class ResidentOptimizerState:
    """All state of every shard held in memory: on the compute device (offload none) or in host
    memory (cpu). In host memory the CPU Adam kernel updates it; on an accelerator torch ops do."""

    KINDS = ("master", "exp_avg", "exp_avg_sq")
    updates_can_wait = False  # nothing to overlap: every update runs in backward or in step()

    def __init__(self, device: Device, on_device: bool, units: list[TierUnit]):
        self.device = device
        self.on_device = on_device
        self._where = device.compute if on_device else torch.device("cpu")
        self._cpu_kernel = self._where.type == "cpu"  # decided once: where the state lives
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._landing = None if on_device else GradientLanding(device, units, "offload_optimizer")
        self._damaged: dict[int, str] = {}  # unit -> why its state is not of any step, until a load replaces it

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

    def mark_damaged(self, unit: TierUnit, why: str) -> None:
        """The unit's state is not that of any step (its update was abandoned part way): `damage()`
        says why until `load_state` replaces all of it."""
        self._damaged.setdefault(unit.index, why)

    def damage(self) -> str | None:
        return next(iter(self._damaged.values()), None)

    def drop_pending(self) -> None:
        pass  # updates never wait for the next forward here (`updates_can_wait` is False)

    def flush(self) -> None:
        self._consume_landed()

    def master(self, unit: TierUnit) -> torch.Tensor:
        return self.device.host(self._state[unit.index]["master"])

    def set_master(self, unit: TierUnit, values: torch.Tensor) -> None:
        self._state[unit.index]["master"].copy_(values)

    def state(self, unit: TierUnit) -> dict[str, torch.Tensor]:
        return {k: self.device.host(t) for k, t in self._state[unit.index].items()}

    def grad(self, unit: TierUnit) -> torch.Tensor | None:
        self._consume_landed()
        return self.device.host(self._grads[unit.index])

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor:
        return self.device.host(self._state[unit.index][kind])

    def load_state(self, unit: TierUnit, state: dict[str, torch.Tensor]) -> None:
        for k in self.KINDS:
            if k in state:
                self._state[unit.index][k].copy_(state[k])
        if all(k in state for k in self.KINDS):  # all of it replaced: no longer damaged
            self._damaged.pop(unit.index, None)

    def close(self) -> None:
        self._consume_landed()
        self._state.clear()
        self._grads.clear()
