"""DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest: numbers,
counting, state, building.

Expected learning rates (and OneCycle's beta1) are worked out by hand from DeepSpeed's formulas
(see the comments); iteration i is the value of last_batch_iteration after i + 1 calls to step().
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from gpt import TinyGPT, batches, config
from hypothesis import given, settings
from hypothesis import strategies as st

import infinity
from infinity.config import load_config
from infinity.optim.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

LOG10_2 = 0.30102999566398120   # ln 2 / ln 10: log warmup over 10 steps at iteration 1
LOG10_5 = 0.69897000433601886   # ln 5 / ln 10: ... at iteration 4
COS_PI_8 = 0.92387953251128674  # cos(pi / 8)
COS_3PI_8 = 0.38268343236508978  # cos(3 pi / 8) = -cos(5 pi / 8)


def make_optimizer(lr: float = 1.0, num_groups: int = 1) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(num_groups)]
    return torch.optim.SGD(groups, lr=lr)


def lrs_by_iteration(schedule, last: int) -> dict[int, float]:
    """Step from iteration 0 to `last`; the first group's lr at each."""
    seen = {}
    for _ in range(last + 1):
        schedule.step()
        seen[schedule.last_batch_iteration] = schedule.optimizer.param_groups[0]["lr"]
        assert schedule.get_last_lr()[0] == seen[schedule.last_batch_iteration]
    return seen


def assert_lrs(seen: dict[int, float], expected: dict[int, float]) -> None:
    for iteration, lr in expected.items():
        assert seen[iteration] == pytest.approx(lr, rel=1e-12, abs=1e-15), iteration


# --- WarmupLR

def test_warmup_lr_log() -> None:
    # lr = min + (max - min) * ln(i + 1) / ln(10) during warmup, then max.
    optimizer = make_optimizer()
    schedule = WarmupLR(optimizer, warmup_min_lr=0.001, warmup_max_lr=0.011, warmup_num_steps=10)
    assert optimizer.param_groups[0]["lr"] == 0.001  # iteration -1: warmup_min_lr
    assert schedule.last_batch_iteration == -1
    seen = lrs_by_iteration(schedule, 30)
    assert_lrs(seen, {0: 0.001, 1: 0.001 + 0.01 * LOG10_2, 4: 0.001 + 0.01 * LOG10_5,
                      9: 0.011, 10: 0.011, 30: 0.011})


def test_warmup_lr_linear() -> None:
    # lr = min + (max - min) * i / 4 during warmup.
    schedule = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0,
                        warmup_num_steps=4, warmup_type="linear")
    seen = lrs_by_iteration(schedule, 6)
    assert_lrs(seen, {0: 0.0, 1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0, 6: 1.0})


def test_warmup_lr_max_defaults_to_the_optimizers_lr() -> None:
    optimizer = make_optimizer(lr=0.05)
    schedule = WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert_lrs(lrs_by_iteration(schedule, 4), {2: 0.025, 4: 0.05})


def test_warmup_num_steps_below_two_behaves_as_two() -> None:
    # DeepSpeed uses max(2, warmup_num_steps): ln(1)/ln(2) = 0, ln(2)/ln(2) = 1.
    schedule = WarmupLR(make_optimizer(), warmup_max_lr=0.1, warmup_num_steps=1)
    assert schedule.warmup_num_steps == 2
    assert_lrs(lrs_by_iteration(schedule, 3), {0: 0.0, 1: 0.1, 2: 0.1, 3: 0.1})


def test_per_group_learning_rates() -> None:
    optimizer = make_optimizer(num_groups=2)
    schedule = WarmupLR(optimizer, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 2.0],
                        warmup_num_steps=4, warmup_type="linear")
    assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.1]
    schedule.step(2)
    assert schedule.get_last_lr() == pytest.approx([0.5, 0.1 + 1.9 * 0.5])
    assert [group["lr"] for group in optimizer.param_groups] == schedule.get_last_lr()
    with pytest.raises(ValueError, match=r"warmup_min_lr: expected 2 values .* got 3"):
        WarmupLR(optimizer, warmup_min_lr=[0.0, 0.1, 0.2])


# --- WarmupDecayLR

def test_warmup_decay_lr() -> None:
    # Warmup i / 4, then gamma = max(0, (10 - i) / (10 - 4)).
    schedule = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_min_lr=0.0,
                             warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    seen = lrs_by_iteration(schedule, 12)
    assert_lrs(seen, {0: 0.0, 1: 0.025, 3: 0.075, 4: 0.1, 5: 0.1 * 5 / 6, 7: 0.05, 9: 0.1 / 6,
                      10: 0.0, 12: 0.0})


def test_warmup_decay_lr_decays_to_warmup_min_lr() -> None:
    schedule = WarmupDecayLR(make_optimizer(), 10, warmup_min_lr=0.01, warmup_max_lr=0.1,
                             warmup_num_steps=4, warmup_type="linear")
    assert_lrs(lrs_by_iteration(schedule, 15), {0: 0.01, 7: 0.01 + 0.09 * 0.5, 10: 0.01,
                                                15: 0.01})


