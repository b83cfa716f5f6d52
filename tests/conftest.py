"""Shared test setup.

The suite's references are plain PyTorch on the CPU, so on every host, with a GPU or without, the
engine runs on the asynchronous test device ([Note: in-flight copies] in infinity.device): every
engine test checks the ordering of copies a GPU needs, and compares bit for bit where the
arithmetic is the same. Child processes inherit the choice. Tests marked `gpu` run the engine on
CUDA against plain PyTorch on the same GPU; they are skipped without one."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("INFINITY_DEVICE", "async-test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_run_on_cuda(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.setenv("INFINITY_DEVICE", "cuda")
