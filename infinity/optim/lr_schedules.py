"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and
LRRangeTest.

Same parameter names, defaults and numbers as DeepSpeed's `deepspeed.runtime.lr_schedules`, so
a job that moves over keeps its learning-rate curve, and resumes from DeepSpeed's scheduler
state (`{"last_batch_iteration": n}`).

[Note: DeepSpeed's step counting]
`last_batch_iteration` is the index of the last step taken. A schedule built with the default
-1 writes the lr of "iteration -1" into the optimizer at once (warmup_min_lr; 0 for the cosine
schedule; cycle_min_lr and lr_range_test_min_lr) and does not step; each `step()` then advances
one iteration and writes that iteration's lr. Iteration i < warmup_num_steps is in warmup, with
progress log(i + 1) / log(warmup_num_steps) ("log") or i / warmup_num_steps ("linear"), and
DeepSpeed warms up over at least 2 steps (so that the log is defined). OneCycle and LRRangeTest
count from i + 1, the steps done. A schedule built with another last_batch_iteration resumes
there: it leaves the optimizer's lr (and betas) alone until the next `step()`.

[Note: why these are not torch LRScheduler subclasses]
torch's LRScheduler steps once inside its constructor, counts epochs from 0, needs
`initial_lr` in every param group to resume, and warns when stepped before `optimizer.step()`.
Following it would change either DeepSpeed's numbers or its state dict, so these are plain
objects with LRScheduler's everyday surface: `optimizer`, `step()`, `get_lr()`,
`get_last_lr()`, `state_dict()` and `load_state_dict()`.

[Note: OneCycle's cycle and momentum]
With n = i + 1 steps done at iteration i and a cycle of first + second steps, the lr moves
from cycle_min_lr up to cycle_max_lr over the first n = 0..first, then back down over the
second, by the fraction n / first (rising) or (first + second - n) / second (falling); stair
counts floor that fraction to whole stairs. From iteration first + second on (d = i - first -
second + 1 steps after the cycle) the lr is cycle_min_lr / (1 + decay_lr_rate * d /
decay_step_size), or cycle_min_lr when either is 0. With cycle_momentum, Adam's beta1 moves the
other way, from cycle_max_mom down to cycle_min_mom, and after the cycle is cycle_max_mom * (1 +
decay_mom_rate * d / decay_step_size): it rises, as in DeepSpeed. As DeepSpeed does, OneCycle
writes the betas of every param group as (beta1, 0.99), replacing the optimizer's own beta2,
and a schedule built at iteration -1 starts beta1 at cycle_min_mom (although the cycle is at
cycle_max_mom there, as `get_mom()` says). An optimizer whose param groups have no
"betas" (SGD) keeps its momentum: cycle_momentum is turned off with a warning. LRRangeTest's lr
is lr_range_test_min_lr * (1 + lr_range_test_step_rate * n / lr_range_test_step_size), with
n / lr_range_test_step_size floored when lr_range_test_staircase.

[Note: arguments as DeepSpeed takes them]
Built from Python, the schedules take what DeepSpeed's take, and say so where DeepSpeed does:
an unknown warmup_type warms up along "log" with a logged warning (not a Python warning, which
code run under `-W error` would turn into an exception), as does a total_num_steps below
warmup_num_steps; OneCycle's step sizes and decay_step_size may be floats (DeepSpeed converts
them with float()), a stair count at or below 0 means no stairs (DeepSpeed's command line
defaults it to -1), and an optimizer without betas turns cycle_momentum off with a logged
warning. What DeepSpeed would divide by zero on (a warmup, range-test or first cycle step size
of 0) or zip short (a per-group list of the wrong length) is a ValueError naming the argument.
The JSON `scheduler` section stays stricter (infinity.config): a config names its values
once, so a typo there is an error rather than a fallback.

Remaining differences from DeepSpeed: `get_last_lr()` returns Python floats even where the
optimizer keeps its lr in a tensor (which is updated in place); OneCycle's lr and beta1 are
computed from the position in the cycle, so they agree with DeepSpeed's to float rounding and
the peak is exactly cycle_max_lr, and `get_last_lr()` answers right after it is built
(DeepSpeed's only after the first step).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import fields
from typing import Any

import torch

from infinity.config import WARMUP_TYPES, SchedulerConfig

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler"]

# The beta2 OneCycle writes next to its beta1 (see [Note: OneCycle's cycle and momentum]).
_ONE_CYCLE_BETA2 = 0.99

log = logging.getLogger("infinity")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _real(value: Any, name: str) -> numbers.Real:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    return value


def _positive_number(value: Any, name: str) -> numbers.Real:
    """An int stays an int (exact cycle arithmetic); a float is taken as DeepSpeed takes it."""
    if _real(value, name) <= 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return value


def _non_negative_number(value: Any, name: str) -> numbers.Real:
    if _real(value, name) < 0:
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
    return value


def _warmup_type(warmup_type: Any) -> str:
    """warmup_type, or "log" with a logged warning for one DeepSpeed does not know (as it does;
    see [Note: arguments as DeepSpeed takes them])."""
    if warmup_type in WARMUP_TYPES:
        return warmup_type
    log.warning("warmup_type: unknown %r (expected one of %s); warming up along 'log', as "
                "DeepSpeed does", warmup_type, ", ".join(map(repr, WARMUP_TYPES)))
    return "log"


def _warn_if_total_below_warmup(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        log.warning("total_num_steps %d is less than warmup_num_steps %d: the schedule never "
                    "decays from its warmup", total_num_steps, warmup_num_steps)


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """The param groups of a torch optimizer, or of a wrapper that holds one as `.optimizer`
    (as DeepSpeed accepts); any object with `param_groups` will do."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        groups = getattr(candidate, "param_groups", None)
        if isinstance(groups, list) and all(isinstance(g, dict) and "lr" in g for g in groups):
            return groups
    raise TypeError(f"optimizer: expected an optimizer with param_groups, "
                    f"got {type(optimizer).__name__}")


def _per_group(value: Any, name: str, num_groups: int) -> list[float]:
    """One value per param group: a list or tuple as given, or a number repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"{name}: expected {num_groups} values (one per param group), "
                             f"got {len(value)}")
        return [float(item) for item in value]
    return [float(value)] * num_groups


class _Schedule:
    """What every schedule shares: the optimizer, the step counter, writing the lr, the state."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise TypeError(f"last_batch_iteration: expected an integer, "
                            f"got {last_batch_iteration!r}")
        self.optimizer = optimizer
        _param_groups(optimizer)  # fail now rather than at the first step
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    @property
    def _groups(self) -> list[dict[str, Any]]:
        # Looked up every time: torch's Optimizer.load_state_dict replaces the list.
        return _param_groups(self.optimizer)

    def get_lr(self) -> list[float]:
        """The lr of every param group at iteration `last_batch_iteration`."""
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to `last_batch_iteration`) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lr last written into the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError("get_last_lr: no learning rate written yet: the schedule resumes "
                               f"after iteration {self.last_batch_iteration}; call step() first")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume after `last_batch_iteration`; the optimizer's lr is left until `step()`."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]

    def _write(self, lrs: list[float]) -> None:
        for group, lr in zip(self._groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)


class _WarmupSchedule(_Schedule):
    """What the three warmup schedules share: the warmup curve."""

    def __init__(self, optimizer: Any, *, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:
        warmup_num_steps = _positive_int(warmup_num_steps, "warmup_num_steps")
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = max(2, warmup_num_steps)  # see [Note: DeepSpeed's step counting]
        self.warmup_type = _warmup_type(warmup_type)
        self._inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_progress(self, iteration: int) -> float:
        """Fraction of warmup done at 0 <= iteration < warmup_num_steps."""
        if self.warmup_type == "log":
            return self._inverse_log_warmup * math.log(iteration + 1)
        return iteration / self.warmup_num_steps


class WarmupLR(_WarmupSchedule):
    """Raise the lr of each param group from warmup_min_lr to warmup_max_lr over
    warmup_num_steps steps, then hold it at warmup_max_lr.

    warmup_min_lr and warmup_max_lr take one number, or a list with one per param group;
    warmup_max_lr None takes each param group's own lr.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type,
                         last_batch_iteration=last_batch_iteration)
        if warmup_max_lr is None:  # each group warms up to its own lr, as DeepSpeed 0.19.8 does
            warmup_max_lr = [float(g["lr"]) for g in self._groups]
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", len(self._groups))
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", len(self._groups))
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def _gamma(self, iteration: int) -> float:
        """Position between warmup_min_lr (0) and warmup_max_lr (1) at `iteration` >= 0."""
        if iteration < self.warmup_num_steps:
            return self._warmup_progress(iteration)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(self.last_batch_iteration)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay from warmup_max_lr back to warmup_min_lr at
    total_num_steps, where the lr stays."""

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        # Set before the base class writes the first lr.
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        _warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_progress(iteration)
        decay_steps = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, float(self.total_num_steps - iteration) / float(decay_steps))


class WarmupCosineLR(_WarmupSchedule):
    """Scale each param group's lr (as found when the schedule is built) by a ratio that rises
    from warmup_min_ratio to 1 over warmup_num_steps steps, then falls along a half cosine to
    cos_min_ratio at total_num_steps, where it stays."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type,
                         last_batch_iteration=last_batch_iteration)
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        _warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in self._groups]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to every param group's lr at iteration `last_batch_iteration`."""
        iteration = self.last_batch_iteration
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            progress = self._warmup_progress(iteration)
            return self.warmup_min_ratio + progress * (1.0 - self.warmup_min_ratio)
        steps_into_decay = iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so that the ratio rests at cos_min_ratio after total_num_steps, as in
        # current DeepSpeed (older versions let the cosine climb back up).
        progress = min(1.0, steps_into_decay / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """One cycle of the lr from cycle_min_lr up to cycle_max_lr and back, then an optional
    decay; Adam's beta1 cycles the other way, from cycle_max_mom down to cycle_min_mom (see
    [Note: OneCycle's cycle and momentum]).

    cycle_min_lr, cycle_max_lr, cycle_min_mom and cycle_max_mom take one number, or a list with
    one per param group. The second half lasts cycle_first_step_size steps and has
    cycle_first_stair_count stairs unless given its own; a stair count at or below 0 means no
    stairs. Step sizes may be floats, as DeepSpeed's ([Note: arguments as DeepSpeed takes them]).
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float],
                 cycle_max_lr: float | list[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        num_groups = len(self._groups)
        self.first_step_size = _positive_number(cycle_first_step_size, "cycle_first_step_size")
        self.second_step_size = self.first_step_size if cycle_second_step_size is None else (
            _non_negative_number(cycle_second_step_size, "cycle_second_step_size"))
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = _real(cycle_first_stair_count, "cycle_first_stair_count")
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None else (
            _real(cycle_second_stair_count, "cycle_second_stair_count"))
        self.decay_step_size = _non_negative_number(decay_step_size, "decay_step_size")
        self.min_lrs = _per_group(cycle_min_lr, "cycle_min_lr", num_groups)
        self.max_lrs = _per_group(cycle_max_lr, "cycle_max_lr", num_groups)
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = _per_group(cycle_min_mom, "cycle_min_mom", num_groups)
        self.max_moms = _per_group(cycle_max_mom, "cycle_max_mom", num_groups)
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not all("betas" in group for group in self._groups):
            log.warning("cycle_momentum: turned off, the optimizer's param groups have no "
                        "'betas' (OneCycle cycles only Adam's beta1)")
            self.cycle_momentum = False
        if last_batch_iteration == -1:  # everything is checked: now write
            self._write(self.get_lr())
            if self.cycle_momentum:
                self._write_betas([(mom, _ONE_CYCLE_BETA2) for mom in self.min_moms])

    @property
    def step_ratio(self) -> float:
        """The rising share of the cycle (DeepSpeed's attribute): 1.0 for a cycle without a fall."""
        return self.first_step_size / self.total_size

    def _height(self, iteration: int) -> float:
        """Where iteration (< the cycle's end) is between the cycle's ends (0) and its top (1)."""
        done = (iteration + 1) % self.total_size  # 0 at iteration -1 and at the cycle's end
        if done <= self.first_step_size:  # rising
            steps, size, stairs = done, self.first_step_size, self.first_stair_count
        else:  # falling: steps left to the cycle's end
            steps = self.total_size - done
            size, stairs = self.second_step_size, self.second_stair_count
        if stairs > 0:
            return (steps * stairs // size) / stairs
        return steps / size

    def _decay_interval(self, rate: float) -> float | None:
        """rate * (steps since the cycle's end / decay_step_size); None when there is no decay."""
        if self.decay_step_size == 0 or rate == 0.0:
            return None
        return rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            height = self._height(self.last_batch_iteration)
            return [low + (high - low) * height for low, high in zip(self.min_lrs, self.max_lrs)]
        interval = self._decay_interval(self.decay_lr_rate)
        if interval is None:
            return list(self.min_lrs)
        return [low / (1.0 + interval) for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas of every param group at iteration `last_batch_iteration`; None without
        cycle_momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            height = self._height(self.last_batch_iteration)
            beta1s = [high - (high - low) * height
                      for low, high in zip(self.min_moms, self.max_moms)]
        else:
            interval = self._decay_interval(self.decay_mom_rate)
            beta1s = list(self.max_moms) if interval is None else [
                high * (1.0 + interval) for high in self.max_moms]
        return [(beta1, _ONE_CYCLE_BETA2) for beta1 in beta1s]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to `batch_iteration`, DeepSpeed's name for it here)
        and write its lr and betas."""
        super().step(batch_iteration)
        betas = self.get_mom()
        if betas is not None:
            self._write_betas(betas)

    def _write_betas(self, betas: list[tuple[float, float]]) -> None:
        for group, pair in zip(self._groups, betas):
            group["betas"] = pair


class LRRangeTest(_Schedule):
    """Raise the lr of each param group from lr_range_test_min_lr by lr_range_test_step_rate
    times that every lr_range_test_step_size steps, smoothly or (lr_range_test_staircase) in
    stairs; to find the largest lr that still trains.

    lr_range_test_min_lr takes one number, or a list with one per param group.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(lr_range_test_min_lr, "lr_range_test_min_lr", len(self._groups))
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr(self) -> list[float]:
        done = self.last_batch_iteration + 1
        intervals = done // self.step_size if self.staircase else done / self.step_size
        growth = 1.0 + self.step_rate * intervals
        return [lr * growth for lr in self.min_lrs]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to `batch_iteration`, DeepSpeed's name for it here)
        and write its lr."""
        super().step(batch_iteration)


_SCHEDULES: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(config: SchedulerConfig | None, optimizer: Any) -> _Schedule | None:
    """The schedule a `scheduler` config section describes, driving `optimizer`'s lr; None for
    no section. Built with the default last_batch_iteration -1, it sets the optimizer's lr at
    once (see [Note: DeepSpeed's step counting])."""
    if config is None:
        return None
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"scheduler: expected a SchedulerConfig, got {type(config).__name__}")
    params = {spec.name: getattr(config.params, spec.name) for spec in fields(config.params)}
    return _SCHEDULES[config.type](optimizer, **params)
