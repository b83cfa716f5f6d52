"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py under `infinity run`, as its
run_ds.sh starts it (`deepspeed cifar10_deepspeed.py --deepspeed ...`): tests/ds_cifar_job.py is
that script with synthetic images in place of torchvision's download (see its docstring); its
DeepSpeed calls, config and command line are the example's."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("ds_cifar_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flags", [(), ("--dtype", "fp32", "--stage", "3"), ("--dtype", "bf16", "--stage", "2")],
                         ids=["defaults-fp16-stage0", "fp32-stage3", "bf16-stage2"])
def test_cifar10_deepspeed_example_trains(tmp_path, flags):
    script = tmp_path / "cifar10_deepspeed.py"
    shutil.copy(JOB, script)
    record = tmp_path / "record.json"
    # cwd outside the checkout: its source tree (no compiled extensions) would shadow the installed package
    proc = subprocess.run([sys.executable, "-m", "infinity.apps.cli", "run", "--num_gpus", "1", "--master_port",
                           str(_free_port()), str(script), "--deepspeed", "--epochs", "1", "--num-samples", "480",
                           "--log-interval", "10", "--record", str(record), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Finished Training" in proc.stdout and "Accuracy of the network on the 96 test images" in proc.stdout
    got = json.loads(record.read_text())
    assert got["steps"] == 480 // 16  # train_batch_size 16 on one rank
    losses = got["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])  # it learns, through WarmupLR's first steps
    # WarmupLR as DeepSpeed: warmup_min_lr 0 to 0.001 over 1000 steps, log; after 30 steps it is at
    # iteration 29 (DeepSpeed's first step() moves to iteration 0)
    assert got["lr"] == [pytest.approx(0.001 * math.log(30) / math.log(1000), rel=1e-12)]