def test_warmup_decay_lr_log_warmup_and_defaults() -> None:
    schedule = WarmupDecayLR(make_optimizer(), total_num_steps=20, warmup_num_steps=10)
    assert schedule.max_lrs == [0.001]  # WarmupDecayLR's own default
    assert_lrs(lrs_by_iteration(schedule, 15), {1: 0.001 * LOG10_2, 10: 0.001, 15: 0.0005})


def test_warmup_decay_lr_total_below_warmup() -> None:
    # total 2 < warmup 4: after warmup gamma = max(0, (2 - i) / max(1, -2)) = 0.
    schedule = WarmupDecayLR(make_optimizer(), 2, warmup_min_lr=0.0, warmup_max_lr=1.0,
                             warmup_num_steps=4, warmup_type="linear")
    assert_lrs(lrs_by_iteration(schedule, 5), {3: 0.75, 4: 0.0, 5: 0.0})


# --- WarmupCosineLR

def test_warmup_cosine_lr() -> None:
    # Warmup ratio 0.1 + 0.9 * i / 4; then with p = min(1, (i - 4 + 1) / (12 - 4)):
    # ratio = 0.1 + 0.9 * (1 + cos(pi p)) / 2.
    optimizer = make_optimizer(lr=2.0)
    schedule = WarmupCosineLR(optimizer, total_num_steps=12, warmup_min_ratio=0.1,
                              warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear")
    assert optimizer.param_groups[0]["lr"] == 0.0  # iteration -1: ratio 0
    seen = lrs_by_iteration(schedule, 40)
    assert_lrs(seen, {
        0: 2.0 * 0.1, 1: 2.0 * 0.325, 2: 2.0 * 0.55, 3: 2.0 * 0.775,
        4: 2.0 * (0.1 + 0.9 * (1 + COS_PI_8) / 2),      # p = 1/8
        6: 2.0 * (0.1 + 0.9 * (1 + COS_3PI_8) / 2),     # p = 3/8
        8: 2.0 * (0.1 + 0.9 * (1 - COS_3PI_8) / 2),     # p = 5/8
        11: 2.0 * 0.1, 12: 2.0 * 0.1, 40: 2.0 * 0.1,    # p clamped to 1
    })


def test_warmup_cosine_lr_log_warmup_and_defaults() -> None:
    schedule = WarmupCosineLR(make_optimizer(lr=0.5), total_num_steps=100, warmup_num_steps=10)
    assert (schedule.warmup_min_ratio, schedule.cos_min_ratio) == (0.0, 0.0001)
    seen = lrs_by_iteration(schedule, 200)
    assert_lrs(seen, {0: 0.0, 1: 0.5 * LOG10_2, 4: 0.5 * LOG10_5,
                      100: 0.5 * 0.0001, 200: 0.5 * 0.0001})
    assert schedule.get_lr_ratio() == pytest.approx(0.0001)


def test_warmup_cosine_lr_scales_each_groups_lr() -> None:
    optimizer = make_optimizer(num_groups=2)
    optimizer.param_groups[1]["lr"] = 3.0
    schedule = WarmupCosineLR(optimizer, 12, warmup_num_steps=4, warmup_type="linear")
    assert schedule.org_lrs == [1.0, 3.0]
    schedule.step(2)
    assert schedule.get_last_lr() == pytest.approx([0.5, 1.5])


# --- OneCycle

def make_adam(lr: float = 1.0, num_groups: int = 1) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(num_groups)]
    return torch.optim.AdamW(groups, lr=lr)  # betas (0.9, 0.999)


def lrs_and_beta1s(schedule, last: int) -> dict[int, tuple[float, float]]:
    """Step from iteration 0 to `last`; the first group's (lr, beta1) at each. beta2 is always
    DeepSpeed's 0.99."""
    seen = {}
    for _ in range(last + 1):
        schedule.step()
        group = schedule.optimizer.param_groups[0]
        assert group["betas"][1] == 0.99
        seen[schedule.last_batch_iteration] = (group["lr"], group["betas"][0])
    return seen


def assert_lrs_and_beta1s(seen: dict, expected: dict[int, tuple[float, float]]) -> None:
    for iteration, (lr, beta1) in expected.items():
        assert seen[iteration][0] == pytest.approx(lr, rel=1e-12, abs=1e-15), iteration
        assert seen[iteration][1] == pytest.approx(beta1, rel=1e-12, abs=1e-15), iteration


def test_one_cycle_lr_and_momentum() -> None:
    # n = i + 1 steps done in a cycle of 4 up + 2 down: height n / 4 while n <= 4, then
    # (6 - n) / 2; lr = 0.1 + 0.9 * height, beta1 = 0.9 - 0.1 * height. From i = 6 on
    # (no decay configured): lr 0.1, beta1 0.9.
    optimizer = make_adam()
    schedule = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4,
                        cycle_second_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9)
    # Iteration -1: cycle_min_lr, and DeepSpeed's starting betas (cycle_min_mom, 0.99).
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    assert schedule.get_last_lr() == [0.1]
    seen = lrs_and_beta1s(schedule, 20)
    assert_lrs_and_beta1s(seen, {
        0: (0.325, 0.875), 1: (0.55, 0.85), 2: (0.775, 0.825), 3: (1.0, 0.8),  # up
        4: (0.55, 0.85), 5: (0.1, 0.9),                                         # down
        6: (0.1, 0.9), 20: (0.1, 0.9),                                          # after
    })
    assert seen[3][0] == 1.0  # the peak is exactly cycle_max_lr


