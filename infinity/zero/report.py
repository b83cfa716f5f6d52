"""Per-step timings and what moved between tiers, printed as DeepSpeed's wall_clock_breakdown
and steps_per_print do, and kept in `last` for programs and tests."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infinity.engine import Engine

log = logging.getLogger("infinity")


class StepReport:
    def __init__(self) -> None:
        self._times: dict[str, float] = defaultdict(float)
        self._step_start_gather = 0.0
        self._step_start_reduce = 0.0
        self.last: dict[str, Any] = {}

    def add_time(self, phase: str, seconds: float) -> None:
        self._times[phase] += seconds

    def finish_step(self, engine: "Engine", grad_norm: float, *, updated_in_backward: int = 0) -> None:
        gather = engine.fetcher.gather_seconds - self._step_start_gather
        reduce = engine.hooks.reduce_seconds - self._step_start_reduce
        self._step_start_gather = engine.fetcher.gather_seconds
        self._step_start_reduce = engine.hooks.reduce_seconds
        t = dict(self._times)
        self._times.clear()
        self.last = {
            "step": engine.global_steps, "forward_s": t.get("forward", 0.0), "backward_s": t.get("backward", 0.0),
            "step_s": t.get("step", 0.0), "gather_s": gather, "reduce_s": reduce, "grad_norm": grad_norm,
            "loss_scale": engine.get_loss_scale(), "lr": engine.get_lr(),
            "peak_live_numel": engine.fetcher.peak_live_numel,
            "units_updated_in_backward": updated_in_backward,
            "trainable_params": engine.trainable_numel, "frozen_params": engine.frozen_numel,
        }
        io = getattr(engine.params, "io_stats", None)
        if io is not None:
            self.last.update(io())
        io = getattr(engine.optim_state, "io_stats", None)
        if io is not None:
            self.last.update({f"optimizer_{k}": v for k, v in io().items()})
        if engine.rank != 0:
            return
        cfg = engine.config
        if cfg.wall_clock_breakdown:
            total = self.last["forward_s"] + self.last["backward_s"] + self.last["step_s"]
            log.warning("step %d: forward %.1f ms | backward %.1f ms | step %.1f ms | gather %.1f ms | "
                        "reduce %.1f ms | total %.1f ms", engine.global_steps, 1e3 * self.last["forward_s"],
                        1e3 * self.last["backward_s"], 1e3 * self.last["step_s"], 1e3 * gather, 1e3 * reduce,
                        1e3 * total)
        if cfg.steps_per_print and engine.global_steps % cfg.steps_per_print == 0:
            log.warning("step %d: lr %s | loss scale %g | grad norm %.4g | step time %.1f ms", engine.global_steps,
                        ", ".join(f"{lr:.3g}" for lr in self.last["lr"]), self.last["loss_scale"], grad_norm,
                        1e3 * (self.last["forward_s"] + self.last["backward_s"] + self.last["step_s"]))
