"""initialize's client optimizer and LR scheduler, combined as DeepSpeed combines them
([Note: client optimizer and scheduler] in infinity/engine/initialize.py), checked by the weights they train
against plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

import infinity
from infinity.optim.lr_schedules import WarmupLR
from infinity.optim.cpu_adam import DeepSpeedCPUAdam

BASE = {"train_batch_size": 2, "gradient_clipping": 0.0}
OFFLOADED = {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))


def _data(steps: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 6, generator=g) for _ in range(steps)]


def _train(engine, data) -> list[float]:
    lrs = []
    for x in data:
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


def _reference(model: nn.Module, data, make_optimizer, make_scheduler) -> tuple[nn.Module, list[float]]:
    """Plain PyTorch: the same loop, the optimizer and scheduler stepped after each batch."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    lrs = []
    for x in data:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return model, lrs


def _assert_same_weights(engine, reference: nn.Module) -> None:
    trained = engine.consolidated_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name].float(), value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_scheduler_of_the_optimizer_accelerate_replaced_drives_the_update() -> None:
    # accelerate offloading the optimizer: the user's AdamW and a scheduler built on it before
    # initialize, then DeepSpeedCPUAdam(adamw.param_groups) passed as the optimizer. The scheduler
    # steps the very group dicts the engine reads (it was refused: "not the one given").
    model, data = _model(), _data()
    trained = copy.deepcopy(model)
    adamw = torch.optim.AdamW(trained.parameters(), lr=0.01)
    scheduler = StepLR(adamw, step_size=1, gamma=0.5)
    swapped = DeepSpeedCPUAdam(adamw.param_groups, lr=0.01)
    engine, _, _, returned = infinity.initialize(model=trained, optimizer=swapped, lr_scheduler=scheduler,
                                                 config=OFFLOADED)
    try:
        assert returned is scheduler
        lrs = _train(engine, data)
        reference, reference_lrs = _reference(model, data, lambda p: torch.optim.AdamW(p, lr=0.01),
                                              lambda o: StepLR(o, step_size=1, gamma=0.5))
        assert lrs == pytest.approx(reference_lrs) == [0.005, 0.0025, 0.00125, 0.000625]
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def test_a_client_scheduler_callable_replaces_the_config_schedule_unbuilt() -> None:
    # The config's WarmupLR is never built: built, it wrote its warmup_min_lr (0) into the groups
    # before StepLR read its base lr from them, and the job trained at lr 0.
    model, data = _model(), _data()
    trained = copy.deepcopy(model)
    config = {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, _, _, scheduler = infinity.initialize(
        model=trained, optimizer=torch.optim.AdamW(trained.parameters(), lr=0.01),
        lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.5), config=config)
    try:
        assert isinstance(scheduler, StepLR) and scheduler.base_lrs == [0.01]
        assert engine.scheduler_name() == "WarmupLR"  # the config still says so, as DeepSpeed's does
        _train(engine, data)
        reference, _ = _reference(model, data, lambda p: torch.optim.AdamW(p, lr=0.01),
                                  lambda o: StepLR(o, step_size=1, gamma=0.5))
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def _client_optimizer(kind: str, model: nn.Module):
    if kind == "object":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "callable":
        return lambda params: torch.optim.AdamW(params, lr=0.01)
    return None


# DeepSpeed's tests/unit/runtime/test_ds_initialize.py combinations: optimizer from the config,
# an object or a callable; schedule from the config, a callable or an object on the optimizer.
@pytest.mark.parametrize("optimizer_kind", ["config", "object", "callable"])
@pytest.mark.parametrize("scheduler_kind", ["config", "callable", "object"])
def test_client_and_config_optimizer_and_scheduler_combinations(optimizer_kind, scheduler_kind) -> None:
    model = _model()
    config = dict(BASE)
    if optimizer_kind == "config":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01}}
    client_optimizer = _client_optimizer(optimizer_kind, model)
    scheduler: object = None
    if scheduler_kind == "config":
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}}
    elif scheduler_kind == "callable":
        scheduler = lambda optimizer: OneCycleLR(optimizer, max_lr=0.01, total_steps=20)  # noqa: E731
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        scheduler = LambdaLR(client_optimizer, lambda step: 0.0)
    else:  # an object needs its optimizer passed to initialize: DeepSpeed asserts, we refuse
        scheduler = LambdaLR(torch.optim.Adam(model.parameters()), lambda step: 0.0)
        with pytest.raises(ValueError, match="lr_scheduler: a scheduler object needs the optimizer it steps "
                                             "passed as optimizer="):
            infinity.initialize(model=model, optimizer=client_optimizer, lr_scheduler=scheduler, config=config)
        return
    engine, _, _, returned = infinity.initialize(model=model, optimizer=client_optimizer, lr_scheduler=scheduler,
                                                 config=config)
    try:
        expected = {"config": WarmupLR, "callable": OneCycleLR, "object": LambdaLR}[scheduler_kind]
        assert isinstance(returned, expected)
        before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
        lrs = _train(engine, _data(3))  # WarmupLR's log warmup trains at lr 0 twice first
        assert lrs[-1] == pytest.approx(returned.get_last_lr()[0])
        moved = any(not torch.equal(before[k], v) for k, v in engine.consolidated_state_dict().items())
        assert moved == (scheduler_kind != "object")  # LambdaLR's lr 0 holds the weights still
    finally:
        engine.close()


def test_a_scheduler_stepping_other_groups_is_refused() -> None:
    model = _model()
    given = torch.optim.AdamW(model.parameters(), lr=0.01)
    other = torch.optim.AdamW(model.parameters(), lr=0.01)  # same parameters, its own group dicts
    with pytest.raises(ValueError, match=r"lr_scheduler: it steps an optimizer that is not the one given to "
                                         r"initialize\(\) nor one sharing its param groups"):
        infinity.initialize(model=model, optimizer=given, lr_scheduler=StepLR(other, 1), config=BASE)


def test_a_custom_scheduler_object_is_taken_as_it_is() -> None:
    # DeepSpeed takes any object with step(); one that names no optimizer cannot be checked.
    class Halve:
        def __init__(self, groups):
            self.groups = groups

        def step(self):
            for group in self.groups:
                group["lr"] *= 0.5

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    halve = Halve(optimizer.param_groups)
    engine, _, _, returned = infinity.initialize(model=model, optimizer=optimizer, lr_scheduler=halve, config=BASE)
    try:
        assert returned is halve
        assert _train(engine, _data(2)) == pytest.approx([0.005, 0.0025])
    finally:
        engine.close()