def test_one_cycle_decay_after_the_cycle() -> None:
    # Cycle 2 up + 2 down; then with d = i - 3: lr = 0.2 / (1 + 0.5 * d / 2) and
    # beta1 = 0.9 * (1 + 0.1 * d / 2) (DeepSpeed's momentum "decay" raises beta1).
    schedule = OneCycle(make_adam(), 0.2, 1.0, decay_lr_rate=0.5, cycle_first_step_size=2,
                        decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9,
                        decay_mom_rate=0.1)
    assert schedule.second_step_size == 2  # defaults to cycle_first_step_size
    seen = lrs_and_beta1s(schedule, 5)
    assert_lrs_and_beta1s(seen, {
        0: (0.6, 0.85), 1: (1.0, 0.8), 2: (0.6, 0.85), 3: (0.2, 0.9),
        4: (0.2 / 1.25, 0.9 * 1.05), 5: (0.2 / 1.5, 0.9 * 1.1),
    })


@pytest.mark.parametrize(("decay_step_size", "decay_lr_rate", "decay_mom_rate"), [
    (0, 0.5, 0.1),  # decay_step_size 0 turns both decays off
    (2, 0.0, 0.0),  # so does a rate of 0, for its own decay only
])
def test_one_cycle_without_decay_rests_at_the_cycles_end(decay_step_size, decay_lr_rate,
                                                         decay_mom_rate) -> None:
    schedule = OneCycle(make_adam(), 0.2, 1.0, decay_lr_rate=decay_lr_rate,
                        cycle_first_step_size=2, decay_step_size=decay_step_size,
                        decay_mom_rate=decay_mom_rate)
    assert_lrs_and_beta1s(lrs_and_beta1s(schedule, 30), {4: (0.2, 0.9), 30: (0.2, 0.9)})


def test_one_cycle_stairs() -> None:
    # Up 6 steps in 3 stairs: height floor(n * 3 / 6) / 3; down 4 steps in 2 stairs:
    # floor((10 - n) * 2 / 4) / 2. lr = 0.6 * height.
    schedule = OneCycle(make_adam(), 0.0, 0.6, cycle_first_step_size=6, cycle_second_step_size=4,
                        cycle_first_stair_count=3, cycle_second_stair_count=2)
    seen = lrs_and_beta1s(schedule, 11)
    expected = {0: 0.0, 1: 0.2, 2: 0.2, 3: 0.4, 4: 0.4, 5: 0.6, 6: 0.3, 7: 0.3, 8: 0.0, 9: 0.0,
                11: 0.0}
    assert_lrs({i: lr for i, (lr, _) in seen.items()}, expected)
    assert seen[5][1] == pytest.approx(0.8) and seen[6][1] == pytest.approx(0.85)


