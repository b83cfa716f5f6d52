"""Fixtures the vendored Lightning tests take from Lightning's conftest (written here), and the
tests expected to fail against infinity, each with why (EXPECTED_FAILURES, checked both ways by
tests/test_vendored_suites.py)."""

from __future__ import annotations

import os
import sys

import lightning.fabric.accelerators.cuda
import lightning.pytorch.accelerators.cuda
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `helpers`, as Lightning's tests import theirs

_CPU = ("asserts that DeepSpeedStrategy refuses the CPU accelerator; infinity runs on the CPU accelerator as on "
        "CUDA (the point of the CPU-only tests in tests/test_lightning.py)")
EXPECTED_FAILURES: dict[str, str] = {
    # file::test (every parametrisation) -> why it fails against infinity, on purpose
    "test_fabric_deepspeed.py::test_deepspeed_only_compatible_with_cuda": _CPU,
    "test_trainer_deepspeed.py::test_error_with_invalid_accelerator": _CPU,
    "test_fabric_deepspeed.py::test_deepspeed_setup_module": (
        "mocks deepspeed.initialize and asserts DeepSpeedStrategy's private call to it (config=strategy.config, "
        "the very dict); InfinityFabricStrategy builds the engine with infinity.initialize on a copy of the config "
        "with its precision section, and the mocked call on a CUDA device this host lacks goes on to the real one"),
    "test_trainer_deepspeed.py::test_deepspeed_strategy_env_variables": (
        "calls DeepSpeedStrategy's private `_init_deepspeed_distributed` and asserts it calls "
        "deepspeed.init_distributed; InfinityStrategy is a DDPStrategy and joins the process group as DDP does"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        key = f"{os.path.basename(item.path)}::{item.originalname}"
        if key in EXPECTED_FAILURES:
            item.add_marker(pytest.mark.xfail(strict=True, reason=EXPECTED_FAILURES[key]))


def _cuda_count(monkeypatch, n: int) -> None:
    monkeypatch.setattr(lightning.fabric.accelerators.cuda, "num_cuda_devices", lambda: n)
    monkeypatch.setattr(lightning.pytorch.accelerators.cuda, "num_cuda_devices", lambda: n)


@pytest.fixture
def cuda_count_1(monkeypatch):
    _cuda_count(monkeypatch, 1)


@pytest.fixture(autouse=True)
def _lightning_environment(monkeypatch):
    # Lightning's conftest clears the cluster variables a test may leave behind; so does this.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                 "PL_DEEPSPEED_CONFIG_PATH", "PL_GLOBAL_SEED"):
        monkeypatch.delenv(name, raising=False)
    yield
