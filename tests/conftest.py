"""Shared test setup.

The suite's references are plain PyTorch on the CPU, so on every host, with a GPU or without, the
engine runs on the asynchronous test device ([Note: in-flight copies] in infinity.device): every
engine test checks the ordering of copies a GPU needs, and compares bit for bit where the
arithmetic is the same. Child processes inherit the choice. Tests marked `gpu` run the engine on
CUDA against plain PyTorch on the same GPU; they are skipped without one."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Other projects' suites, run in their own pytest by test_vendored_suites.py, not collected here.
collect_ignore = ["vendored"]

os.environ.setdefault("INFINITY_DEVICE", "async-test")
# An engine without an aio section measures its disk once ([Note: the disk tunes itself] in
# infinity/io/autotune.py): here on 1 MiB transfers, cached for this run only (children inherit it).
os.environ.setdefault("INFINITY_AIO_TUNE_BYTES", str(1 << 20))
if "INFINITY_CACHE_DIR" not in os.environ:
    os.environ["INFINITY_CACHE_DIR"] = tempfile.mkdtemp(prefix="infinity-test-cache-")
    atexit.register(shutil.rmtree, os.environ["INFINITY_CACHE_DIR"], ignore_errors=True)


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