def test_one_cycle_second_stair_count_defaults_to_the_first() -> None:
    # 4 up + 4 down in 2 stairs each: height floor(n / 2) / 2, then floor((8 - n) / 2) / 2.
    schedule = OneCycle(make_adam(), 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    assert schedule.second_stair_count == 2
    seen = lrs_and_beta1s(schedule, 7)
    assert_lrs({i: lr for i, (lr, _) in seen.items()},
               {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 0.5, 5: 0.5, 6: 0.0, 7: 0.0})


@pytest.mark.parametrize("first_step_size", [100, 3])
def test_one_cycle_step_ratio_is_the_rising_share_of_the_cycle(first_step_size) -> None:
    # DeepSpeed's attribute: the rise over the whole cycle; a cycle without a fall is all rise.
    assert OneCycle(make_adam(), 0.1, 1.0, cycle_first_step_size=first_step_size,
                    cycle_second_step_size=0).step_ratio == 1.0
    assert OneCycle(make_adam(), 0.1, 1.0, cycle_first_step_size=first_step_size,
                    cycle_second_step_size=first_step_size * 3).step_ratio == 0.25


def test_one_cycle_takes_step_sizes_as_floats() -> None:
    # DeepSpeed converts the step sizes with float() (a JSON 4e0, an argparse float): the same
    # cycle as the integers.
    as_ints = OneCycle(make_adam(), 0.1, 1.0, cycle_first_step_size=4, cycle_second_step_size=2,
                       decay_lr_rate=0.5, decay_step_size=2)
    as_floats = OneCycle(make_adam(), 0.1, 1.0, cycle_first_step_size=4.0,
                         cycle_second_step_size=2.0, decay_lr_rate=0.5, decay_step_size=2.0)
    assert_lrs_and_beta1s(lrs_and_beta1s(as_floats, 12), lrs_and_beta1s(as_ints, 12))


@pytest.mark.parametrize("stairs", [-1, 0])
def test_one_cycle_stair_count_at_or_below_zero_is_continuous(stairs) -> None:
    # DeepSpeed cuts stairs only for a count > 0; its command-line default is -1.
    plain = OneCycle(make_adam(), 0.0, 0.6, cycle_first_step_size=6, cycle_second_step_size=4)
    schedule = OneCycle(make_adam(), 0.0, 0.6, cycle_first_step_size=6, cycle_second_step_size=4,
                        cycle_first_stair_count=stairs, cycle_second_stair_count=stairs)
    assert lrs_and_beta1s(schedule, 11) == lrs_and_beta1s(plain, 11)


def test_one_cycle_per_group_values() -> None:
    optimizer = make_adam(num_groups=2)
    schedule = OneCycle(optimizer, cycle_min_lr=[0.1, 0.2], cycle_max_lr=[1.0, 0.4],
                        cycle_first_step_size=2, cycle_min_mom=[0.8, 0.85],
                        cycle_max_mom=[0.9, 0.95])
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.2]
    assert [g["betas"] for g in optimizer.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    schedule.step()  # iteration 0: height 1 / 2
    assert schedule.get_last_lr() == pytest.approx([0.55, 0.3])
    assert [g["lr"] for g in optimizer.param_groups] == schedule.get_last_lr()
    betas = [g["betas"] for g in optimizer.param_groups]
    assert [b[0] for b in betas] == pytest.approx([0.85, 0.9])
    assert [b[1] for b in betas] == [0.99, 0.99]
    assert schedule.get_mom() == betas
    with pytest.raises(ValueError, match=r"cycle_max_mom: expected 2 values .* got 1"):
        OneCycle(optimizer, 0.1, 1.0, cycle_max_mom=[0.9])


def test_one_cycle_without_cycle_momentum_leaves_the_betas() -> None:
    optimizer = make_adam()
    schedule = OneCycle(optimizer, 0.1, 1.0, cycle_first_step_size=2, cycle_momentum=False)
    schedule.step()
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert schedule.get_mom() is None and schedule.get_last_lr() == [pytest.approx(0.55)]


def test_one_cycle_turns_momentum_off_for_an_optimizer_without_betas(caplog) -> None:
    # Logged, as DeepSpeed does, not a Python warning (which DeepSpeed's own tests, and code
    # run under -W error, would turn into an exception).
    optimizer = make_optimizer()  # SGD
    with caplog.at_level("WARNING", logger="infinity"):
        schedule = OneCycle(optimizer, 0.1, 1.0, cycle_first_step_size=2)
    assert "cycle_momentum: turned off" in caplog.text
    schedule.step()
    assert "betas" not in optimizer.param_groups[0] and schedule.get_mom() is None
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.55)


def test_one_cycle_state_dict_resumes_lr_and_betas() -> None:
    def build(optimizer, **kwargs):
        return OneCycle(optimizer, 0.1, 1.0, decay_lr_rate=0.5, cycle_first_step_size=3,
                        cycle_second_step_size=2, decay_step_size=1, decay_mom_rate=0.05,
                        **kwargs)

    reference = build(make_adam())
    for _ in range(4):
        reference.step()
    state = reference.state_dict()
    assert state == {"last_batch_iteration": 3}

    optimizer = make_adam()
    resumed = build(optimizer, last_batch_iteration=3)  # DeepSpeed's way to resume ...
    assert optimizer.param_groups[0]["lr"] == 1.0  # ... leaves the optimizer until step()
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(RuntimeError, match="call step"):
        resumed.get_last_lr()
    other = build(make_adam())
    other.load_state_dict(state)  # ... and so does load_state_dict
    for _ in range(4):  # through the cycle's end into the decay
        reference.step()
        resumed.step()
        other.step()
        for schedule in (resumed, other):
            assert schedule.get_last_lr() == reference.get_last_lr()
            assert schedule.optimizer.param_groups[0]["betas"] == \
                reference.optimizer.param_groups[0]["betas"]
    assert reference.last_batch_iteration == 7  # d = 3: lr 0.1 / (1 + 0.5 * 3)
    assert reference.get_last_lr() == [pytest.approx(0.1 / 2.5)]


def test_one_cycle_step_takes_deepspeeds_batch_iteration() -> None:
    schedule = OneCycle(make_adam(), 0.0, 1.0, cycle_first_step_size=4)
    schedule.step(batch_iteration=2)  # height 3 / 4
    assert schedule.last_batch_iteration == 2 and schedule.get_last_lr() == [0.75]


@settings(max_examples=200, deadline=None)
@given(first=st.integers(1, 40), second=st.integers(0, 40), iteration=st.integers(-1, 100),
       stairs=st.integers(0, 5))
