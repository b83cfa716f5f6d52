"""accelerate's own launcher and loop with `deepspeed` as infinity ([Note: the alias from the
environment] in infinity/deepspeed/_alias.py): `INFINITY_AS_DEEPSPEED=1 accelerate launch
--use_deepspeed ...` (or an accelerate config file with `distributed_type: DEEPSPEED`) runs
tests/accelerate_job.py, unchanged, on infinity, and its losses are the plain `accelerate launch
--cpu` run's; without the variable nothing changes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

JOB = Path(__file__).with_name("accelerate_job.py")


def _accelerate(cwd: Path, args: list[str], alias: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "INFINITY_AS"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HOME=str(cwd / "hf"))
    if alias is not None:
        env["INFINITY_AS_DEEPSPEED"] = alias
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no"]
    return subprocess.run(launcher + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    shutil.copy(JOB, tmp_path / JOB.name)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "init")
    (tmp_path / "nvme").mkdir()
    return tmp_path


def _ds_config(job: Path, stage: int) -> Path:
    nvme = {"device": "nvme", "nvme_path": str(job / "nvme")}
    zero = {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme} if stage == 3 else \
        {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    path = job / f"ds{stage}.json"
    # ZeRO-2's config as DeepSpeed's older examples write it, with the legacy "bfloat16" section:
    # accelerate adds "bf16" beside it, which agrees
    legacy = {"bfloat16": {"enabled": False}} if stage == 2 else {}
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "gradient_clipping": 0.0, "zero_optimization": zero, **legacy}))
    return path


def _record(job: Path, name: str, done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return json.loads((job / name).read_text())


@pytest.mark.parametrize("stage,how", [pytest.param(3, "flags", marks=pytest.mark.slow),
                                       pytest.param(2, "flags", marks=pytest.mark.slow), (3, "config_file")])
def test_accelerate_launch_with_deepspeed_matches_the_plain_launch(job, stage, how):
    """ZeRO-3 with parameters and optimizer state on NVMe (the model from `from_pretrained` under
    zero.Init, torch's AdamW turned into DeepSpeedCPUAdam by accelerate), and ZeRO-2 with the
    optimizer on the CPU: the loop's losses are the plain launch's at 1e-5."""
    script = [str(job / JOB.name), str(job / "init")]
    plain = _record(job, "plain.json", _accelerate(job, ["--cpu", *script, str(job / "plain.json")], None))
    ds = _ds_config(job, stage)
    if how == "flags":
        launch = ["--use_deepspeed", "--deepspeed_config_file", str(ds)]
    else:
        (job / "accelerate.yaml").write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 1\n"
            f"deepspeed_config:\n  deepspeed_config_file: {ds}\n  zero3_init_flag: true\n")
        launch = ["--config_file", str(job / "accelerate.yaml")]
    ours = _record(job, "ours.json", _accelerate(job, [*launch, *script, str(job / "ours.json")], "1"))
    assert plain["deepspeed"] is None and ours["deepspeed"] == "infinity.deepspeed"
    assert ours["model"] == "infinity.engine.engine"
    assert len(ours["losses"]) == len(plain["losses"]) == 4
    for a, b in zip(plain["losses"], ours["losses"]):
        assert abs(a - b) <= 1e-5, (plain["losses"], ours["losses"])
    assert os.listdir(job / "nvme") == []  # the run's offload files went with it


def test_without_the_variable_nothing_changes(job):
    """No INFINITY_AS_DEEPSPEED (or 0): accelerate finds no DeepSpeed, as before infinity."""
    ds = _ds_config(job, 2)
    for alias in (None, "0"):
        done = _accelerate(job, ["--use_deepspeed", "--deepspeed_config_file", str(ds), str(job / JOB.name),
                                 str(job / "init"), str(job / "x.json")], alias)
        assert done.returncode != 0 and "DeepSpeed is not installed" in done.stderr, done.stderr[-3000:]


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INFINITY_AS")}, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


PROBE = ("import importlib.metadata, deepspeed; "
         "print(deepspeed.__name__, importlib.metadata.version('deepspeed'))")


def test_the_variable_turns_the_alias_on_in_any_python_process(tmp_path):
    """A plain `python` started with INFINITY_AS_DEEPSPEED=1 imports infinity as deepspeed, with
    its distribution metadata, and so do the processes it starts; 0 leaves it off; another
    value is reported and leaves it off."""
    on = _python(PROBE, {"INFINITY_AS_DEEPSPEED": "1"}, tmp_path)
    assert on.returncode == 0 and on.stdout.split() == ["infinity.deepspeed", "0.19.8"], on.stderr[-2000:]
    child = _python(f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PROBE!r}], check=True)",
                    {"INFINITY_AS_DEEPSPEED": "1"}, tmp_path)
    assert child.returncode == 0 and child.stdout.split()[0] == "infinity.deepspeed", child.stderr[-2000:]
    off = _python(PROBE, {"INFINITY_AS_DEEPSPEED": "0"}, tmp_path)
    assert off.returncode != 0 and "No module named 'deepspeed'" in off.stderr
    odd = _python(PROBE, {"INFINITY_AS_DEEPSPEED": "maybe"}, tmp_path)
    assert "INFINITY_AS_DEEPSPEED='maybe': expected 1" in odd.stderr and "No module named 'deepspeed'" in odd.stderr


def test_an_installed_deepspeed_is_not_shadowed_silently(tmp_path):
    """With a `deepspeed` package on the path and the variable set, one line on stderr names the
    package that is not used (once for the process tree), and `import deepspeed` is infinity."""
    real = tmp_path / "site" / "deepspeed"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("raise RuntimeError('the real one was imported')\n")
    env = {"INFINITY_AS_DEEPSPEED": "1", "PYTHONPATH": str(tmp_path / "site")}
    done = _python(f"import subprocess, sys; {PROBE}; subprocess.run([sys.executable, '-c', {PROBE!r}], check=True)",
                   env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[::2] == ["infinity.deepspeed", "infinity.deepspeed"]
    notes = [line for line in done.stderr.splitlines() if "is not used" in line]
    assert len(notes) == 1 and str(real) in notes[0], done.stderr


def test_a_cpu_adam_over_parameters_not_yet_built_takes_them_and_refuses_a_step():
    """accelerate builds DeepSpeedCPUAdam over parameters still on meta (from_pretrained under
    zero.Init) before `initialize`: accepted, as DeepSpeed's does; stepping it is refused."""
    import infinity
    from infinity.optim import DeepSpeedCPUAdam

    with infinity.Init():
        layer = torch.nn.Linear(4, 4)
    opt = DeepSpeedCPUAdam(layer.parameters(), lr=1e-3)
    for p in layer.parameters():
        p.grad = torch.zeros(p.shape, device="meta")
    with pytest.raises(TypeError, match="must be a CPU tensor, got device meta"):
        opt.step()
