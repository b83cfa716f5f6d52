"""Hugging Face's Trainer on infinity, launched as the seed launches DeepSpeed: the script
tests/hf_trainer_job.py (HfArgumentParser, a tiny Llama, synthetic data) run by `infinity run
SCRIPT ARGS --deepspeed ds.json` with Hugging Face's "auto" configs, against the same script run
without `--deepspeed` (plain PyTorch, fp32): the same losses and gradient norms at every step
(1e-5), DeepSpeed's WarmupLR numbers, and `save_model` weights that `from_pretrained` loads."""

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
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOB = Path(__file__).with_name("hf_trainer_job.py")
SFT_JOB = Path(__file__).with_name("hf_sft_job.py")
LR = 1e-2
WARMUP = 3

# Hugging Face's ZeRO-2 example config (the seed's ds_config.json): "auto" wherever the Trainer knows the value.
ZERO2_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 1e5,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def zero3_nvme(nvme_path: Path) -> dict:
    """Hugging Face's ZeRO-3 example config with parameters and optimizer state on NVMe."""
    config = json.loads(json.dumps(ZERO2_AUTO))
    config["zero_optimization"] = {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True},
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_args(out: Path, *, micro: int, gas: int = 1, steps: int = 6, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--output_dir", str(out), "--per_device_train_batch_size", str(micro),
            "--gradient_accumulation_steps", str(gas), "--max_steps", str(steps), "--learning_rate", str(LR),
            "--warmup_steps", str(WARMUP), "--weight_decay", "0.0", "--logging_steps", "1", "--report_to", "none",
            "--optim", "adamw_torch", "--use_cpu", "--dataloader_num_workers", "0", "--save_strategy", "no",
            "--init_from", str(out.parent / "init"), "--record", str(out / "record.json"),
            "--save_final", str(out / "final"), *extra]


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    # cwd outside the checkout: its source tree (no compiled extensions) would shadow the installed package
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, what: str) -> None:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{what} failed:\n{out[-6000:]}"


def _infinity_run(tmp_path: Path, args: list[str], config: dict, num_gpus: int = 1,
                  script: Path = JOB) -> subprocess.Popen:
    (tmp_path / "ds.json").write_text(json.dumps(config))
    return _start([sys.executable, "-m", "infinity.apps.cli", "run", "--num_gpus", str(num_gpus), "--master_port",
                   str(_free_port()), str(tmp_path / script.name), *args, "--deepspeed", str(tmp_path / "ds.json")],
                  tmp_path)


def _plain(tmp_path: Path, args: list[str], script: Path = JOB) -> subprocess.Popen:
    return _start([sys.executable, str(tmp_path / script.name), *args, "--warmup_lr_reference"], tmp_path)


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model every run starts from, built by the script's own code and saved with
    save_pretrained, once: a process that imports transformers takes seconds."""
    where = tmp_path_factory.mktemp("hf_trainer_init")
    shutil.copy(JOB, where / JOB.name)
    code = ("import sys; sys.argv = ['x']\n"
            "from hf_trainer_job import ScriptArguments, build_model, set_seed\n"
            "set_seed(0)\n"
            f"build_model(ScriptArguments()).save_pretrained({str(where / 'init')!r})\n")
    _finish(_start([sys.executable, "-c", code], where), "saving the initial model")
    return where / "init"


@pytest.fixture
def job(tmp_path: Path, initial_model: Path) -> Path:
    """The script and a copy of the initial model, in a directory of the test's own."""
    shutil.copy(JOB, tmp_path / JOB.name)
    shutil.copytree(initial_model, tmp_path / "init")
    return tmp_path


