"""Update rules: what an optimizer tier does to one flat fp32 master shard at a step.

[Note: update rules]
The optimizer tiers (offload/optimizer/) keep, per unit shard, an fp32 master and the moments
its rule names (`Rule.moments`: Adam's exp_avg and exp_avg_sq, Adagrad's sum, kept under
DeepSpeed's name exp_avg_sq, Lion's exp_avg), and call the rule once per param-group segment
with slices of them: `kernel` on host memory (infinity's SIMD kernels, one pass over memory,
the new compute-dtype value rounded into `half_out`), `reference` on an accelerator (torch ops
in the kernel's order). A tier never names an optimizer; the hyper-parameters come from the
param groups each step (`hypers`), so LR schedulers and users who set `group["lr"]` are heard.

`format` is how the moments are stored ([Note: moment formats] in infinity/optim/formats.py):
fp32, bf16 (DeepSpeed's `fp32_optimizer_states: false`) or 8 bits with a scale per block, which
the kernels of Adam, Adagrad and Lion update in place ([Note: 8-bit updates of a piece]). The
master is always fp32. A tier hands a piece (a shard, or a piece of one on NVMe) to
`update_stored`, which calls the kernel (or the torch ops) on it in whichever way its format
needs.

[Note: 8-bit updates of a piece]
The fused kernel (`kernel_packed`) updates whole blocks of 8-bit moments, counted from the
piece's first value, and one call has one set of hyper-parameters, so it takes the blocks that
lie inside one run (a param group's segment) of the piece. A block that two runs
share, or a run and what no run covers (the padding after the last parameter of a shard), goes
the long way: decoded to fp32, each run's part updated by `kernel`, encoded. Blocks are
independent, so this is, bit for bit, the long way over the whole piece (formats.py's decode,
the kernel per run, its encode), but that it leaves the blocks no run touches as they are
stored instead of encoding their decoded values again (which gives the same values). In the
usual layout (one group) only the block with the shard's last parameter goes the long way.

A client optimizer infinity has no kernel for (torch.optim.SGD, a Lightning module's
`configure_optimizers`, accelerate's loop) is a `ClientRule`: its own `step()` runs over views
of the master shards, which it sees as its parameters ([Note: a client optimizer over shards]).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, NamedTuple

import torch

from infinity.optim.formats import BLOCK, MomentFormat, moment_format
from infinity.optim.functional import AdagradHyper, AdamHyper, LionHyper, adagrad_step, adam_step, lion_step
from infinity.optim.lamb_kernel import lamb_apply, lamb_norms

__all__ = ["AdagradRule", "AdamRule", "ClientRule", "LambHyper", "LambRule", "LionRule", "Rule", "STREAMED",
           "rule_for_optimizer"]

STREAMED = ("Adam", "AdamW", "Adagrad", "Lion", "Lamb")  # the rules with a kernel: those whose state may live on NVMe


class Rule:
    """One kernel rule ([Note: update rules]); subclasses name their moments and hyper-parameters."""

    name: ClassVar[str]
    moments: ClassVar[tuple[str, ...]]
    client: ClassVar[bool] = False

    def __init__(self, *, fmt: str = "fp32"):
        self.format: MomentFormat = moment_format(fmt)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The state kinds a shard keeps: its master, then its moments."""
        return ("master",) + self.moments

    two_pass: ClassVar[bool] = False  # LAMB: norms over whole tensors first ([Note: LAMB's two passes])

    def initial(self, kind: str) -> float:
        """The value a moment starts at."""
        return 0.0

    def spans(self, unit) -> list:
        """The runs of a unit's shard the kernel is called on, one hyper-parameter set each."""
        return unit.segments

    def hyper(self, hypers: list, span):
        return hypers[span.group]

    def hypers(self, groups: list[dict]) -> list:
        raise NotImplementedError

    def kernel(self, master, grad, state: dict[str, torch.Tensor], hyper, *, step: int, grad_scale: float,
               half_out: torch.Tensor | None) -> None:
        raise NotImplementedError

    packed_kernel: ClassVar[bool] = False  # whether `kernel_packed` updates 8-bit moments in place

    def kernel_packed(self, master, grad, stored: dict[str, torch.Tensor], hyper, *, step: int, grad_scale: float,
                      half_out: torch.Tensor | None, offset: int, count: int) -> None:
        """`kernel` over elements [offset, offset + count) of a piece of master.numel() values whose
        moments are `stored` as 8-bit bytes ([Note: 8-bit moments] in infinity/optim/functional.py);
        the range starts on a block and ends on one or at the piece's end."""
        raise NotImplementedError

    def update_stored(self, master, grad, stored: dict[str, torch.Tensor], runs: list[tuple[int, int, Any]], *,
                      step: int, grad_scale: float, half_out: torch.Tensor | None, on_cpu: bool = True,
                      scratch=None) -> None:
        """One update of a piece: `master`, `grad` (and `half_out`, if any) its values, `stored` its
        moments in the rule's format, `runs` the (start, end, hyper) ranges of it to update. On the
        CPU by `kernel`, else by `reference` (torch ops; no half copy). `scratch(kind, n)`, if
        given, lends the fp32 room to decode a packed moment into."""
        fmt, n = self.format, master.numel()
        if fmt.packed and on_cpu and self.packed_kernel:
            self._update_blocks(master, grad, stored, runs, step=step, grad_scale=grad_scale, half_out=half_out)
            return
        values = {k: fmt.decode(stored[k], n, k, out=scratch(k, n) if scratch and fmt.packed else None)
                  for k in self.moments}
        self._update_values(master, grad, values, runs, 0, step=step, grad_scale=grad_scale, half_out=half_out,
                            on_cpu=on_cpu)
        if fmt.packed:
            for k, v in values.items():
                fmt.encode(v, k, out=stored[k])

    def _update_values(self, master, grad, values: dict[str, torch.Tensor], runs, first: int, *, step: int,
                       grad_scale: float, half_out: torch.Tensor | None, on_cpu: bool) -> None:
        """Each run's part of the fp32 (or bf16) `values`, which hold the piece's values from `first` on."""
        end = first + next(iter(values.values())).numel() if values else master.numel()
        for lo, hi, hyper in runs:
            lo, hi = max(lo, first), min(hi, end)
            if lo >= hi:
                continue
            sl = slice(lo, hi)
            part = {k: v[lo - first:hi - first] for k, v in values.items()}
            if on_cpu:
                self.kernel(master[sl], grad[sl], part, hyper, step=step, grad_scale=grad_scale,
                            half_out=None if half_out is None else half_out[sl])
            else:
                self.reference(master[sl], grad[sl], part, hyper, step=step, grad_scale=grad_scale)

    def _update_blocks(self, master, grad, stored, runs, *, step: int, grad_scale: float,
                       half_out: torch.Tensor | None) -> None:
        """[Note: 8-bit updates of a piece]: the fused kernel on each run's whole blocks, the
        blocks runs share decoded, updated and encoded."""
        n, fmt = master.numel(), self.format
        shared = set()
        for lo, hi, hyper in runs:
            start = -(-lo // BLOCK) * BLOCK  # the run's first whole block
            end = hi if hi == n else hi // BLOCK * BLOCK
            if start < end:
                self.kernel_packed(master, grad, stored, hyper, step=step, grad_scale=grad_scale, half_out=half_out,
                                   offset=start, count=end - start)
            if lo % BLOCK:
                shared.add(lo // BLOCK)
            if hi % BLOCK and hi != n:
                shared.add(hi // BLOCK)
        for block in sorted(shared):
            values = {k: fmt.decode_blocks(stored[k], n, k, block, block + 1) for k in self.moments}
            self._update_values(master, grad, values, runs, block * BLOCK, step=step, grad_scale=grad_scale,
                                half_out=half_out, on_cpu=True)
            for k, v in values.items():
                fmt.encode_blocks(v, k, stored[k], n, block)

    def reference(self, master, grad, state: dict[str, torch.Tensor], hyper, *, step: int, grad_scale: float) -> None:
        """The rule with torch ops, for state on an accelerator: bf16 moments are updated in fp32
        and rounded back, as the kernel does."""
        wide = {k: v.float() for k, v in state.items()}
        self._torch_math(master, grad * grad_scale, wide, hyper, step)
        for k, v in state.items():
            if v is not wide[k]:
                v.copy_(wide[k])

    def _torch_math(self, p, g, s, hyper, step) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.format.name} moments)"


class AdamRule(Rule):
    """Adam (L2 weight decay) or AdamW, as torch defines them (csrc/adam/adam.h)."""

    name = "Adam"
    moments = ("exp_avg", "exp_avg_sq")

    def hypers(self, groups: list[dict]) -> list[AdamHyper]:
        out = []
        for g in groups:
            b1, b2 = g["betas"]
            out.append(AdamHyper(float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]),
                                 bool(g.get("adamw_mode", True)), bool(g.get("bias_correction", True))))
        return out

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        adam_step(master, grad, state["exp_avg"], state["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale,
                  half_out=half_out)

    packed_kernel = True

    def kernel_packed(self, master, grad, stored, hyper, *, step, grad_scale, half_out, offset, count) -> None:
        adam_step(master, grad, stored["exp_avg"], stored["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale,
                  half_out=half_out, offset=offset, count=count, moment_format="8bit")

    def _torch_math(self, p, g, s, h: AdamHyper, step) -> None:
        m, v = s["exp_avg"], s["exp_avg_sq"]
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


class AdagradRule(Rule):
    """torch.optim.Adagrad (L2 weight decay, lr_decay); its sum is kept as exp_avg_sq (DeepSpeed's name)."""

    name = "Adagrad"
    moments = ("exp_avg_sq",)

    def __init__(self, *, fmt: str = "fp32", initial_accumulator_value: float = 0.0):
        super().__init__(fmt=fmt)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def initial(self, kind: str) -> float:
        return self.initial_accumulator_value

    def hypers(self, groups: list[dict]) -> list:
        return [AdagradHyper(float(g["lr"]), float(g["eps"]), float(g["weight_decay"]), float(g.get("lr_decay", 0.0)))
                for g in groups]

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        adagrad_step(master, grad, state["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale, half_out=half_out)

    packed_kernel = True

    def kernel_packed(self, master, grad, stored, hyper, *, step, grad_scale, half_out, offset, count) -> None:
        adagrad_step(master, grad, stored["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale, half_out=half_out,
                     offset=offset, count=count, moment_format="8bit")

    def _torch_math(self, p, g, s, h, step) -> None:
        total = s["exp_avg_sq"]
        if h.weight_decay:
            g = g.add(p, alpha=h.weight_decay)
        clr = h.lr / (1 + (step - 1) * h.lr_decay)
        total.addcmul_(g, g, value=1)
        p.addcdiv_(g, total.sqrt().add_(h.eps), value=-clr)


class LionRule(Rule):
    """Lion: c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g."""

    name = "Lion"
    moments = ("exp_avg",)

    def hypers(self, groups: list[dict]) -> list:
        return [LionHyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["weight_decay"]))
                for g in groups]

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        lion_step(master, grad, state["exp_avg"], hyper, step=step, grad_scale=grad_scale, half_out=half_out)

    packed_kernel = True

    def kernel_packed(self, master, grad, stored, hyper, *, step, grad_scale, half_out, offset, count) -> None:
        lion_step(master, grad, stored["exp_avg"], hyper, step=step, grad_scale=grad_scale, half_out=half_out,
                  offset=offset, count=count, moment_format="8bit")

    def _torch_math(self, p, g, s, h, step) -> None:
        m = s["exp_avg"]
        c = m.lerp(g, 1 - h.beta1)
        p.mul_(1 - h.lr * h.weight_decay).add_(c.sign_(), alpha=-h.lr)
        m.lerp_(g, 1 - h.beta2)


class LambHyper(NamedTuple):
    """One group's LAMB hyper-parameters at a step, and the trust ratio of the tensor a span is of."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    ratio: float = 1.0


class Span(NamedTuple):
    """A run of a unit's shard that is one parameter tensor's (LAMB's trust ratio is per tensor)."""

    group: int
    start: int
    count: int
    tensor: int  # the tensor's index among every trainable tensor of the model (a tiled weight's tiles share it)


# [Note: LAMB's two passes]
# LAMB (DeepSpeed's FusedLamb) scales a tensor's update by its trust ratio ||p|| / ||u||, with
# u = m' / (sqrt(v') + eps) + wd p from the new moments, clamped to [min_coeff, max_coeff] (1 where
# either norm is 0), and lr sqrt(1 - b2^t) / (1 - b1^t) as the step size. A tensor's values are
# spread over units (a tiled weight's tiles), ranks (its shards) and NVMe pieces, so its norms are
# known only once every part of it has been read. The step therefore takes two passes: the first
# (`norms`) reads each unit's state and gradient and sums p^2 and u^2 per tensor in float64,
# changing nothing; the sums are added over ranks, the ratios set (`set_ratios`); the second is
# the update, which computes m', v' and u again with the same operations (the same bits) and
# applies them. A failure in the first pass leaves the state as it was; the second is an update
# like any other. The first pass reads the optimizer state once more a step: on NVMe, LAMB moves
# half as much again as Adam.
# On CPU tensors both passes are SIMD kernels (infinity/optim/lamb_kernel.py); elsewhere they are
# torch ops in the kernels' order, op for op ([Note: LAMB arithmetic] in csrc/adam/lamb.h), so the
# direction u has the same bits in both passes and on every device whose division and square
# root are correctly rounded (not torch's CPU sqrt, which the CPU never runs here).


class LambRule(Rule):
    """LAMB as DeepSpeed's FusedLamb computes it ([Note: LAMB's two passes])."""

    name = "Lamb"
    moments = ("exp_avg", "exp_avg_sq")
    two_pass = True

    def __init__(self, *, fmt: str = "fp32"):
        super().__init__(fmt=fmt)
        self._spans: dict[int, list[Span]] = {}
        self.tensors = 0
        self._ratios: list[float] = []

    def bind(self, units, tiles: dict[int, list] | None = None) -> None:
        """Each unit's spans, a tensor index per parameter (the tiles of one weight share the weight's)."""
        of_tile = {id(t): key for key, ts in (tiles or {}).items() for t in ts}
        index: dict[int, int] = {}
        for u in units:
            lo, hi = u.rank * u.train_shard_numel, (u.rank + 1) * u.train_shard_numel
            spans = []
            for slot in u.slots:
                if slot.group < 0:
                    continue
                key = of_tile.get(id(slot.param), id(slot.param))
                tensor = index.setdefault(key, len(index))
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    spans.append(Span(slot.group, a - lo, b - a, tensor))
            self._spans[u.index] = spans
        self.tensors = len(index)
        self._ratios = [1.0] * self.tensors

    def spans(self, unit) -> list[Span]:
        return self._spans[unit.index]

    def hyper(self, hypers: list, span) -> LambHyper:
        return hypers[span.group]._replace(ratio=self._ratios[span.tensor])

    def hypers(self, groups: list[dict]) -> list[LambHyper]:
        return [LambHyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                          float(g["weight_decay"]), bool(g.get("bias_correction", True)),
                          float(g.get("max_coeff", 10.0)), float(g.get("min_coeff", 0.01))) for g in groups]

    def set_ratios(self, sums: torch.Tensor, hypers: list[LambHyper]) -> None:
        """The trust ratios from the per-tensor sums of p^2 and u^2 (float64 [tensors, 2], every rank's)."""
        group_of = {s.tensor: s.group for spans in self._spans.values() for s in spans}
        ratios = []
        for t, (w_sq, u_sq) in enumerate(sums.tolist()):
            h = hypers[group_of.get(t, 0)]
            w, u = w_sq ** 0.5, u_sq ** 0.5
            ratios.append(min(max(w / u, h.min_coeff), h.max_coeff) if w != 0 and u != 0 else 1.0)
        self._ratios = ratios

    @staticmethod
    def _direction(p, g, m, v, h: LambHyper):
        """m', v' and u in fp32, for both passes: [Note: LAMB arithmetic] in csrc/adam/lamb.h, one
        correctly rounded torch op per kernel operation (no `alpha=`, which fuses on the CPU)."""
        m2 = m.mul(h.beta1).add_(g.mul(1 - h.beta1))
        v2 = v.mul(h.beta2).add_(g.mul(g).mul_(1 - h.beta2))
        u = m2.div(v2.sqrt().add_(h.eps)).add_(p.mul(h.weight_decay))
        return m2, v2, u

    @staticmethod
    def step_size(h: LambHyper, step: int) -> float:
        """lr sqrt(1 - b2^t) / (1 - b1^t) in double (lr without bias correction); the kernel
        computes it the same way and rounds step_size * ratio to float once."""
        return h.lr * (1 - h.beta2 ** step) ** 0.5 / (1 - h.beta1 ** step) if h.bias_correction else h.lr

    def norm_terms(self, master, grad, state, hyper: LambHyper, *, step: int, grad_scale: float) -> tuple[float, float]:
        """The first pass over one span: (sum p^2, sum u^2) in float64; nothing changes."""
        if master.device.type == "cpu":
            return lamb_norms(master, grad, state["exp_avg"], state["exp_avg_sq"], hyper, grad_scale=grad_scale)
        g = grad.float() * grad_scale
        _, _, u = self._direction(master, g, state["exp_avg"].float(), state["exp_avg_sq"].float(), hyper)
        return (float(torch.linalg.vector_norm(master, dtype=torch.float64)) ** 2,
                float(torch.linalg.vector_norm(u, dtype=torch.float64)) ** 2)

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        lamb_apply(master, grad, state["exp_avg"], state["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale,
                   half_out=half_out)

    def reference(self, master, grad, state, hyper, *, step, grad_scale) -> None:
        super().reference(master, grad.float(), state, hyper, step=step, grad_scale=grad_scale)  # scaled in fp32

    def _torch_math(self, p, g, s, h: LambHyper, step) -> None:
        m2, v2, u = self._direction(p, g, s["exp_avg"], s["exp_avg_sq"], h)
        p.sub_(u.mul_(self.step_size(h, step) * h.ratio))
        s["exp_avg"].copy_(m2)
        s["exp_avg_sq"].copy_(v2)


# [Note: a client optimizer over shards]
# An optimizer infinity has no kernel for is rebuilt over the shards: the same class, those of its
# `defaults` its constructor takes as keyword arguments, one group per user group holding views of the fp32 master
# shards (a segment of a unit's shard is one group's; torch steps a view in place, so the
# master changes). A unit's update sets the views' `.grad` to its gradient (unscaled and
# clipped: times grad_scale), copies the user's group values (lr from a scheduler, any other
# key) into the rebuilt groups, and calls `step()`; torch optimizers skip parameters whose grad
# is None, so each call steps that unit's segments only. Its own state (momentum buffers) lives
# beside the views, on the device the master is on; the checkpoint keeps its `state_dict()` in
# the rank's state file, so a resume is exact at the same world size. It needs the state in
# memory: nothing of it can stream to NVMe.


class ClientRule:
    """A user's torch optimizer run over master-shard views ([Note: a client optimizer over shards])."""

    client = True
    two_pass = False
    moments: tuple[str, ...] = ()
    format = moment_format("fp32")
    kinds = ("master",)

    def __init__(self, user: torch.optim.Optimizer):
        self.user = user
        self.name = type(user).__name__
        self._views: list[list[torch.Tensor]] = [[] for _ in user.param_groups]
        self._of: dict[int, list[tuple[int, torch.Tensor]]] = {}  # unit index -> (segment start, view)
        self._inner: torch.optim.Optimizer | None = None

    def initial(self, kind: str) -> float:
        return 0.0

    def hypers(self, groups: list[dict]) -> list:
        return []

    def describe(self) -> str:
        return f"{self.name} (the client optimizer's own step over the fp32 master shards)"

    def register(self, unit, master: torch.Tensor) -> None:
        """The views of `unit`'s master shard this optimizer steps, one per param-group segment."""
        if self._inner is not None:
            raise RuntimeError("ClientRule: every unit registers before the first step")
        views = []
        for seg in unit.segments:
            view = master[seg.start:seg.start + seg.count].detach()
            self._views[seg.group].append(view)
            views.append((seg.start, view))
        self._of[unit.index] = views

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's optimizer class over the views, built at first use."""
        if self._inner is None:
            groups = [dict(self._values(g), params=views) for g, views in zip(self.user.param_groups, self._views)
                      if views]
            cls = type(self.user)
            try:  # its defaults as the arguments its constructor takes (AdamW's lack decoupled_weight_decay)
                accepted = inspect.signature(cls.__init__).parameters
                kwargs = {k: v for k, v in self.user.defaults.items() if k in accepted}
                self._inner = cls(groups, **kwargs) if groups else None
            except (TypeError, ValueError) as e:
                raise TypeError(f"optimizer: infinity runs {self.name} over the parameter shards by building it "
                                f"again from its defaults, {cls.__name__}(params, **defaults), which failed: {e}") from e
            self._group_of = [i for i, views in enumerate(self._views) if views]
        return self._inner

    @staticmethod
    def _values(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def update(self, unit, grad: torch.Tensor, grad_scale: float) -> None:
        """Steps `unit`'s segments with their slices of the fp32 gradient `grad`."""
        inner = self.inner
        if inner is None:
            return
        for gi, group in zip(self._group_of, inner.param_groups):
            group.update(self._values(self.user.param_groups[gi]))
        views = self._of.get(unit.index, [])
        for (start, view), seg in zip(views, unit.segments):
            g = grad[start:start + seg.count]
            view.grad = g * grad_scale if grad_scale != 1.0 else g.clone()
        try:
            inner.step()
        finally:
            for _, view in views:
                view.grad = None

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = self.inner
        if inner is None:
            return
        views = [p for g in inner.param_groups for p in g["params"]]
        for index, saved in state.get("state", {}).items():
            for key, value in saved.items():
                if (isinstance(value, torch.Tensor) and value.dim() and index < len(views)
                        and value.shape != views[index].shape):
                    raise ValueError(f"optimizer: the checkpoint's {self.name} state ({key} of shard {index}: "
                                     f"{tuple(value.shape)}) is not this run's ({tuple(views[index].shape)}); a "
                                     "client optimizer's state loads at the world size it was saved at")
        inner.load_state_dict(state)


def rule_for_optimizer(optimizer: torch.optim.Optimizer):
    """The rule that runs a user's optimizer object: one of infinity's kernels where the class and
    its options are the kernel's, else the optimizer's own step (`ClientRule`). Its moments' format
    is its `moment_format` default, else bf16 for `fp32_optimizer_states=False` (DeepSpeed's CPU
    optimizers' argument), else fp32."""
    name = type(optimizer).__name__
    d = optimizer.defaults
    dtype = d.get("moment_format") or ("fp32" if d.get("fp32_optimizer_states", True) else "bf16")
    plain = not d.get("maximize", False) and not d.get("differentiable", False)
    if name in ("Adam", "AdamW", "CPUAdam", "DeepSpeedCPUAdam", "FusedAdam") and plain and not d.get("amsgrad"):
        return AdamRule(fmt=dtype)
    if name in ("CPUAdagrad", "DeepSpeedCPUAdagrad", "Adagrad") and plain:
        return AdagradRule(fmt=dtype, initial_accumulator_value=d.get("initial_accumulator_value", 0.0))
    if name in ("CPULion", "DeepSpeedCPULion", "Lion") and plain and "betas" in d:
        return LionRule(fmt=dtype)
    if name in ("CPULamb", "FusedLamb", "Lamb") and plain and not d.get("eps_inside_sqrt", False):
        return LambRule(fmt=dtype)
    return ClientRule(optimizer)
