"""`HostCache`: which idle shards stay in host memory, within a byte budget (`max_in_cpu`).

[Note: eviction policy]
The engine uses shards in an order that repeats every step (forward over the units, backward in
reverse, optimizer state per unit) and records it in the first step. With the future known,
Belady's MIN is optimal: when room is needed, drop the shard whose next use is furthest away,
and do not keep a shard at all when everything it would displace is needed sooner. Plain LRU
happens to suit a forward pass followed by a reversed backward, but it fails on every cyclic
pattern the engine also has (the optimizer's sweep over units in the same order each step,
inference, gradient accumulation): there it always drops exactly the shard needed next, and it
cannot decline to keep a shard that is needed later than what it would displace.

The schedule is a cyclic list of keys (one step; the next step repeats it) and a cursor, moved
by `advance(key)` as each use happens; the distance to a key's next use is counted in uses from
the cursor, wrapping into the next step. A key that is not in the schedule is never used again
as far as the cache knows (distance infinite). Before a schedule is set (the first step, while
the engine records it) every distance is infinite, and ties go against the entry kept longest,
so the cache then behaves as FIFO.

Only the bookkeeping lives here: which keys are resident and how many bytes they take. The
memory and the transfers belong to the swapper, which asks `admit` before it keeps a shard and
drops whatever `admit` names.

[Note: cache memory]
A cached shard stays in the pool buffer it was read into: no copy, no second allocation of
pinned memory, and a transfer that finds no free buffer takes the buffer of a cached shard at
once. So the cache holds at most as many shards as the pool has idle buffers, whatever
`max_in_cpu` says; to give the cache its whole budget on top of the buffers transfers need,
plan the pool with `max_in_cpu // buffer_size` more buffers.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Hashable, Iterable
from numbers import Integral

from infinity.offload._messages import config_key


class HostCache:
    """Resident idle shards, at most `max_bytes` of them, evicted by next use ([Note: eviction policy]).

    Args:
        max_bytes: the budget in bytes (config: `zero_optimization.<name>.max_in_cpu`, which the
            engine converts from elements); 0 keeps nothing.
        name: the config section, for messages.

    Thread-safe: one lock guards it, so any thread may advance the schedule, admit and evict.
    """

    _entries: dict[Hashable, tuple[int, int]]  # key -> (nbytes, insertion number, for ties)
    _schedule: list[Hashable]  # one step's uses, in order
    _positions: dict[Hashable, list[int]]  # key -> its sorted indices in _schedule
    _cursor: int  # index in _schedule of the next use expected

    def __init__(self, max_bytes: int, *, name: str = "offload_param") -> None:
        key = config_key(name, "max_in_cpu")
        if isinstance(max_bytes, float) and max_bytes.is_integer():
            max_bytes = int(max_bytes)  # DeepSpeed configs write sizes as 1e9
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, Integral):
            raise TypeError(f"{key}: expected an int, got {max_bytes!r}")
        if max_bytes < 0:
            raise ValueError(f"{key}: expected a non-negative size, got {max_bytes}")
        self._max_bytes = int(max_bytes)
        self._used = 0
        self._peak = 0
        self._entries = {}
        self._counter = itertools.count()
        self._schedule = []
        self._positions = {}
        self._cursor = 0
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def bytes_used(self) -> int:
        return self._used

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    # ---- the schedule ------------------------------------------------------------------------

    def set_schedule(self, keys: Iterable[Hashable]) -> None:
        """The order of use for one step (it repeats); the cursor goes to its start."""
        schedule = list(keys)
        positions: dict[Hashable, list[int]] = {}
        for index, key in enumerate(schedule):
            positions.setdefault(key, []).append(index)
        with self._lock:
            self._schedule, self._positions, self._cursor = schedule, positions, 0

    def advance(self, key: Hashable) -> None:
        """Records that `key` is being used now: the cursor moves past its next scheduled use.

        A key outside the schedule leaves the cursor where it is.
        """
        with self._lock:
            position = self._next_position(key)
            if position is not None:
                self._cursor = (position + 1) % len(self._schedule)

    def next_use(self, key: Hashable) -> float:
        """Uses from now until `key` is used next; infinite when it is not scheduled."""
        with self._lock:
            return self._distance(key)

    def _next_position(self, key: Hashable) -> int | None:
        positions = self._positions.get(key)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self._cursor)
        return positions[i] if i < len(positions) else positions[0]

    def _distance(self, key: Hashable) -> float:
        position = self._next_position(key)
        if position is None:
            return math.inf
        return (position - self._cursor) % len(self._schedule)

    # ---- residency ---------------------------------------------------------------------------

    def admit(self, key: Hashable, nbytes: int) -> list[Hashable] | None:
        """Keeps `key` if MIN would; returns the keys to drop to make room (already removed here),
        or None when `key` is not kept (then nothing was removed)."""
        with self._lock:
            assert key not in self._entries, f"{key!r} is already cached"
            if nbytes > self._max_bytes:
                return None
            distance = self._distance(key)
            victims: list[Hashable] = []
            free = self._max_bytes - self._used
            for other in self._by_eviction_order():
                if free >= nbytes:
                    break
                if self._distance(other) < distance:
                    return None  # everything left is needed sooner than `key`
                victims.append(other)
                free += self._entries[other][0]
            assert free >= nbytes, "nbytes <= max_bytes, so dropping everything makes room"
            for other in victims:
                self._drop(other)
            self._entries[key] = (nbytes, next(self._counter))
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            return victims

    def remove(self, key: Hashable) -> bool:
        """Forgets `key` (used again, or dropped by the owner); whether it was cached."""
        with self._lock:
            if key not in self._entries:
                return False
            self._drop(key)
            return True

    def pop_victim(self) -> Hashable | None:
        """Removes and returns the entry MIN would drop first (for memory pressure elsewhere)."""
        with self._lock:
            for key in self._by_eviction_order():
                self._drop(key)
                return key
            return None

    def _by_eviction_order(self) -> list[Hashable]:
        """Resident keys, furthest next use first; among equals, the one kept longest first."""
        return sorted(self._entries, key=lambda k: (-self._distance(k), self._entries[k][1]))

    def _drop(self, key: Hashable) -> None:
        nbytes, _ = self._entries.pop(key)
        self._used -= nbytes
