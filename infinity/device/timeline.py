"""Where a step's time goes: every unit's gather, compute, reduce, Adam piece and NVMe transfer,
and every wait of the compute thread with what it waited for.

[Note: the timeline]
The engine's pieces report into one process-wide `TIMELINE`:
- `span(name, cat)`: a stretch of the compute thread (also a torch.profiler range while a
  profiler runs, so torch.profiler traces show the same names: `profiled`). Category "wait"
  marks the thread doing nothing but waiting; its seconds are summed per name at every step,
  recorded or not, for the per-step report's "compute thread waited X s on Y".
- `transfer(...)`: an NVMe read or write, from its submission to the time the I/O handle says it
  completed (not when someone noticed), drawn on its own track.
- `begin`/`end`: a unit's forward or backward, which may overlap others (drawn as async slices).
Events are kept only while recording (`trace` config section, `infinity finetune --trace`), and
written as Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing). Times are
`time.monotonic()`, the clock of the I/O handle's completion times.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections import defaultdict
from typing import Any, Iterator

import torch

__all__ = ["TIMELINE", "Timeline", "profiled"]


# Work on the compute thread that the per-step report counts beside its waits, under this name:
# the optimizer's update (its CPU kernel between forward units, or in backward) is time the step's
# thread does not compute the model, as a wait for a read is.
ON_THE_STEPS_THREAD = {"update": "optimizer update"}


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler range named `name` while a profiler records, else nothing. An idle range
    still costs its op dispatch, 8-9 us a pair on the Intel host: the streaming 134M GPT's 8-bit
    step opened about 5,400 of them (two a transfer), and took 0.93x as long without them
    (bench/results/moment_formats.md)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class Timeline:
    def __init__(self) -> None:
        self._events: list[tuple] | None = None  # None: not recording
        self._waits: dict[str, float] = defaultdict(float)
        self._ids = itertools.count(1)

    # ---- recording ------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self._events is not None

    def start(self) -> None:
        self._events = []

    def stop(self) -> list[tuple]:
        events, self._events = self._events or [], None
        return events

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", *, profile: str | None = None, **args: Any) -> Iterator[None]:
        """`profile`: the torch.profiler range's name, if not `infinity::<name>`."""
        t0 = time.monotonic()
        with profiled(profile or f"infinity::{name}"):
            try:
                yield
            finally:
                t1 = time.monotonic()
                if cat == "wait":
                    self._waits[name] += t1 - t0
                elif name in ON_THE_STEPS_THREAD:  # work the step waits for as it would for I/O
                    self._waits[ON_THE_STEPS_THREAD[name]] += t1 - t0
                if self._events is not None:
                    self._events.append(("X", name, cat, t0, t1, threading.get_ident(), args))

    def add_wait(self, name: str, t0: float, t1: float, **args: Any) -> None:
        """A wait timed by its caller (one that cannot sit in a `with`)."""
        self._waits[name] += t1 - t0
        if self._events is not None:
            self._events.append(("X", name, "wait", t0, t1, threading.get_ident(), args))

    def transfer(self, track: str, name: str, started: float, finished: float, nbytes: int) -> None:
        if self._events is not None:
            self._events.append(("io", name, track, started, finished, next(self._ids), {"bytes": nbytes}))

    def begin(self, name: str, cat: str, **args: Any) -> int | None:
        if self._events is None:
            return None
        ident = next(self._ids)
        self._events.append(("b", name, cat, time.monotonic(), None, ident, args))
        return ident

    def end(self, ident: int | None, name: str, cat: str) -> None:
        if ident is not None and self._events is not None:
            self._events.append(("e", name, cat, time.monotonic(), None, ident, {}))

    def instant(self, name: str, cat: str, **args: Any) -> None:
        if self._events is not None:
            self._events.append(("i", name, cat, time.monotonic(), None, threading.get_ident(), args))

    # ---- the report -----------------------------------------------------------------------

    def take_waits(self) -> dict[str, float]:
        """Seconds the compute thread waited, per thing waited for, since the last call."""
        waits, self._waits = dict(self._waits), defaultdict(float)
        return waits

    # ---- export ---------------------------------------------------------------------------

    @staticmethod
    def chrome_trace(events: list[tuple], rank: int = 0) -> dict:
        """Chrome trace JSON ("traceEvents", microseconds) of recorded events."""
        pid = rank
        t_zero = min((e[3] for e in events), default=0.0)
        out: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"infinity rank {rank}"}}]
        tracks: dict[Any, int] = {}

        def tid(key: Any, label: str) -> int:
            if key not in tracks:
                tracks[key] = len(tracks) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tracks[key], "args": {"name": label}})
            return tracks[key]

        for ph, name, cat, t0, t1, ident, args in events:
            ts = (t0 - t_zero) * 1e6
            if ph == "X":
                label = "compute thread" if ident == threading.main_thread().ident else f"thread {ident}"
                out.append({"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": (t1 - t0) * 1e6,
                            "pid": pid, "tid": tid(ident, label), "args": args})
            elif ph == "io":  # async slices on the track of their direction
                common = {"name": name, "cat": cat, "id": ident, "pid": pid, "tid": tid(cat, cat)}
                out.append({**common, "ph": "b", "ts": ts, "args": args})
                out.append({**common, "ph": "e", "ts": (t1 - t_zero) * 1e6})
            elif ph in ("b", "e"):
                out.append({"ph": ph, "name": name, "cat": cat, "id": ident, "ts": ts, "pid": pid,
                            "tid": tid(cat, cat), "args": args})
            else:
                out.append({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": ts, "pid": pid,
                            "tid": tid(ident, "compute thread"), "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str, events: list[tuple], rank: int = 0) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(events, rank), f)
        os.replace(tmp, path)


TIMELINE = Timeline()