def _compare_runs(plain: Path, ours: Path, *, steps: int) -> dict:
    """The two runs' records: same losses and gradient norms at every step; ours logs
    DeepSpeed's WarmupLR; the saved weights agree and load with from_pretrained."""
    a = json.loads((plain / "record.json").read_text())
    b = json.loads((ours / "record.json").read_text())
    assert a["deepspeed"] is False and b["deepspeed"] is True and b["engine"] == "infinity.engine.engine"
    assert [s["step"] for s in a["steps"]] == [s["step"] for s in b["steps"]] == list(range(1, steps + 1))
    # the same losses without the logits: the chunked loss ([Note: the chunked LM loss]) ran, where
    # the plain run had them (TRL's SFTTrainer computes its loss through a fused head of its own)
    assert b["logits_in_training"] == [False], b
    for x, y in zip(a["steps"], b["steps"]):
        assert abs(x["loss"] - y["loss"]) <= 1e-5, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * max(1.0, x["grad_norm"]), (x, y)
    # DeepSpeed's WarmupLR (log, min 0, W = warmup_steps): the Trainer logs the rate of the next update
    for k, y in enumerate(b["steps"], start=1):
        expected = LR * (math.log(k) / math.log(WARMUP) if k - 1 < WARMUP else 1.0)
        assert abs(y["lr"] - expected) <= 1e-12, (k, y["lr"], expected)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    mine, theirs = load_file(ours / "final" / "model.safetensors"), load_file(plain / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=0)
    loaded = AutoModelForCausalLM.from_pretrained(ours / "final")
    for name, p in loaded.state_dict().items():
        torch.testing.assert_close(p, theirs[name], atol=1e-5, rtol=0)
    return b


def test_trainer_with_the_seeds_zero2_auto_config_matches_pytorch(job):
    """`infinity run job.py ... --deepspeed ds.json`, ZeRO-2 with the optimizer on the CPU."""
    plain, ours = job / "plain", job / "ours"
    runs = [(_plain(job, _trainer_args(plain, micro=4)), "plain run"),
            (_infinity_run(job, _trainer_args(ours, micro=4), ZERO2_AUTO), "infinity run")]
    for proc, what in runs:
        _finish(proc, what)
    _compare_runs(plain, ours, steps=6)


@pytest.mark.slow
def test_trainer_zero3_nvme_accumulating_matches_pytorch_from_pretrained_on(job):
    """ZeRO-3, parameters and optimizer state on NVMe, gradient accumulation 2 (accelerate's
    protocol), the model loaded by from_pretrained under ZeRO-3: its first loss is the plain
    model's (nothing was lost in loading), and every later one matches too."""
    nvme = job / "nvme"
    nvme.mkdir()
    plain, ours = job / "plain", job / "ours"
    runs = [(_plain(job, _trainer_args(plain, micro=2, gas=2)), "plain run"),
            (_infinity_run(job, _trainer_args(ours, micro=2, gas=2), zero3_nvme(nvme)), "infinity run")]
    for proc, what in runs:
        _finish(proc, what)
    _compare_runs(plain, ours, steps=6)


def test_a_baseline_evaluation_then_training_matches_pytorch(job):
    """ZeRO-3 on NVMe with an evaluation before the first step (`--eval_on_start`: the Trainer's
    own baseline evaluation, with the training engine) and one after training: the same
    evaluation losses and training steps as the plain script."""
    nvme = job / "nvme"
    nvme.mkdir()
    plain, ours = job / "plain", job / "ours"
    extra = ("--evaluate_after", "True", "--eval_on_start", "True", "--eval_strategy", "steps", "--eval_steps", "100")
    runs = [(_plain(job, _trainer_args(plain, micro=4, extra=extra)), "plain run"),
            (_infinity_run(job, _trainer_args(ours, micro=4, extra=extra), zero3_nvme(nvme)), "infinity run")]
    for proc, what in runs:
        _finish(proc, what)
    b = _compare_runs(plain, ours, steps=6)
    a = json.loads((plain / "record.json").read_text())
    assert len(a["eval_loss"]) == len(b["eval_loss"]) >= 2 and a["eval_loss"][-1] < a["eval_loss"][0]
    for x, y in zip(a["eval_loss"], b["eval_loss"]):
        assert abs(x - y) <= 1e-5, (a["eval_loss"], b["eval_loss"])


@pytest.mark.slow  # the error path; the supported order (eval_on_start) is tested above in the default run
def test_train_after_a_separate_evaluate_says_what_to_do(job):
    """`trainer.evaluate()` then `trainer.train()` under ZeRO-3: the Trainer trains through the
    evaluation's engine, which accelerate destroyed ([Note: evaluate before train in the HF
    Trainer]); the error says so and names eval_on_start."""
    nvme = job / "nvme"
    nvme.mkdir()
    proc = _infinity_run(job, _trainer_args(job / "ours", micro=4, extra=("--evaluate_first", "True")),
                         zero3_nvme(nvme))
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0 and "destroyed by accelerate's free_memory()" in out and "eval_on_start" in out, \
        out[-4000:]