def test_one_cycle_lr_and_beta1_move_together(first, second, iteration, stairs) -> None:
    # Within the cycle the lr's height above cycle_min_lr is beta1's depth below cycle_max_mom.
    schedule = OneCycle(make_adam(), 0.01, 0.11, cycle_first_step_size=first,
                        cycle_second_step_size=second, cycle_first_stair_count=stairs,
                        cycle_min_mom=0.8, cycle_max_mom=0.9)
    schedule.step(iteration)
    lr, beta1 = schedule.get_last_lr()[0], schedule.get_mom()[0][0]
    assert 0.01 - 1e-15 <= lr <= 0.11 + 1e-15 and 0.8 - 1e-15 <= beta1 <= 0.9 + 1e-15
    assert (lr - 0.01) / 0.1 == pytest.approx((0.9 - beta1) / 0.1, abs=1e-9)
    if iteration == first - 1 and second > 0:  # (with no second half the cycle ends there)
        assert lr == 0.11  # the peak, exactly
    if iteration >= first + second - 1:
        assert lr == pytest.approx(0.01) and beta1 == pytest.approx(0.9)


# --- LRRangeTest

def test_lr_range_test_continuous() -> None:
    # lr = 0.01 * (1 + 2 * (i + 1) / 4)
    optimizer = make_optimizer()
    schedule = LRRangeTest(optimizer, lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                           lr_range_test_step_rate=2.0)
    assert optimizer.param_groups[0]["lr"] == 0.01 and schedule.get_last_lr() == [0.01]
    seen = lrs_by_iteration(schedule, 9)
    assert_lrs(seen, {0: 0.015, 1: 0.02, 3: 0.03, 9: 0.06})


def test_lr_range_test_staircase() -> None:
    # lr = 0.01 * (1 + 2 * floor((i + 1) / 4))
    schedule = LRRangeTest(make_optimizer(), 0.01, 4, 2.0, lr_range_test_staircase=True)
    seen = lrs_by_iteration(schedule, 11)
    assert_lrs(seen, {0: 0.01, 2: 0.01, 3: 0.03, 6: 0.03, 7: 0.05, 10: 0.05, 11: 0.07})


def test_lr_range_test_defaults_and_per_group_values() -> None:
    # Defaults: 1e-3 * (1 + 1.0 * (i + 1) / 2000).
    schedule = LRRangeTest(make_optimizer())
    schedule.step(999)
    assert schedule.get_last_lr() == [pytest.approx(1.5e-3)]
    optimizer = make_optimizer(num_groups=2)
    schedule = LRRangeTest(optimizer, [0.01, 0.1], lr_range_test_step_size=4,
                           lr_range_test_step_rate=2.0)
    schedule.step(batch_iteration=3)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.03, 0.3])
    with pytest.raises(ValueError, match=r"lr_range_test_min_lr: expected 2 values .* got 3"):
        LRRangeTest(optimizer, [0.1, 0.2, 0.3])


def test_lr_range_test_state_dict_resumes() -> None:
    reference = LRRangeTest(make_optimizer(), 0.01, 4, 2.0, lr_range_test_staircase=True)
    for _ in range(3):
        reference.step()
    resumed = LRRangeTest(make_optimizer(), 0.01, 4, 2.0, lr_range_test_staircase=True)
    resumed.load_state_dict(reference.state_dict())
    assert reference.state_dict() == {"last_batch_iteration": 2}
    reference.step()
    resumed.step()
    assert resumed.get_last_lr() == reference.get_last_lr() == [pytest.approx(0.03)]


# --- counting and state

def test_step_can_jump_to_an_iteration() -> None:
    schedule = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=4,
                        warmup_type="linear")
    schedule.step(3)
    assert schedule.last_batch_iteration == 3 and schedule.get_last_lr() == [0.75]
    schedule.step()
    assert schedule.last_batch_iteration == 4 and schedule.get_last_lr() == [1.0]


def test_state_dict_is_deepspeeds_and_resumes() -> None:
    def build(optimizer, **kwargs):
        return WarmupDecayLR(optimizer, 20, warmup_max_lr=0.1, warmup_num_steps=5, **kwargs)

    reference = build(make_optimizer())
    for _ in range(7):
        reference.step()
    state = reference.state_dict()
    assert state == {"last_batch_iteration": 6}
    reference.step()

    resumed = build(make_optimizer())
    resumed.load_state_dict(state)
    resumed.step()
    assert resumed.get_last_lr() == reference.get_last_lr()


def test_building_at_a_later_iteration_leaves_the_lr_until_step() -> None:
    optimizer = make_optimizer(lr=0.123)
    schedule = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear",
                        last_batch_iteration=1)
    assert optimizer.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match="call step"):
        schedule.get_last_lr()
    schedule.step()
    assert schedule.last_batch_iteration == 2 and optimizer.param_groups[0]["lr"] == 0.5


def test_lr_reaches_param_groups_replaced_by_optimizer_load_state_dict() -> None:
    optimizer = make_optimizer()
    schedule = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    optimizer.load_state_dict(make_optimizer().state_dict())  # new param_groups list
    schedule.step(2)
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_tensor_learning_rates_are_updated_in_place() -> None:
    lr = torch.tensor(0.5)
    optimizer = SimpleNamespace(param_groups=[{"lr": lr, "params": []}])
    schedule = WarmupCosineLR(optimizer, 12, warmup_num_steps=4, warmup_type="linear")
    schedule.step(2)
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.25)
    assert schedule.get_last_lr() == [pytest.approx(0.25)]


