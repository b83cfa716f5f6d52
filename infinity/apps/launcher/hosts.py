"""Which hosts and slots a launch uses: DeepSpeed's hostfile, `--include` / `--exclude`,
`--num_nodes` and `--num_gpus`, as pure functions of text (no processes, no devices).

[Note: resources]
A launch's resources are an ordered mapping host -> slot ids (GPU indices on that host, or CPU
ranks on a host without GPUs), in hostfile order: node rank i is the i-th host, and its ranks
are numbered after those of the hosts before it.

The hostfile is DeepSpeed's (MPI style): one `HOST slots=N` line per host, `#` starting a
comment line, blank lines ignored. `--include` / `--exclude` take `NODE_SPEC[@NODE_SPEC...]`,
`NODE_SPEC = HOST[:SLOT[,SLOT...]]`: a host without slots means all its slots. `--include` keeps
only what it names; `--exclude` drops what it names, and a host left with no slot is dropped.
They cannot be combined with each other nor with `--num_nodes` / `--num_gpus` (DeepSpeed's
rule). `--num_nodes N` keeps the first N hosts, `--num_gpus N` the first N slots of each.

Deliberate differences from DeepSpeed's runner: a slot or node count the hostfile does not have
(`--include host:7` on a `slots=2` host, `--num_gpus 4` on it, `--num_nodes 3` with two hosts)
is an error here, where DeepSpeed launches onto devices that do not exist; `slots=0` is an error.
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["limit", "parse_hostfile", "parse_node_specs", "select"]

_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)(\s.*)?$")


def parse_hostfile(text: str, path: str) -> OrderedDict[str, int]:
    """Host -> slot count, in file order. Errors name `--hostfile`, the file and the line."""
    hosts: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--hostfile {path}: line {number}"
        match = _HOST_LINE.match(line)
        if match is None:
            raise ValueError(f"{where}: expected 'HOST slots=N', got {line!r}")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise ValueError(f"{where}: host {host!r} is listed twice")
        if slots < 1:
            raise ValueError(f"{where}: host {host!r} has slots={slots}, expected at least 1")
        hosts[host] = slots
    if not hosts:
        raise ValueError(f"--hostfile {path}: names no host (expected 'HOST slots=N' lines)")
    return hosts


def parse_node_specs(text: str, flag: str) -> OrderedDict[str, list[int]]:
    """`HOST[:SLOT[,SLOT...]]@...` -> host -> sorted slots ([] for the whole host). A host
    named twice gets the union of its slots (a whole-host spec adds none)."""
    specs: OrderedDict[str, set[int]] = OrderedDict()
    for spec in text.split("@"):
        host, colon, slots = spec.partition(":")
        if not host:
            raise ValueError(f"{flag} {text}: empty host name in {spec!r} (expected HOST[:SLOT,...]@...)")
        ids = specs.setdefault(host, set())
        if not colon:
            continue
        for slot in slots.split(","):
            if not slot.strip().isdigit():
                raise ValueError(f"{flag} {text}: slot {slot!r} of host {host!r} is not a number "
                                 "(expected HOST:0,1)")
            ids.add(int(slot))
    return OrderedDict((host, sorted(ids)) for host, ids in specs.items())


def _check_named(pool: OrderedDict[str, list[int]], named: OrderedDict[str, list[int]], flag: str) -> None:
    for host, slots in named.items():
        if host not in pool:
            raise ValueError(f"{flag}: host {host!r} is not among the hosts ({', '.join(pool)})")
        unknown = [s for s in slots if s not in pool[host]]
        if unknown:
            raise ValueError(f"{flag}: host {host!r} has no slot {unknown[0]} (its slots: "
                             f"{', '.join(map(str, pool[host]))})")


def select(pool: OrderedDict[str, list[int]], include: str = "", exclude: str = "") -> OrderedDict[str, list[int]]:
    """The resources `--include` / `--exclude` leave of `pool` ([Note: resources])."""
    if include and exclude:
        raise ValueError("--include and --exclude: give one of them, not both")
    if not include and not exclude:
        return OrderedDict((host, list(slots)) for host, slots in pool.items())
    flag = "--include" if include else "--exclude"
    named = parse_node_specs(include or exclude, flag)
    _check_named(pool, named, flag)
    chosen: OrderedDict[str, list[int]] = OrderedDict()
    for host, slots in pool.items():
        if include:
            kept = (named[host] or list(slots)) if host in named else []
        else:
            dropped = set(named[host] or slots) if host in named else set()
            kept = [s for s in slots if s not in dropped]
        if kept:
            chosen[host] = kept
    if not chosen:
        raise ValueError(f"{flag} {include or exclude}: leaves no slot to run on")
    return chosen


def limit(resources: OrderedDict[str, list[int]], num_nodes: int | None,
          num_gpus: int | None) -> OrderedDict[str, list[int]]:
    """The first `num_nodes` hosts and the first `num_gpus` slots of each (None: all)."""
    hosts = list(resources.items())
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise ValueError(f"--num_nodes {num_nodes}: only {len(hosts)} host(s) to run on "
                             f"({', '.join(resources)})")
        hosts = hosts[:num_nodes]
    if num_gpus is not None:
        for host, slots in hosts:
            if num_gpus > len(slots):
                raise ValueError(f"--num_gpus {num_gpus}: host {host!r} has {len(slots)} slot(s)")
        hosts = [(host, slots[:num_gpus]) for host, slots in hosts]
    return OrderedDict(hosts)
