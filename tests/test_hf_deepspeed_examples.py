"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py under `infinity run`, as its
run_ds.sh starts it (`deepspeed cifar10_deepspeed.py --deepspeed ...`): tests/ds_cifar_job.py is
that script with synthetic images in place of torchvision's download (see its docstring); its
DeepSpeed calls, config and command line are the example's. Likewise (slow) its HelloDeepSpeed
training/HelloDeepSpeed/train_bert_ds.py, as its run_ds.sh starts it (`deepspeed train_bert_ds.py
--checkpoint_dir ...`): tests/ds_bert_job.py, with synthetic text and a tokenizer built in memory
in place of the downloads and stand-ins for the packages it needs that are not installed."""

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


@pytest.mark.parametrize("flags", [pytest.param((), marks=pytest.mark.slow), ("--dtype", "fp32", "--stage", "3"),
                                   pytest.param(("--dtype", "bf16", "--stage", "2"), marks=pytest.mark.slow)],
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


BERT_JOB = Path(__file__).with_name("ds_bert_job.py")
# The example's own flags for a short run: 2 of its 6 layers, no dropout (so that the plain
# reference below draws the same numbers), the loss logged at every step (the script logs the
# running mean; _step_losses takes it apart) and a checkpoint every 10 steps. fp16 matrix products
# are slow on a CPU (the LM head is 50265 wide), so that run is narrower (its h_dim and ff_dim).
BERT_ARGS = {"num_layers": 2, "dropout": 0, "num_iterations": 21, "checkpoint_every": 10, "log_every": 1}
BERT_DTYPES = {"bf16": {}, "fp16": {"dtype": "fp16", "h_dim": 128, "ff_dim": 256}}
RESUMED_ITERATIONS = 31

# The job's train() in a plain process with deepspeed.initialize giving a plain-PyTorch engine:
# what DeepSpeed's bf16 engine computes for the example's config (the module in bf16 for forward
# and backward; Adam at the config's lr stepping fp32 master weights, kept on the CPU, that start as
# the model's fp32 initial weights; the bf16 module then takes their values). Its checkpoint is a
# torch.save of the masters, Adam's state, client_state and the Python / NumPy / torch RNG states,
# which load_checkpoint sets back as infinity's does (README, "Exact resume"; DeepSpeed's leaves the
# RNGs alone, so under it the resumed run would draw other batches and masks). Each train() starts
# from the seeds the script's __main__ sets, so data, masks and initial weights are the launched
# runs'. argv: the job, then train()'s keyword arguments (JSON) for the first run and for its
# resumption from that run's directory.
_PLAIN_BF16_ENGINE = r'''
import copy, importlib.util, json, random, sys, types
import numpy as np
import torch

spec = importlib.util.spec_from_file_location("train_bert_ds", sys.argv[1])
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)


class PlainEngine:
    def __init__(self, model, lr, device):
        self.master, self.module = model, copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def __call__(self, **batch):
        return self.module(**batch)

    def parameters(self):
        return self.master.parameters()

    def train(self):
        self.module.train()

    def backward(self, loss):
        loss.backward()

    def step(self):
        for p, q in zip(self.master.parameters(), self.module.parameters()):
            p.grad, q.grad = (None if q.grad is None else q.grad.to(p.device, torch.float32)), None
        self.optimizer.step()
        self._copy_masters()

    def _copy_masters(self):
        with torch.no_grad():
            for p, q in zip(self.master.parameters(), self.module.parameters()):
                q.copy_(p)

    def save_checkpoint(self, save_dir, client_state):
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        torch.save({"master": self.master.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "client_state": client_state, "rng": rng}, f"{save_dir}/plain.pt")

    def load_checkpoint(self, load_dir):
        state = torch.load(f"{load_dir}/plain.pt", weights_only=False)
        self.master.load_state_dict(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._copy_masters()
        python_rng, numpy_rng, torch_rng = state["rng"]
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        torch.set_rng_state(torch_rng)
        return load_dir, state["client_state"]


def initialize(model, model_parameters, config):
    assert config["bf16"] == {"enabled": True} and config["optimizer"]["type"] == "Adam", config
    accelerator = job.get_accelerator()  # the device train() puts the batches on, for local_rank 0
    device = torch.device(accelerator.device_name(), 0) if accelerator.is_available() else torch.device("cpu")
    return PlainEngine(model, config["optimizer"]["params"]["lr"], device), None, None, None


def run(kwargs):
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    return job.train(**kwargs)


job.deepspeed = types.SimpleNamespace(initialize=initialize)
exp_dir = run(json.loads(sys.argv[2]))
run(dict(json.loads(sys.argv[3]), load_checkpoint_dir=str(exp_dir)))
'''


def _infinity_run(cwd: Path, script: Path, args: dict) -> subprocess.CompletedProcess:
    flags = [str(x) for name, value in args.items() for x in (f"--{name}", value)]
    # cwd outside the checkout: its source tree (no compiled extensions) would shadow the installed package
    proc = subprocess.run([sys.executable, "-m", "infinity.apps.cli", "run", "--num_gpus", "1", "--master_port",
                           str(_free_port()), str(script), *flags],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _step_losses(exp_dir: Path) -> dict[int, float]:
    """Each step's loss, from what the script logs at every step: the mean of the losses so far in
    its process (written by the stand-in SummaryWriter); a resumed run's mean starts again."""
    records = [json.loads(line) for line in (exp_dir / "tb_dir" / "scalars.jsonl").read_text().splitlines()]
    losses, count = {}, 0
    for i, record in enumerate(records):
        count = count + 1 if i and record["step"] == records[i - 1]["step"] + 1 else 1
        previous_sum = (count - 1) * records[i - 1]["value"] if count > 1 else 0.0
        losses[record["step"]] = count * record["value"] - previous_sum
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"], ids=["defaults-bf16", "fp16"])
def test_hello_deepspeed_bert_example_trains_and_resumes(tmp_path, dtype):
    """DeepSpeedExamples' HelloDeepSpeed train_bert_ds.py (tests/ds_bert_job.py: synthetic text
    and a local tokenizer in place of the downloads) under `infinity run`, as its run_ds.sh starts
    it, then resumed from its checkpoint with its --load_checkpoint_dir; at its default bf16 the
    losses of both runs are those of the same script with a plain-PyTorch engine."""
    script = tmp_path / "train_bert_ds.py"
    shutil.copy(BERT_JOB, script)
    first = _infinity_run(tmp_path, script, {"checkpoint_dir": "experiments", **BERT_ARGS, **BERT_DTYPES[dtype]})
    (exp_dir,) = (tmp_path / "experiments").glob("bert_pretrain.*")
    assert first.stdout.splitlines()[-1] == f"experiments/{exp_dir.name}"  # fire prints what train returns
    # it stops when step reaches num_iterations: steps 1..20, checkpoints after steps 10 and 20,
    # and its final save (step 21) under the engine's tag again
    assert (exp_dir / "latest").read_text().strip() == "global_step20"
    assert (exp_dir / "global_step10").is_dir() and (exp_dir / "global_step20").is_dir()
    losses = _step_losses(exp_dir)
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(x) for x in losses.values())
    assert losses[1] == pytest.approx(math.log(50265), abs=0.3)  # untrained: near uniform over the model's vocabulary
    start, end = (sum(losses[i] for i in steps) / len(steps) for steps in (range(1, 6), range(16, 21)))
    assert end < start - 0.15

    # the script's resume: hparams.json, load_checkpoint(load_dir=...) and its client_state's checkpoint_step
    resume = {"num_iterations": RESUMED_ITERATIONS, "log_every": 1, **({"dtype": dtype} if dtype != "bf16" else {})}
    _infinity_run(tmp_path, script, {"load_checkpoint_dir": f"experiments/{exp_dir.name}", **resume})
    assert (exp_dir / "latest").read_text().strip() == "global_step29"  # 20 steps loaded, 9 more
    losses = _step_losses(exp_dir)
    assert sorted(losses) == [*range(1, 21), *range(22, 31)]  # from checkpoint_step 21 + 1
    assert all(math.isfinite(x) for x in losses.values())
    # the trained weights came back: it goes on nearer the first run's end than its start (a model
    # built afresh from the same seed would start where the first run did)
    assert sum(losses[i] for i in range(22, 27)) / 5 < (start + end) / 2
    if dtype != "bf16":
        return

    plain = subprocess.run([sys.executable, "-c", _PLAIN_BF16_ENGINE, str(script),
                            json.dumps({"checkpoint_dir": "plain", **BERT_ARGS, "local_rank": 0}),
                            json.dumps({**resume, "local_rank": 0})],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, OMP_NUM_THREADS="1", INFINITY_AS_DEEPSPEED="1"))
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    (plain_dir,) = (tmp_path / "plain").glob("bert_pretrain.*")
    expected = _step_losses(plain_dir)
    assert sorted(expected) == sorted(losses)
    # the loss is a bf16 number (a step of 1/16 at these values): the same until the fp32 masters'
    # last bits (Adam's arithmetic) round a bf16 weight the other way, then a step or two apart
    steps = sorted(losses)
    assert [losses[s] for s in steps] == pytest.approx([expected[s] for s in steps], abs=0.25)
    for run in (range(1, 21), range(22, 31)):  # and on average within a fraction of a step
        mean, expected_mean = (sum(values[s] for s in run) / len(run) for values in (losses, expected))
        assert mean == pytest.approx(expected_mean, abs=0.05)
