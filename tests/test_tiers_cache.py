"""HostCache: MIN (Belady) eviction over the recorded order of use, within the byte budget."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.offload.cache import HostCache


def forward_backward(n: int) -> list[int]:
    return list(range(n)) + list(reversed(range(n)))


def run(cache: HostCache, trace: list[int], nbytes: int = 1) -> int:
    """Plays `trace` like the swapper does (use, then release into the cache); returns hits."""
    hits = 0
    for key in trace:
        cache.advance(key)
        if cache.remove(key):
            hits += 1
        cache.admit(key, nbytes)
        assert cache.bytes_used <= cache.max_bytes
    return hits


def lru_hits(capacity: int, trace: list[int]) -> int:
    resident: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in trace:
        if key in resident:
            hits += 1
            resident.move_to_end(key)
            continue
        resident[key] = None
        if len(resident) > capacity:
            resident.popitem(last=False)
    return hits


def test_forward_keeps_what_backward_needs_first():
    cache = HostCache(3)
    cache.set_schedule(forward_backward(6))
    for key in range(6):
        cache.advance(key)
        cache.admit(key, 1)
    assert sorted(cache.keys()) == [3, 4, 5]  # the tail of forward, the head of backward


def test_a_shard_needed_later_than_everything_resident_is_not_kept():
    cache = HostCache(2)
    cache.set_schedule([0, 1, 2, 1, 0, 2])
    for key in (0, 1):
        cache.advance(key)
        assert cache.admit(key, 1) == []
    cache.advance(2)
    assert cache.admit(2, 1) is None  # 2 is needed last; 0 and 1 sooner
    assert sorted(cache.keys()) == [0, 1]


def test_eviction_drops_the_furthest_next_use_first():
    cache = HostCache(2)
    cache.set_schedule([0, 1, 2, 2, 0, 1])
    for key in (0, 1):
        cache.advance(key)
        cache.admit(key, 1)
    cache.advance(2)
    assert cache.admit(2, 1) == [1]  # next come 2, 0, then 1: 1 goes
    assert (cache.next_use(2), cache.next_use(0), cache.next_use(1)) == (0, 1, 2)


def test_the_schedule_wraps_into_the_next_step():
    cache = HostCache(10)
    cache.set_schedule([5, 6, 7])
    cache.advance(5)
    cache.advance(6)
    cache.advance(7)
    assert cache.next_use(5) == 0 and cache.next_use(7) == 2
    assert cache.next_use("unknown") == math.inf
    cache.advance("unknown")  # outside the schedule: the cursor stays
    assert cache.next_use(5) == 0


def test_without_a_schedule_the_oldest_goes_first():
    cache = HostCache(2)
    for key in (0, 1):
        cache.admit(key, 1)
    assert cache.admit(2, 1) == [0]
    assert cache.pop_victim() == 1


def test_budget_in_bytes():
    cache = HostCache(100)
    assert cache.admit("big", 101) is None
    assert cache.admit("a", 60) == []
    assert cache.admit("b", 60) == ["a"]
    assert cache.bytes_used == 60 and cache.peak_bytes == 60
    assert HostCache(0).admit("x", 1) is None


def test_memory_pressure_takes_victims_in_min_order():
    cache = HostCache(10)
    cache.set_schedule([0, 1, 2, 3])
    for key in (3, 1, 2):
        cache.admit(key, 1)
    assert [cache.pop_victim() for _ in range(4)] == [3, 2, 1, None]


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), ("1", TypeError), (True, TypeError)])
def test_config_errors_name_max_in_cpu(value, error):
    with pytest.raises(error, match=r"zero_optimization\.offload_param\.max_in_cpu"):
        HostCache(value)


def test_sizes_written_as_floats_are_accepted():
    assert HostCache(1e3).max_bytes == 1000


def test_min_beats_lru_on_a_cyclic_sweep():
    # The optimizer sweeps its units in the same order every step: LRU always drops the next one.
    trace = list(range(8)) * 4
    cache = HostCache(4)
    cache.set_schedule(range(8))
    assert lru_hits(4, trace) == 0
    assert run(cache, trace) >= 3 * 3  # from the second sweep on, at least 3 of 8 hit


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    trace=st.lists(st.integers(0, 7), min_size=1, max_size=60),
    capacity=st.integers(1, 6),
)
def test_min_never_loses_to_lru(trace, capacity):
    # With equal sizes and the future known, MIN (with bypass) is optimal: never fewer hits.
    cache = HostCache(capacity)
    cache.set_schedule(trace)
    assert run(cache, trace) >= lru_hits(capacity, trace)