def test_a_wrapper_holding_the_optimizer_is_accepted() -> None:
    inner = make_optimizer()
    WarmupLR(SimpleNamespace(optimizer=inner), warmup_min_lr=0.2)
    assert inner.param_groups[0]["lr"] == 0.2
    with pytest.raises(TypeError, match="optimizer: expected an optimizer with param_groups"):
        WarmupLR(object())


def test_training_loop_with_a_torch_optimizer_raises_no_warnings() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = WarmupCosineLR(optimizer, 10, warmup_num_steps=3)
    for _ in range(12):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.0001)


@pytest.mark.parametrize(("build", "message"), [
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps: expected a positive integer"),
    (lambda o: WarmupLR(o, warmup_num_steps=2.5), "warmup_num_steps: expected a positive"),
    (lambda o: WarmupDecayLR(o, 0), "total_num_steps: expected a positive integer"),
    (lambda o: WarmupCosineLR(o, -5), "total_num_steps: expected a positive integer"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0),
     "cycle_first_step_size: expected a positive number, got 0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0, cycle_second_step_size=100),
     "cycle_first_step_size: expected a positive number, got 0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=-1),
     "cycle_first_step_size: expected a positive number, got -1"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-1),
     "cycle_second_step_size: expected a non-negative number, got -1"),
    (lambda o: OneCycle(o, 0.1, 1.0, decay_step_size=-2),
     "decay_step_size: expected a non-negative number"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_stair_count=True),
     "cycle_first_stair_count: expected a number"),
    (lambda o: OneCycle(o, [0.1, 0.2], 1.0), r"cycle_min_lr: expected 1 values .* got 2"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0),
     "lr_range_test_step_size: expected a positive integer, got 0"),
])
def test_bad_arguments(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(make_optimizer())


@pytest.mark.parametrize("build", [
    lambda o, kind: WarmupLR(o, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type=kind),
    lambda o, kind: WarmupDecayLR(o, 20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type=kind),
    lambda o, kind: WarmupCosineLR(o, 20, warmup_num_steps=10, warmup_type=kind),
])
def test_unknown_warmup_type_falls_back_to_log_and_says_so(build, caplog) -> None:
    # DeepSpeed logs a warning and warms up along the log curve (its WarmupCosineLR too).
    with caplog.at_level("WARNING", logger="infinity"):
        schedule = build(make_optimizer(), "cosine")
    assert "warmup_type: unknown 'cosine'" in caplog.text and schedule.warmup_type == "log"
    reference = build(make_optimizer(), "log")
    assert lrs_by_iteration(schedule, 25) == lrs_by_iteration(reference, 25)


# --- properties

@settings(max_examples=200, deadline=None)
@given(warmup=st.integers(1, 50), total=st.integers(1, 200), iteration=st.integers(0, 400),
       warmup_type=st.sampled_from(["log", "linear"]))
def test_decay_stays_between_min_and_max(warmup, total, iteration, warmup_type) -> None:
    schedule = WarmupDecayLR(make_optimizer(), total, warmup_min_lr=0.01, warmup_max_lr=0.1,
                             warmup_num_steps=warmup, warmup_type=warmup_type)
    schedule.step(iteration)
    assert 0.01 - 1e-15 <= schedule.get_last_lr()[0] <= 0.1 + 1e-15


@settings(max_examples=200, deadline=None)
@given(warmup=st.integers(1, 50), total=st.integers(1, 200), iteration=st.integers(0, 400),
       cos_min=st.floats(0.0, 1.0), warmup_min=st.floats(0.0, 1.0))
def test_cosine_ratio_stays_in_range(warmup, total, iteration, cos_min, warmup_min) -> None:
    schedule = WarmupCosineLR(make_optimizer(), total, warmup_min_ratio=warmup_min,
                              warmup_num_steps=warmup, cos_min_ratio=cos_min)
    schedule.step(iteration)
    ratio = schedule.get_lr_ratio()
    lowest = warmup_min if iteration < schedule.warmup_num_steps else cos_min
    assert lowest - 1e-12 <= ratio <= 1.0 + 1e-12
    if iteration >= max(total, schedule.warmup_num_steps) + 1:
        assert math.isclose(ratio, cos_min, abs_tol=1e-12)


# --- build_scheduler

@pytest.mark.parametrize(("section", "cls", "expected"), [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                     "warmup_num_steps": 10}},
     WarmupLR, {1: 0.01 * LOG10_2, 10: 0.01}),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.1,
                                          "warmup_num_steps": 4, "warmup_type": "linear"}},
     WarmupDecayLR, {2: 0.05, 7: 0.05, 10: 0.0}),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_min_ratio": 0.1,
                                           "cos_min_ratio": 0.1, "warmup_num_steps": 4,
                                           "warmup_type": "linear"}},
     WarmupCosineLR, {2: 0.55 * 2.0, 4: 2.0 * (0.1 + 0.9 * (1 + COS_PI_8) / 2)}),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0], "warmup_max_lr": [0.01],
                                     "warmup_num_steps": 10}},
     WarmupLR, {4: 0.01 * LOG10_5}),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_first_step_size": 4, "cycle_second_step_size": 2,
                                     "cycle_momentum": False}},
     OneCycle, {0: 0.325, 3: 1.0, 4: 0.55, 5: 0.1, 9: 0.1}),
    ({"type": "OneCycle", "params": {"cycle_min_lr": [0.2], "cycle_max_lr": [1.0],
                                     "cycle_first_step_size": 2, "decay_step_size": 2,
                                     "decay_lr_rate": 0.5, "cycle_momentum": False}},
     OneCycle, {1: 1.0, 4: 0.2 / 1.25, 5: 0.2 / 1.5}),
    ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01,
                                        "lr_range_test_step_size": 4,
                                        "lr_range_test_step_rate": 2.0,
                                        "lr_range_test_staircase": True}},
     LRRangeTest, {2: 0.01, 3: 0.03, 7: 0.05}),
    ({"type": "LRRangeTest", "params": {}}, LRRangeTest, {999: 1.5e-3}),
])
def test_build_scheduler_from_config(section: dict, cls: type, expected: dict) -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": section})
    optimizer = make_optimizer(lr=2.0)
    schedule = build_scheduler(config.scheduler, optimizer)
    assert type(schedule) is cls and schedule.optimizer is optimizer
    assert_lrs(lrs_by_iteration(schedule, max(expected)), expected)


