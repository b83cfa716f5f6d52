"""Optimizer state over unit shards: the fp32 master, the update rule's moments ([Note: update
rules] in infinity/optim/rules.py) and the gradient accumulator (in the compute dtype for one
pass where the CPU kernel reads it: [Note: one pass keeps its own dtype] in accumulators.py;
fp32 otherwise), kept in host memory
(`offload_optimizer.device: cpu`) or on the compute device (none). The NVMe tier
(`infinity.offload.optimizer.nvme`) has the same methods.

[Note: one pass per shard]
The update of a shard is one call to the rule's CPU kernel per param-group segment: it reads
the gradient accumulator, applies the unscale/clip multiplier, updates master and moments and
writes the new compute-dtype parameter into the parameter tier's target buffer in the same pass.
8-bit moments are updated as stored, in the same pass ([Note: 8-bit updates of a piece] in
infinity/optim/rules.py).
"""

from __future__ import annotations


import torch

from infinity.device.timeline import TIMELINE
from infinity.device import Device, InFlight
from infinity.optim.rules import AdamRule
from infinity.offload.optimizer import accumulators
from infinity.offload.optimizer.accumulators import GRAD, GradientLanding, norm_parts, row_norms_sq, widened
from infinity.offload.protocols import TierUnit

class ResidentOptimizerState:
    """All state of every shard held in memory: on the compute device (offload none) or in host
    memory (cpu). In host memory the CPU Adam kernel updates it; on an accelerator torch ops do."""

    KINDS = ("master", "exp_avg", "exp_avg_sq")  # what checkpoints keep; a rule keeps some of them
    updates_can_wait = False  # nothing to overlap: every update runs in backward or in step()
    chosen = None  # no pool to size

    def __init__(self, device: Device, on_device: bool, units: list[TierUnit], rule=None, one_pass: bool = False):
        self.device = device
        self.rule = rule or AdamRule()
        self.on_device = on_device
        self._where = device.compute if on_device else torch.device("cpu")
        self._cpu_kernel = self._where.type == "cpu"  # decided once: where the state lives
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._landing = None if on_device else GradientLanding(device, units, "offload_optimizer")
        # [Note: one pass keeps its own dtype] in accumulators.py, where the kernel reads the gradient:
        # a client torch optimizer and torch ops on a device take fp32 ones.
        self._half = accumulators.ONE_PASS_KEEPS_ITS_DTYPE and one_pass and not on_device and not self.rule.client
        self._widened = False

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        master = master.to(torch.float32, copy=True)
        if self.on_device:
            master = self.device.move(master)
        state = {"master": master}
        for kind in self.rule.moments:
            state[kind] = self.rule.format.empty(master.numel(), self.rule.initial(kind), kind, device=master.device)
        self._state[unit.index] = state
        self._grads[unit.index] = torch.zeros_like(master, dtype=unit.dtype if self._half else torch.float32)
        if self.rule.client:
            self.rule.register(unit, master)

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight | None:
        def consume(g: torch.Tensor) -> bool:
            with TIMELINE.span("grad_accumulate", unit=unit.index):
                if not (first and last) and self._grads[unit.index].dtype != torch.float32:
                    self._widen(unit.index)
                acc = self._grads[unit.index]
                acc.copy_(g) if first else acc.add_(g)
            return False

        if self._landing is None:
            consume(grad_shard)
            return None
        return self._landing.land(grad_shard, consume)

    def _widen(self, index: int) -> None:
        """A pass that starts an accumulation of several meets a half accumulator: it takes an
        fp32 one from now on (a half sum would round); nothing held is lost, since that pass is
        the first of its accumulation."""
        acc = self._grads[index]
        self._grads[index] = widened(acc.numel(), acc.device, said=self._widened)
        self._widened = True

    def _consume_landed(self) -> None:
        if self._landing is not None:
            self._landing.consume_landed()

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        self._consume_landed()
        return self.device.host(norm_parts(row_norms_sq(self._grads[unit.index]), unit.mp_rows))

    def update(self, unit: TierUnit, hypers: list, step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        self._consume_landed()
        s, g = self._state[unit.index], self._grads[unit.index]
        kernel = self._cpu_kernel and not self.rule.client
        half = None if out.dtype == torch.float32 else out  # the kernel rounds into it in its pass
        with TIMELINE.span("update", unit=unit.index):
            if self.rule.client:
                self.rule.update(unit, g, grad_scale)
            else:  # [Note: update rules] in infinity/optim/rules.py: the moments as stored, 8-bit ones too
                runs = [(seg.start, seg.start + seg.count, self.rule.hyper(hypers, seg))
                        for seg in self.rule.spans(unit)]
                self.rule.update_stored(s["master"], g, {k: s[k] for k in self.rule.moments}, runs, step=step,
                                        grad_scale=grad_scale, half_out=half if kernel else None, on_cpu=kernel)
            if half is None or not kernel:
                out.copy_(s["master"])  # same memory side (update_target's contract): an ordinary copy

    def norms(self, unit: TierUnit, hypers: list, step: int, grad_scale: float) -> torch.Tensor:
        """[Note: LAMB's two passes] in infinity/optim/rules.py: this shard's sums of p^2 and u^2
        per tensor (float64, [tensors, 2]); nothing changes."""
        self._consume_landed()
        s, g = self._state[unit.index], self._grads[unit.index]
        n = s["master"].numel()
        values = {k: self.rule.format.decode(s[k], n, k) for k in self.rule.moments}
        out = torch.zeros(self.rule.tensors, 2, dtype=torch.float64)
        for span in self.rule.spans(unit):
            sl = slice(span.start, span.start + span.count)
            out[span.tensor] += torch.tensor(self.rule.norm_terms(
                s["master"][sl], g[sl], {k: v[sl] for k, v in values.items()}, self.rule.hyper(hypers, span),
                step=step, grad_scale=grad_scale), dtype=torch.float64)
        return out

    def begin_pass(self, last: bool) -> None:
        pass

    def poll(self) -> None:
        pass  # nothing is read

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
            return self.device.host(self._grads[unit.index]).to(torch.float32)
        state = self._state[unit.index]
        n = state["master"].numel()
        if kind not in state:  # a moment this rule does not keep: checkpoints still hold its zeros
            return torch.zeros(n, dtype=torch.float32)
        if kind == "master":
            return self.device.host(state[kind])
        return self.device.host(self.rule.format.to_fp32(state[kind], n, kind))

    def write(self, unit: TierUnit, values: dict[str, torch.Tensor]) -> None:
        state = self._state[unit.index]
        for k in self.KINDS:
            if k in values and k in state:
                if k == "master":
                    state[k].copy_(values[k])
                else:  # into the rule's moment format
                    self.rule.format.encode(values[k].to(state[k].device), k, out=state[k])

    def close(self) -> None:
        self._consume_landed()
        self._state.clear()
        self._grads.clear()
