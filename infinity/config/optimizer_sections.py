"""The `optimizer` and `scheduler` sections: Adam or AdamW and its hyperparameters, and the
learning-rate schedule with each schedule's parameters, under DeepSpeed's names and defaults.

Like every section they validate themselves on construction (see sections.py).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar

from infinity.config._checks import (
    _bool,
    _check,
    _choice,
    _float,
    _instance,
    _int,
    _lrs,
    _optional,
    _show,
    _spec,
    _validate,
)

WARMUP_TYPES = ("log", "linear")
OPTIMIZER_TYPES = ("Adam", "AdamW", "Adagrad", "Lion", "Lamb")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")

# DeepSpeed optimizer types that infinity does not provide (lower-cased: DeepSpeed matches them
# case-insensitively).
_DEEPSPEED_ONLY_OPTIMIZERS = frozenset({
    "onebitadam", "zerooneadam", "onebitlamb", "muon", "muadam",
    "muadamw", "musgd",
})


MOMENT_FORMATS = ("fp32", "bf16", "8bit")


def _resolve_format(params: Any) -> None:
    """moment_format from fp32_optimizer_states when unset; the two may not disagree."""
    implied = "fp32" if params.fp32_optimizer_states else "bf16"
    if params.moment_format is None:
        object.__setattr__(params, "moment_format", implied)
    elif not params.fp32_optimizer_states and params.moment_format == "fp32":
        raise ValueError("optimizer.params.moment_format: \"fp32\" contradicts fp32_optimizer_states false; "
                         "give one of them")


def _betas(value: Any, path: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{path}: expected a list of two numbers, got {_show(value)}")
    betas = tuple(_float(beta, f"{path}[{i}]") for i, beta in enumerate(value))
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{path}[{i}]: expected a number in [0, 1), got {_show(beta)}")
    return betas  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamParams:
    """Adam hyperparameters (section `optimizer.params`), with DeepSpeed's defaults."""

    _PATH: ClassVar[str] = "optimizer.params"

    lr: float = _spec(_float, minimum=0.0, default=1e-3)
    """Learning rate (a scheduler, if configured, overwrites it every step)."""
    betas: tuple[float, float] = _spec(_betas, default=(0.9, 0.999))
    """Decay rates of the first and second moment estimates."""
    eps: float = _spec(_float, minimum=0.0, default=1e-8)
    """Added to the denominator for numerical stability."""
    weight_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """Weight decay, decoupled (AdamW) or added to the gradient (L2), see `adam_w_mode`."""
    adam_w_mode: bool = _spec(_bool, default=True)
    """For type Adam: decoupled weight decay when true (DeepSpeed's default). AdamW ignores it."""
    fp32_optimizer_states: bool = _spec(_bool, default=True)
    """False keeps the moments in bfloat16, in memory and on NVMe (DeepSpeed's CPU Adam option);
    the master stays fp32 ([Note: moment formats] in infinity/optim/formats.py)."""
    moment_format: str | None = _spec(_optional(_choice), MOMENT_FORMATS, default=None)
    """(infinity) "fp32", "bf16" or "8bit" (block-wise 8-bit moments); unset: what
    fp32_optimizer_states says."""

    def __post_init__(self) -> None:
        _validate(self)
        _resolve_format(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdagradParams:
    """Adagrad hyperparameters (`optimizer.params` of type Adagrad): torch.optim.Adagrad's, with
    DeepSpeed's CPU Adagrad defaults."""

    _PATH: ClassVar[str] = "optimizer.params"

    lr: float = _spec(_float, minimum=0.0, default=1e-2)
    """Learning rate (a scheduler, if configured, overwrites it every step)."""
    eps: float = _spec(_float, minimum=0.0, default=1e-10)
    """Added to the square root of the sum of squared gradients."""
    weight_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """L2 weight decay, added to the gradient (as torch's Adagrad)."""
    lr_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """The step size is lr / (1 + (step - 1) * lr_decay)."""
    initial_accumulator_value: float = _spec(_float, minimum=0.0, default=0.0)
    """The value the sum of squared gradients starts at."""
    fp32_optimizer_states: bool = _spec(_bool, default=True)
    """False keeps the sum in bfloat16, in memory and on NVMe."""
    moment_format: str | None = _spec(_optional(_choice), MOMENT_FORMATS, default=None)
    """(infinity) "fp32", "bf16" or "8bit"; unset: what fp32_optimizer_states says."""

    def __post_init__(self) -> None:
        _validate(self)
        _resolve_format(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class LionParams:
    """Lion hyperparameters (`optimizer.params` of type Lion), with DeepSpeed's defaults."""

    _PATH: ClassVar[str] = "optimizer.params"

    lr: float = _spec(_float, minimum=0.0, default=1e-3)
    """Learning rate (a scheduler, if configured, overwrites it every step)."""
    betas: tuple[float, float] = _spec(_betas, default=(0.9, 0.999))
    """Interpolation of the update's sign (beta1) and of the momentum (beta2)."""
    weight_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """Decoupled weight decay: the param is multiplied by 1 - lr * weight_decay."""
    fp32_optimizer_states: bool = _spec(_bool, default=True)
    """False keeps the momentum in bfloat16, in memory and on NVMe."""
    moment_format: str | None = _spec(_optional(_choice), MOMENT_FORMATS, default=None)
    """(infinity) "fp32", "bf16" or "8bit"; unset: what fp32_optimizer_states says."""

    def __post_init__(self) -> None:
        _validate(self)
        _resolve_format(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class LambParams:
    """LAMB hyperparameters (`optimizer.params` of type Lamb): DeepSpeed's FusedLamb's, and its
    defaults ([Note: LAMB's two passes] in infinity/optim/rules.py)."""

    _PATH: ClassVar[str] = "optimizer.params"

    lr: float = _spec(_float, minimum=0.0, default=1e-3)
    """Learning rate (a scheduler, if configured, overwrites it every step)."""
    betas: tuple[float, float] = _spec(_betas, default=(0.9, 0.999))
    """Decay rates of the first and second moment estimates."""
    eps: float = _spec(_float, minimum=0.0, default=1e-8)
    """Added to the square root of the second moment (outside it)."""
    weight_decay: float = _spec(_float, minimum=0.0, default=0.0)
    """Added to the update direction as weight_decay * param, inside the trust ratio."""
    bias_correction: bool = _spec(_bool, default=True)
    """The step size is lr * sqrt(1 - beta2^t) / (1 - beta1^t); false: lr."""
    max_coeff: float = _spec(_float, minimum=0.0, default=10.0)
    """The trust ratio's upper clamp."""
    min_coeff: float = _spec(_float, minimum=0.0, default=0.01)
    """The trust ratio's lower clamp."""
    fp32_optimizer_states: bool = _spec(_bool, default=True)
    """False keeps the moments in bfloat16, in memory and on NVMe."""
    moment_format: str | None = _spec(_optional(_choice), MOMENT_FORMATS, default=None)
    """(infinity) "fp32", "bf16" or "8bit"; unset: what fp32_optimizer_states says."""

    def __post_init__(self) -> None:
        _validate(self)
        _resolve_format(self)
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"optimizer.params.min_coeff: {self.min_coeff} is more than max_coeff {self.max_coeff}")


PARAMS_OF_TYPE = {"Adam": AdamParams, "AdamW": AdamParams, "Adagrad": AdagradParams, "Lion": LionParams,
                  "Lamb": LambParams}


def _optimizer_type(value: Any, path: str) -> str:
    """One of OPTIMIZER_TYPES, matched case-insensitively as DeepSpeed does; returned canonical."""
    if not isinstance(value, str):
        raise TypeError(f"{path}: expected a string, got {_show(value)}")
    for name in OPTIMIZER_TYPES:
        if value.lower() == name.lower():
            return name
    if value.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
        raise ValueError(f"{path}: DeepSpeed optimizer {_show(value)} not implemented by "
                         f"infinity; expected one of {', '.join(map(_show, OPTIMIZER_TYPES))}")
    return _choice(value, path, OPTIMIZER_TYPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer infinity builds (section `optimizer`): Adam, AdamW, Adagrad, Lion or Lamb."""

    _PATH: ClassVar[str] = "optimizer"

    type: str = _spec(_optimizer_type)
    """"Adam", "AdamW", "Adagrad", "Lion" or "Lamb" (any case in JSON, stored canonical)."""
    params: AdamParams | AdagradParams | LionParams | LambParams = _spec(
        _instance, (AdamParams, AdagradParams, LionParams, LambParams), factory=AdamParams)
    """Hyperparameters."""

    def __post_init__(self) -> None:
        _validate(self)
        expected = PARAMS_OF_TYPE[self.type]
        if not isinstance(self.params, expected):
            raise TypeError(f"optimizer.params: type {self.type} takes {expected.__name__}, got "
                            f"{type(self.params).__name__}")

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style decay: type AdamW, or type Adam with adam_w_mode (DeepSpeed's rule)."""
        return self.type == "AdamW" or getattr(self.params, "adam_w_mode", True)


# Fields shared by the schedules, as keyword arguments of `_spec`.
_WARMUP_NUM_STEPS = dict(minimum=1, default=1000)
_LAST_BATCH_ITERATION = dict(minimum=-1, default=-1)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupLRParams:
    """WarmupLR: from warmup_min_lr up to warmup_max_lr, then constant (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    warmup_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.0)
    """Learning rate at the first step; a list gives one per optimizer param group."""
    warmup_max_lr: float | tuple[float, ...] | None = _spec(_optional(_lrs), default=None)
    """Learning rate reached after warmup; None (the default) takes the optimizer's lr."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupDecayLRParams:
    """WarmupDecayLR: WarmupLR's warmup, then linear decay to warmup_min_lr at total_num_steps."""

    _PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = _spec(_int, minimum=1)
    """Step at which the decay reaches warmup_min_lr (required)."""
    warmup_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.0)
    """Learning rate at the first step and at the end of decay; a list gives one per group."""
    warmup_max_lr: float | tuple[float, ...] = _spec(_lrs, default=0.001)
    """Learning rate reached after warmup; a list gives one per optimizer param group."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosineLRParams:
    """WarmupCosineLR: warmup of the optimizer's lr by a ratio, then cosine decay."""

    _PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = _spec(_int, minimum=1)
    """Step at which the cosine reaches cos_min_ratio (required)."""
    warmup_min_ratio: float = _spec(_float, minimum=0.0, maximum=1.0, default=0.0)
    """Fraction of the optimizer's lr at the first step."""
    warmup_num_steps: int = _spec(_int, **_WARMUP_NUM_STEPS)
    """Steps of warmup (DeepSpeed uses at least 2)."""
    cos_min_ratio: float = _spec(_float, minimum=0.0, maximum=1.0, default=0.0001)
    """Fraction of the optimizer's lr at the end of the cosine decay."""
    warmup_type: str = _spec(_choice, WARMUP_TYPES, default="log")
    """Shape of the warmup curve: "log" or "linear"."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


def _momentum(value: Any, path: str) -> float:
    momentum = _float(value, path)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{path}: expected a number in [0, 1), got {_show(value)}")
    return momentum


def _momenta(value: Any, path: str) -> float | tuple[float, ...]:
    """One Adam beta1, or one per optimizer param group (a JSON list)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{path}: expected a number or a non-empty list of numbers, got []")
        return tuple(_momentum(item, f"{path}[{i}]") for i, item in enumerate(value))
    return _momentum(value, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class OneCycleParams:
    """OneCycle: the lr rises from cycle_min_lr to cycle_max_lr and falls back in one cycle,
    then decays; Adam's beta1 cycles the other way (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    cycle_min_lr: float | tuple[float, ...] = _spec(_lrs)
    """Learning rate at both ends of the cycle (required); a list gives one per param group."""
    cycle_max_lr: float | tuple[float, ...] = _spec(_lrs)
    """Learning rate at the top of the cycle (required); a list gives one per param group."""
    decay_lr_rate: float = _spec(_float, minimum=0.0, default=0.0)
    """After the cycle the lr is cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size)."""
    cycle_first_step_size: int = _spec(_int, minimum=1, default=2000)
    """Steps in which the lr rises (and beta1 falls)."""
    cycle_second_step_size: int | None = _spec(_optional(_int), minimum=0, default=None)
    """Steps in which the lr falls back; None (the default) takes cycle_first_step_size."""
    cycle_first_stair_count: int = _spec(_int, minimum=0, default=0)
    """Stairs the rise is cut into (lr and beta1 held flat on each); 0 rises every step."""
    cycle_second_stair_count: int | None = _spec(_optional(_int), minimum=0, default=None)
    """Stairs of the fall; None (the default) takes cycle_first_stair_count."""
    decay_step_size: int = _spec(_int, minimum=0, default=0)
    """Steps per unit of the decay after the cycle; 0 (the default) does not decay."""
    cycle_momentum: bool = _spec(_bool, default=True)
    """Cycle Adam's beta1 from cycle_max_mom down to cycle_min_mom and back (beta2 is set to
    0.99, as DeepSpeed does)."""
    cycle_min_mom: float | tuple[float, ...] = _spec(_momenta, default=0.8)
    """beta1 at the top of the lr cycle; a list gives one per param group."""
    cycle_max_mom: float | tuple[float, ...] = _spec(_momenta, default=0.9)
    """beta1 at both ends of the lr cycle; a list gives one per param group."""
    decay_mom_rate: float = _spec(_float, minimum=0.0, default=0.0)
    """After the cycle beta1 is cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class LRRangeTestParams:
    """LRRangeTest: the lr grows linearly from lr_range_test_min_lr, to find the largest that
    trains (`scheduler.params`)."""

    _PATH: ClassVar[str] = "scheduler.params"

    lr_range_test_min_lr: float | tuple[float, ...] = _spec(_lrs, default=0.001)
    """Learning rate at the first step; a list gives one per optimizer param group."""
    lr_range_test_step_size: int = _spec(_int, minimum=1, default=2000)
    """Steps over which the lr grows by lr_range_test_step_rate times lr_range_test_min_lr."""
    lr_range_test_step_rate: float = _spec(_float, minimum=0.0, default=1.0)
    """Growth per lr_range_test_step_size steps, as a multiple of lr_range_test_min_lr."""
    lr_range_test_staircase: bool = _spec(_bool, default=False)
    """Grow in whole steps of lr_range_test_step_size instead of every step."""
    last_batch_iteration: int = _spec(_int, **_LAST_BATCH_ITERATION)
    """Index of the last step taken, to resume; -1 starts from the beginning."""

    def __post_init__(self) -> None:
        _validate(self)


_SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


def _scheduler_type(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{path}: expected a string, got {_show(value)}")
    if value not in SCHEDULER_TYPES:
        close = difflib.get_close_matches(value, SCHEDULER_TYPES, n=1)
        hint = f"; did you mean {_show(close[0])}?" if close else ""
        raise ValueError(f"{path}: expected one of {', '.join(map(_show, SCHEDULER_TYPES))}, "
                         f"got {_show(value)}{hint}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """The learning-rate schedule (section `scheduler`); see `infinity.optim.lr_schedules`."""

    _PATH: ClassVar[str] = "scheduler"

    type: str = _spec(_scheduler_type)
    """"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle" or "LRRangeTest"
    (case-sensitive, as in DeepSpeed)."""
    params: (WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | OneCycleParams
             | LRRangeTestParams) = _spec(_instance, tuple(_SCHEDULER_PARAMS.values()))
    """Parameters of that schedule, with DeepSpeed's names and defaults."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self, "params", _instance, _SCHEDULER_PARAMS[self.type])