@pytest.mark.slow
def test_resume_from_checkpoint_is_exact(job):
    """Trainer checkpoints every 3 steps (infinity's engine checkpoint inside); a second run
    resumed from checkpoint-3 logs steps 4-6 exactly as the run that went on."""
    nvme = job / "nvme"
    nvme.mkdir()
    whole, resumed = job / "whole", job / "resumed"
    saving = ("--save_strategy", "steps", "--save_steps", "3")
    _finish(_infinity_run(job, _trainer_args(whole, micro=2, extra=saving), zero3_nvme(nvme)), "whole run")
    checkpoint = whole / "checkpoint-3"
    assert (checkpoint / "latest").is_file()
    _finish(_infinity_run(job, _trainer_args(resumed, micro=2, extra=saving + ("--resume_from_checkpoint",
                                                                                str(checkpoint))),
                          zero3_nvme(nvme)), "resumed run")
    a = json.loads((whole / "record.json").read_text())["steps"]
    b = json.loads((resumed / "record.json").read_text())["steps"]
    assert [s["step"] for s in b] == [4, 5, 6]
    assert b == a[3:]


@pytest.mark.slow
def test_two_gloo_ranks_match_one_plain_process(job):
    """`infinity run --num_gpus 2` on a host without GPUs: two gloo ranks of 2 samples each
    against one plain process of 4."""
    nvme = job / "nvme"
    nvme.mkdir()
    plain, ours = job / "plain", job / "ours"
    runs = [(_plain(job, _trainer_args(plain, micro=4)), "plain run"),
            (_infinity_run(job, _trainer_args(ours, micro=2), zero3_nvme(nvme), num_gpus=2), "infinity run")]
    for proc, what in runs:
        _finish(proc, what)
    assert _compare_runs(plain, ours, steps=6)["world_size"] == 2


@pytest.mark.slow  # two Trainer ranks, as the gloo test above; the engine's two-rank tests stay in the default run
def test_two_ranks_without_use_cpu_agree_on_the_world(job):
    """The seed's command on a CPU-only machine, without --use_cpu: every rank and infinity see a
    world of 2 (HF saw one process each, and train_batch_size did not match), and the run matches
    one plain process of twice the batch."""
    plain, ours = job / "plain", job / "ours"
    args = [a for a in _trainer_args(ours, micro=2) if a != "--use_cpu"]
    runs = [(_plain(job, _trainer_args(plain, micro=4)), "plain run"),
            (_infinity_run(job, args, ZERO2_AUTO, num_gpus=2), "infinity run")]
    for proc, what in runs:
        _finish(proc, what)
    assert _compare_runs(plain, ours, steps=6)["world_size"] == 2


def test_trl_sft_trainer_zero3_nvme_matches_pytorch(job):
    """TRL's SFTTrainer (tests/hf_sft_job.py: HfArgumentParser over SFTConfig, a tokenizer, a
    `datasets.Dataset`) with ZeRO-3, parameters and optimizer state on NVMe, gradient
    accumulation 2, against the same script run plain."""
    pytest.importorskip("trl")
    shutil.copy(SFT_JOB, job / SFT_JOB.name)
    nvme = job / "nvme"
    nvme.mkdir()
    plain, ours = job / "plain", job / "ours"
    fp32 = ("--bf16", "False")  # SFTConfig's bf16 defaults to True (TRL's choice), the Trainer's to False
    runs = [(_plain(job, _trainer_args(plain, micro=2, gas=2, extra=fp32), SFT_JOB), "plain SFT run"),
            (_infinity_run(job, _trainer_args(ours, micro=2, gas=2, extra=fp32), zero3_nvme(nvme), script=SFT_JOB),
             "infinity run of the SFT script")]
    for proc, what in runs:
        _finish(proc, what)
    _compare_runs(plain, ours, steps=6)
