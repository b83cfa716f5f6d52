"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR: numbers, counting, state, building.

Expected learning rates are worked out by hand from DeepSpeed's formulas (see the comments);
iteration i is the value of last_batch_iteration after i + 1 calls to step().
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import load_config
from infinity.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

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
    schedule = WarmupLR(SimpleNamespace(optimizer=inner), warmup_min_lr=0.2)
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
    (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type: expected one of 'log', 'linear'"),
    (lambda o: WarmupDecayLR(o, 0), "total_num_steps: expected a positive integer"),
    (lambda o: WarmupCosineLR(o, -5), "total_num_steps: expected a positive integer"),
])
def test_bad_arguments(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(make_optimizer())


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
