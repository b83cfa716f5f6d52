"""Shared test setup: the `gpu` marker skips without CUDA, and without CUDA the engine runs on
the asynchronous test device ([Note: in-flight copies] in infinity.device), so that every
engine test checks the ordering of copies a GPU needs. Child processes inherit the choice."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("INFINITY_DEVICE", "async-test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