def test_build_scheduler_resumes_from_last_batch_iteration() -> None:
    section = {"type": "WarmupLR", "params": {"warmup_max_lr": 1.0, "warmup_num_steps": 4,
                                              "warmup_type": "linear", "last_batch_iteration": 1}}
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": section})
    schedule = build_scheduler(config.scheduler, make_optimizer())
    schedule.step()
    assert schedule.get_last_lr() == [0.5]


def test_build_scheduler_without_a_section() -> None:
    assert build_scheduler(None, make_optimizer()) is None
    with pytest.raises(TypeError, match="scheduler: expected a SchedulerConfig"):
        build_scheduler({"type": "WarmupLR"}, make_optimizer())  # type: ignore[arg-type]


def test_warmup_without_max_lr_keeps_each_groups_own_lr() -> None:
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1},
                                 {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.02}], lr=0.1)
    schedule = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_num_steps=2, warmup_type="linear")
    schedule.step(5)  # warmup over
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.02]


def test_build_one_cycle_from_config_cycles_the_betas() -> None:
    section = {"type": "OneCycle", "params": {"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 1.0,
                                              "cycle_first_step_size": 2,
                                              "cycle_min_mom": [0.8, 0.7]}}
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": section})
    optimizer = make_adam(num_groups=2)
    schedule = build_scheduler(config.scheduler, optimizer)
    assert [g["betas"] for g in optimizer.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    schedule.step(1)  # the top of the cycle: cycle_max_lr and cycle_min_mom
    assert [(g["lr"], g["betas"]) for g in optimizer.param_groups] == [
        (1.0, (0.8, 0.99)), (1.0, (0.7, 0.99))]
    schedule.step()  # back down: height 1 / 2 (cycle_max_mom is DeepSpeed's 0.9)
    assert schedule.get_last_lr() == pytest.approx([0.55, 0.6])
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.85, 0.8])


MICRO_BATCH = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize(("section", "error", "message"), [
    ({"type": "OneCycle", "params": {"cycle_max_lr": 1.0}}, ValueError,
     "scheduler.params.cycle_min_lr: required key is missing"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_first_step_size": 0}}, ValueError,
     "scheduler.params.cycle_first_step_size: expected an integer >= 1, got 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_second_step_size": -1}}, ValueError,
     "scheduler.params.cycle_second_step_size: expected an integer >= 0, got -1"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_first_stair_count": 1.5}}, TypeError,
     "scheduler.params.cycle_first_stair_count: expected an integer, got 1.5"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "decay_step_size": -1}}, ValueError,
     "scheduler.params.decay_step_size: expected an integer >= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "decay_lr_rate": -0.5}}, ValueError,
     "scheduler.params.decay_lr_rate: expected a number >= 0.0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_max_mom": 1.0}}, ValueError,
     "scheduler.params.cycle_max_mom: expected a number in [0, 1), got 1.0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_min_mom": [0.8, "x"]}}, TypeError,
     'scheduler.params.cycle_min_mom[1]: expected a number, got "x"'),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_momentum": "yes"}}, TypeError,
     'scheduler.params.cycle_momentum: expected true or false, got "yes"'),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "warmup_num_steps": 10}}, ValueError,
     "scheduler.params.warmup_num_steps: unknown key"),
    ({"type": "OneCycle", "cycle_min_lr": 0.1}, ValueError,
     "scheduler.cycle_min_lr: unknown key here; it belongs in scheduler.params.cycle_min_lr"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, ValueError,
     "scheduler.params.lr_range_test_step_size: expected an integer >= 1, got 0"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": 1}}, TypeError,
     "scheduler.params.lr_range_test_staircase: expected true or false, got 1"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": -0.1}}, ValueError,
     "scheduler.params.lr_range_test_min_lr: expected a number >= 0.0"),
    ({"type": "LRRangeTest", "params": {"cycle_min_lr": 0.1}}, ValueError,
     "scheduler.params.cycle_min_lr: unknown key"),
])
def test_one_cycle_and_lr_range_test_config_errors(section: dict, error: type,
                                                   message: str) -> None:
    with pytest.raises(error) as caught:
        load_config({**MICRO_BATCH, "scheduler": section})
    assert message in str(caught.value)


