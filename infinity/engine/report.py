"""Per-step timings and what moved between tiers, printed as DeepSpeed's wall_clock_breakdown
and steps_per_print do, and kept in `last` for programs and tests.

The engine hands it values (`finish_step`): the report reads nothing of the engine's."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

log = logging.getLogger("infinity")


def waits_summary(waits: dict[str, float], top: int = 3) -> str:
    """ "compute thread waited X s on Y (a s), Z (b s)": the largest waits of a step."""
    total = sum(waits.values())
    largest = sorted(waits.items(), key=lambda kv: -kv[1])[:top]
    return (f"compute thread waited {total:.3f} s" +
            (" on " + ", ".join(f"{name} ({s:.3f} s)" for name, s in largest) if largest else ""))


class StepReport:
    def __init__(self, *, wall_clock_breakdown: bool = False, steps_per_print: int = 0, rank: int = 0) -> None:
        self.wall_clock_breakdown = wall_clock_breakdown
        self.steps_per_print = steps_per_print
        self.rank = rank
        self._times: dict[str, float] = defaultdict(float)
        self._totals: dict[str, float] = {}  # running totals (gather, reduce seconds) at the last step
        self.last: dict[str, Any] = {}

    def add_time(self, phase: str, seconds: float) -> None:
        self._times[phase] += seconds

    def finish_step(self, step: int, facts: dict[str, Any], totals: dict[str, float]) -> None:
        """Closes one step: `facts` (grad norm, lr, loss scale, bytes moved, ...) go into `last`
        as they are; `totals` are running totals (seconds of gathering, reducing) of which the
        step's share is reported."""
        t = dict(self._times)
        self._times.clear()
        self.last = {"step": step, "forward_s": t.get("forward", 0.0), "backward_s": t.get("backward", 0.0),
                     "step_s": t.get("step", 0.0)}
        for name, total in totals.items():
            self.last[f"{name}_s"] = total - self._totals.get(name, 0.0)
        self._totals = dict(totals)
        self.last.update(facts)
        if self.rank != 0:
            return
        r = self.last
        total = r["forward_s"] + r["backward_s"] + r["step_s"]
        if self.wall_clock_breakdown:
            log.warning("step %d: forward %.1f ms | backward %.1f ms | step %.1f ms | gather %.1f ms | "
                        "reduce %.1f ms | total %.1f ms | %s", step, 1e3 * r["forward_s"], 1e3 * r["backward_s"],
                        1e3 * r["step_s"], 1e3 * r.get("gather_s", 0.0), 1e3 * r.get("reduce_s", 0.0), 1e3 * total,
                        waits_summary(r.get("waits", {})) + (f"; ran the optimizer's update {r['optimizer_update_s']:.3f} s"
                                                             if r.get("optimizer_update_s") else ""))
        if self.steps_per_print and step % self.steps_per_print == 0:
            log.warning("step %d: lr %s | loss scale %g | grad norm %.4g | step time %.1f ms", step,
                        ", ".join(f"{lr:.3g}" for lr in r["lr"]), r["loss_scale"], r["grad_norm"], 1e3 * total)
