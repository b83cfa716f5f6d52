"""Where a traced step waited, and whether the disk was busy then: reads a timeline written by
`trace` ([Note: the timeline] in infinity/device/timeline.py; bench_streaming.py --trace-dir
writes one per case) and prints, per kind of wait on the compute thread, its total and how much
of it passed with no NVMe transfer in flight, beside how long the disk was busy reading, writing
and either.

    python bench/timeline_waits.py TRACE.json [--top 8] [--phases]

--phases: each forward and backward of the trace, one line each: its length; the compute
thread's time in optimizer updates, in waits and in the other traced work (the rest is the
model's own compute); how long the disk was busy; and the GB each transfer track started then.
"""

from __future__ import annotations

import argparse
import json


def _union(spans: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(union: list[list[float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


def _pairs(events: list[dict]) -> list[tuple[str, float, float, int]]:
    """(track, start, end, bytes) of every transfer: the async begin / end pairs on the
    `<tier> reads|writes` tracks."""
    out = []
    started: dict[tuple, dict] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        track = e.get("cat", "")
        if track.rsplit(" ", 1)[-1] not in ("reads", "writes"):
            continue
        key = (track, e["name"], e.get("id"))
        if e["ph"] == "b":
            started[key] = e
        elif e["ph"] == "e" and key in started:
            begin = started.pop(key)
            out.append((track, begin["ts"], e["ts"], begin.get("args", {}).get("bytes", 0)))
    return out


def transfers(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The timeline's transfer spans, by direction."""
    spans: dict[str, list[tuple[float, float]]] = {"reads": [], "writes": []}
    for track, a, b, _ in _pairs(events):
        spans[track.rsplit(" ", 1)[-1]].append((a, b))
    return spans


def phases(events: list[dict], either: list[list[float]]) -> None:
    """[--phases]: where each forward's and backward's time went, and what the disk moved then."""
    moved = _pairs(events)
    spans = [e for e in events if e.get("ph") == "X"]
    for p in sorted((e for e in spans if e.get("cat") == "phase" and e["name"] != "step"), key=lambda e: e["ts"]):
        a, b = p["ts"], p["ts"] + p["dur"]
        inside = [e for e in spans if a <= e["ts"] < b and e.get("cat") in ("compute", "wait")]
        update = sum(e["dur"] for e in inside if e["name"] == "update") / 1e6
        waits = sum(e["dur"] for e in inside if e["cat"] == "wait") / 1e6
        other = sum(e["dur"] for e in inside if e["cat"] == "compute" and e["name"] != "update") / 1e6
        gb: dict[str, float] = {}
        for track, ts, _, n in moved:
            if a <= ts < b:
                gb[track] = gb.get(track, 0.0) + n / 1e9
        tracks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(gb.items()))
        print(f"{p['name']:8s} {p['dur'] / 1e6:7.2f} s: updates {update:.2f}, waits {waits:.2f}, other traced "
              f"{other:.2f}, the rest {p['dur'] / 1e6 - update - waits - other:.2f}; disk busy "
              f"{_overlap(either, a, b) / 1e6:.2f} s; GB {tracks}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=8, help="the longest waits to list")
    ap.add_argument("--phases", action="store_true", help="each forward and backward, one line each")
    args = ap.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") != "M"]
    start = min(e["ts"] for e in events)
    spans = transfers(events)
    reads, writes = _union(spans["reads"]), _union(spans["writes"])
    either = _union(spans["reads"] + spans["writes"])
    busy = {name: sum(b - a for a, b in u) / 1e6 for name, u in (("reads", reads), ("writes", writes),
                                                                   ("either", either))}
    print(f"disk busy: reading {busy['reads']:.3f} s, writing {busy['writes']:.3f} s, either {busy['either']:.3f} s "
          f"({len(spans['reads'])} reads, {len(spans['writes'])} writes)")
    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "wait"]
    for name in sorted({e["name"] for e in waits}):
        mine = [e for e in waits if e["name"] == name]
        total = sum(e["dur"] for e in mine)
        idle = sum(e["dur"] - _overlap(either, e["ts"], e["ts"] + e["dur"]) for e in mine)
        print(f"{name}: {len(mine)} waits, {total / 1e6:.3f} s; the disk idle during {idle / 1e6:.3f} s of them")
    for e in sorted(waits, key=lambda e: -e["dur"])[:args.top]:
        in_flight = sum(1 for a, b in spans["reads"] if a <= e["ts"] < b)
        print(f"  {e['name']} at {(e['ts'] - start) / 1e6:.3f} s: {e['dur'] / 1e3:.1f} ms, {in_flight} reads in "
              f"flight, {e.get('args', {})}")
    if args.phases:
        phases(events, either)


if __name__ == "__main__":
    main()
