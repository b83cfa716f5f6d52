"""A DeepSpeed job moves over by changing its import: tests/ds_job.py, a script written for
DeepSpeed's API (add_config_arguments, init_distributed, initialize with args and a config file,
training_data, the getters, the accumulation boundary, a WarmupDecayLR schedule, checkpoints with
client_state, GatheredParameters), runs with `import deepspeed` replaced by
`import infinity as deepspeed` and nothing else, and matches plain PyTorch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

JOB = os.path.join(os.path.dirname(__file__), "ds_job.py")
MICRO, GAS, EPOCHS = 4, 2, 2
LR_MIN, LR_MAX, WARMUP, TOTAL = 1e-3, 1e-2, 3, 12


def _migrated(tmp_path):
    with open(JOB) as f:
        source = f.read()
    assert source.count("import deepspeed\n") == 1
    path = tmp_path / "ds_job.py"
    path.write_text(source.replace("import deepspeed\n", "import infinity as deepspeed\n"))
    return path


def _config(tmp_path) -> str:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    cfg = {
        "train_batch_size": MICRO * GAS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR_MAX, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": LR_MIN, "warmup_max_lr": LR_MAX,
                                                          "warmup_num_steps": WARMUP, "total_num_steps": TOTAL,
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 9}},
        "amp": {"enabled": False},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(tmp_path, *extra: str) -> dict:
    job, out = _migrated(tmp_path), tmp_path / f"log{len(list(tmp_path.glob('log*')))}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
    proc = subprocess.run([sys.executable, str(job), "--deepspeed", "--deepspeed_config", _config(tmp_path),
                           "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _lr(step: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warmup) for optimizer step `step` (1-based): the
    schedule starts at iteration -1 (warmup_min_lr) and advances one iteration after each step."""
    it = step - 2
    if it < 0:
        return LR_MIN
    gamma = it / WARMUP if it < WARMUP else max(0.0, (TOTAL - it) / max(1, TOTAL - WARMUP))
    return LR_MIN + (LR_MAX - LR_MIN) * gamma


def _reference(tmp_path) -> dict:
    """Plain PyTorch: the script's model and data, the DistributedSampler order DeepSpeed's
    loader uses, AdamW, clip_grad_norm_ and the schedule above."""
    spec = importlib.util.spec_from_file_location("ds_job_migrated", _migrated(tmp_path))
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    torch.manual_seed(0)
    model = job.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR_MAX, weight_decay=0.01)
    data = job.Data()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    steps, micro, step = [], 0, 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)):
            loss = model(x, y)
            (loss / GAS).backward()
            micro += 1
            entry = {"epoch": epoch, "batch": i, "loss": loss.item(), "boundary": micro % GAS == 0}
            if entry["boundary"]:
                step += 1
                for group in opt.param_groups:
                    group["lr"] = _lr(step)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                entry.update(lr=_lr(step), grad_norm=float(norm), applied=True, global_steps=step)
            steps.append(entry)
    return {"steps": steps, "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}


def _assert_steps_match(ours: list[dict], ref: list[dict]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        where = f"epoch {b['epoch']} batch {b['batch']}"
        assert (a["epoch"], a["batch"], a["boundary"]) == (b["epoch"], b["batch"], b["boundary"]), where
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), where
        if b["boundary"]:
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), where
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), where
            assert a["applied"] and a["global_steps"] == b["global_steps"], where


@pytest.mark.slow
def test_a_deepspeed_script_runs_with_only_the_import_changed(tmp_path):
    ref = _reference(tmp_path)
    full = _run(tmp_path)
    assert full["getters"] == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                               "zero_optimization_stage": 3, "global_rank": 0, "local_rank": 0, "world_size": 1,
                               "optimizer_is_returned": True, "scheduler_is_engines": True}
    _assert_steps_match(full["steps"], ref["steps"])
    assert full["global_steps"] == TOTAL
    for name, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(full["weights"][name]), torch.tensor(value), atol=1e-5, rtol=1e-5,
                                   msg=name)

    # Stopped after 7 steps (in the second epoch), saved with client_state, resumed in a fresh
    # process: the same steps, bit for bit.
    first = _run(tmp_path, "--stop-after", "7")
    assert first["steps"] == full["steps"][:len(first["steps"])]
    resumed = _run(tmp_path, "--resume")
    assert resumed["loaded"] and resumed["resumed_at"] == 7
    assert first["steps"] + resumed["steps"] == full["steps"]
    assert resumed["weights"] == full["weights"]


def test_the_training_loader_shuffles_each_pass_as_deepspeeds_does():
    from infinity.engine.data_loader import TrainingDataLoader

    data = list(range(20))
    loader = TrainingDataLoader(data, 5, rank=0, world_size=1)
    first, second = [torch.cat(list(loader)).tolist() for _ in range(2)]
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)  # DeepSpeed's, seed 0
    assert first == list(sampler)
    sampler.set_epoch(1)
    assert second == list(sampler) and second != first  # a new pass is a new epoch
    loader.sampler.set_epoch(0)  # unless the script sets the epoch itself
    assert torch.cat(list(loader)).tolist() == first
    halves = [torch.cat(list(TrainingDataLoader(data, 5, rank=r, world_size=2))).tolist() for r in (0, 1)]
    assert sorted(halves[0] + halves[1]) == data


def test_init_distributed_and_add_config_arguments():
    import argparse

    import infinity

    args = infinity.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", "c.json"])
    assert args.deepspeed and args.deepspeed_config == "c.json" and args.deepscale_config is None
    with pytest.raises(TypeError, match="parser: expected an argparse.ArgumentParser"):
        infinity.add_config_arguments(None)
    import torch.distributed as dist
    if dist.is_initialized():  # the group of one an earlier test's initialize left: this asks for a new one
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="world_size: 2 processes need a launcher"):
        env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        try:
            infinity.init_distributed(world_size=2)
        finally:
            os.environ.update(env)


def test_deepspeeds_submodules_are_there_after_the_import_alone(tmp_path):
    """`import infinity as deepspeed` then `deepspeed.utils.safe_get_full_fp32_param(p)` and
    `deepspeed.zero.Init`: a fresh interpreter (any other test imports infinity.deepspeed.utils.full_values itself),
    run outside the checkout, whose root would shadow the installed package."""
    code = "import infinity as deepspeed; deepspeed.utils.safe_get_full_fp32_param; deepspeed.zero.Init"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
