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
fp32, bf16 (DeepSpeed's `fp32_optimizer_states: false`) or 8 bits with a scale per block; the
kernels see fp32 or bf16 values, the tiers decode and encode 8-bit ones around them. The master
is always fp32.

A client optimizer infinity has no kernel for (torch.optim.SGD, a Lightning module's
`configure_optimizers`, accelerate's loop) is a `ClientRule`: its own `step()` runs over views
of the master shards, which it sees as its parameters ([Note: a client optimizer over shards]).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch

from infinity.optim.formats import MomentFormat, moment_format
from infinity.optim.functional import AdamHyper, adam_step

__all__ = ["AdagradRule", "AdamRule", "ClientRule", "LionRule", "Rule", "STREAMED", "rule_for_optimizer"]

STREAMED = ("Adam", "AdamW", "Adagrad", "Lion")  # the rules with a kernel: those whose state may live on NVMe


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

    def initial(self, kind: str) -> float:
        """The value a moment starts at."""
        return 0.0

    def hypers(self, groups: list[dict]) -> list:
        raise NotImplementedError

    def kernel(self, master, grad, state: dict[str, torch.Tensor], hyper, *, step: int, grad_scale: float,
               half_out: torch.Tensor | None) -> None:
        raise NotImplementedError

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
        from infinity.optim.functional import AdagradHyper
        return [AdagradHyper(float(g["lr"]), float(g["eps"]), float(g["weight_decay"]), float(g.get("lr_decay", 0.0)))
                for g in groups]

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        from infinity.optim.functional import adagrad_step
        adagrad_step(master, grad, state["exp_avg_sq"], hyper, step=step, grad_scale=grad_scale, half_out=half_out)

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
        from infinity.optim.functional import LionHyper
        return [LionHyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["weight_decay"]))
                for g in groups]

    def kernel(self, master, grad, state, hyper, *, step, grad_scale, half_out) -> None:
        from infinity.optim.functional import lion_step
        lion_step(master, grad, state["exp_avg"], hyper, step=step, grad_scale=grad_scale, half_out=half_out)

    def _torch_math(self, p, g, s, h, step) -> None:
        m = s["exp_avg"]
        c = m.lerp(g, 1 - h.beta1)
        p.mul_(1 - h.lr * h.weight_decay).add_(c.sign_(), alpha=-h.lr)
        m.lerp_(g, 1 - h.beta2)


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
    return ClientRule(optimizer)