# --- through infinity.initialize

# OneCycle 1e-3 -> 5e-3 -> 1e-3 over 2 + 2 steps, beta1 0.9 -> 0.8 -> 0.9. Optimizer step k
# runs with what the schedule wrote after step k - 1 (at construction for k = 0, where DeepSpeed
# starts beta1 at cycle_min_mom): (lr, beta1) per step, worked out by hand; beta2 is 0.99.
ONE_CYCLE = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 5e-3,
                                            "cycle_first_step_size": 2,
                                            "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}}
ONE_CYCLE_STEPS = [(1e-3, 0.8), (3e-3, 0.85), (5e-3, 0.8), (3e-3, 0.85), (1e-3, 0.9), (1e-3, 0.9)]


def test_one_cycle_from_the_config_drives_the_engines_adam() -> None:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    data = batches(len(ONE_CYCLE_STEPS), 4)

    reference = copy.deepcopy(model)  # plain AdamW, lr and betas set by hand each step
    adam = torch.optim.AdamW(reference.parameters(), weight_decay=0.01)
    ref_losses = []
    for (idx, tgt), (lr, beta1) in zip(data, ONE_CYCLE_STEPS):
        adam.param_groups[0].update(lr=lr, betas=(beta1, 0.99))
        loss = reference(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        adam.step()
        adam.zero_grad()
        ref_losses.append(loss.item())

    cfg = {**config(3, "cpu", "cpu"), "scheduler": ONE_CYCLE}
    engine, optimizer, _, schedule = infinity.initialize(model=copy.deepcopy(model), config=cfg)
    assert type(schedule) is OneCycle and schedule.optimizer is optimizer
    losses = []
    for step, ((idx, tgt), (lr, beta1)) in enumerate(zip(data, ONE_CYCLE_STEPS)):
        assert engine.get_lr() == [pytest.approx(lr, rel=1e-12)], step
        assert optimizer.param_groups[0]["betas"] == (pytest.approx(beta1, rel=1e-12), 0.99), step
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert schedule.state_dict() == {"last_batch_iteration": len(ONE_CYCLE_STEPS) - 1}
    engine.close()
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert got == pytest.approx(want, rel=1e-5), step


def test_lr_range_test_from_the_config_sets_the_engines_lr() -> None:
    # lr = 1e-3 * (1 + 0.5 * (i + 1) / 2) after optimizer step i.
    section = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
                                                 "lr_range_test_step_size": 2,
                                                 "lr_range_test_step_rate": 0.5}}
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(model=TinyGPT(layers=2),
                                     config={**config(3, "cpu", "cpu"), "scheduler": section})
    seen = [engine.get_lr()[0]]
    for idx, tgt in batches(4, 4):
        engine.backward(engine(idx, tgt))
        engine.step()
        seen.append(engine.get_lr()[0])
    engine.close()
    assert seen == pytest.approx([1e-3, 1.25e-3, 1.5e-3, 1.75e-3, 2e-3], rel=1e-12)


def test_deepspeeds_key_names_are_the_schedules_arguments() -> None:
    # `from deepspeed.runtime.lr_schedules import WARMUP_MIN_LR, ...`: scripts build config
    # sections and keyword arguments with these names, so each must be an argument we take.
    import inspect

    from infinity.config import WARMUP_TYPES
    from infinity.deepspeed.runtime import lr_schedules as ds_names

    arguments = {name for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
                 for name in inspect.signature(cls).parameters}
    keys = {name: getattr(ds_names, name) for name in ds_names.__all__
            if name.isupper() and name not in ("VALID_LR_SCHEDULES", "WARMUP_LOG_RATE",
                                               "WARMUP_LINEAR_RATE")}
    keys = {name: value for name, value in keys.items() if value not in ds_names.VALID_LR_SCHEDULES}
    assert len(keys) == 22 and set(keys.values()) <= arguments
    assert (ds_names.WARMUP_LOG_RATE, ds_names.WARMUP_LINEAR_RATE) == WARMUP_TYPES
    assert {getattr(ds_names, name) for name in ds_names.VALID_LR_SCHEDULES} == {
        WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest}
    schedule = ds_names.OneCycle(make_adam(), **{ds_names.CYCLE_MIN_LR: 0.1, ds_names.CYCLE_MAX_LR: 1.0,
                                                 ds_names.CYCLE_FIRST_STEP_SIZE: 2})
    assert schedule.max_lrs == [1.0]
