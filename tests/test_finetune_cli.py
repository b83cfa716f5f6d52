"""`infinity finetune`, the main job: the embedded default in reduced size, the loss falling,
and a Hugging Face model fine-tuned with LoRA, saved, resumed and exported."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from infinity.apps.cli import main


def test_default_job_runs_and_shows_the_table(capsys, tmp_path):
    assert main(["finetune", "--steps", "3", "--sample-tokens", "4", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sample before:" in out and "sample after:" in out
    for row in ("device (gathered units, peak)", "host (pinned pools)", "NVMe (parameter and optimizer files)",
                "moved per step", "I/O hidden behind compute"):
        assert row in out
    assert "{" not in out.split("what lived where")[1]  # a table, not a JSON dump
    assert not list(tmp_path.iterdir())  # the offload files went with the run


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def test_metrics_split_each_step_into_reads_writes_and_waits(tmp_path):
    """--metrics: per step the NVMe bytes read and written (their sum is `nvme_bytes`) and the
    compute thread's waits; what the steps claim to have read and written is no more than the
    kernel counted for the process (/proc/self/io), which also saw the model's first write."""
    metrics = tmp_path / "m.json"
    before = _proc_io()
    assert main(["finetune", "--steps", "3", "--sample-tokens", "0", "--nvme-path", str(tmp_path),
                 "--metrics", str(metrics)]) == 0
    after = _proc_io()
    m = json.loads(metrics.read_text())
    assert len(m["nvme_read_bytes"]) == len(m["nvme_write_bytes"]) == len(m["io_wait_s"]) == 3
    assert [r + w for r, w in zip(m["nvme_read_bytes"], m["nvme_write_bytes"])] == m["nvme_bytes"]
    # The first step reads the state; every step writes the new values. The later ones may read
    # nothing: the units the backward takes first are still in memory, their writes held for it
    # ([Note: parameter writes held for the backward] in infinity/offload/held_writes.py).
    assert m["nvme_read_bytes"][0] > 0 and all(w > 0 for w in m["nvme_write_bytes"])
    assert all(0 <= s <= t for s, t in zip(m["io_wait_s"], m["step_s"]))
    assert sum(m["nvme_read_bytes"]) <= after["read_bytes"] - before["read_bytes"]
    assert sum(m["nvme_write_bytes"]) <= after["write_bytes"] - before["write_bytes"]


def test_trace_writes_a_timeline_of_the_steps(tmp_path):
    """--trace: a Chrome trace whose compute-thread slices and NVMe transfers lie in steps 2-4, with a
    forward and a backward phase per step, the optimizer state's reads (the first updates run in
    step 2's forward) and the parameters' write-back (the default config keeps parameters cached in
    host memory: no reads); its optimizer pool holds the whole state, so that is never written
    back ([Note: the pool is a budget] in offload/optimizer/sizing.py)."""
    trace = tmp_path / "t" / "trace.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assert main(["finetune", "--steps", "5", "--sample-tokens", "0", "--nvme-path", str(nvme),
                 "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    phases = [e["name"] for e in events if e.get("cat") == "phase"]
    assert phases.count("forward") >= 3 and phases.count("backward") == 3 and phases.count("step") == 3
    tracks = {e["cat"] for e in events if e["ph"] == "b"}
    assert {"offload_param writes", "offload_optimizer reads", "units"} <= tracks
    assert "offload_optimizer writes" not in tracks
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_gradient_checkpointing_trains_the_same_steps(tmp_path):
    """--gradient-checkpointing: each layer of the built-in model recomputed in backward gives the
    losses of the run without it, bit for bit, and the built-in config spills the kept inputs."""
    from infinity.apps.finetune_config import _default_config

    losses = []
    for flag in ([], ["--gradient-checkpointing"]):
        metrics = tmp_path / f"m{len(flag)}.json"
        assert main(["finetune", "--steps", "3", "--sample-tokens", "0", "--nvme-path", str(tmp_path),
                     "--metrics", str(metrics), *flag]) == 0
        losses.append(json.loads(metrics.read_text())["loss"])
    assert losses[0] == losses[1] and len(losses[0]) == 3
    # the same model and config as the flag builds: after forward, each layer's input is in a file
    import infinity
    from infinity.apps.finetune import _gradient_checkpointing
    from infinity.apps.finetune_model import DEFAULT_MODEL
    from infinity.apps.models.llama import Llama

    spill = tmp_path / "spill"
    spill.mkdir()
    with infinity.Init():
        model = Llama(dict(DEFAULT_MODEL))
    _gradient_checkpointing(model)
    config, _ = _default_config(str(spill), "nvme", 1, 1e-4, model, checkpointing=True)
    assert config["activation_checkpointing"] == {"nvme_path": str(spill)}
    config["activation_checkpointing"]["nvme_min_bytes"] = 1
    engine, *_ = infinity.initialize(model=model, config=config)
    ids = torch.randint(0, 257, (1, 64))
    loss = engine(ids, ids)
    on_disk = sum(f.stat().st_size for d in spill.glob("infinity-*-activations") for f in d.rglob("*") if f.is_file())
    assert on_disk >= 8 * 64 * 256 * 2, sorted(str(f) for f in spill.rglob("*"))
    engine.backward(loss)
    engine.close()


@pytest.mark.slow
def test_default_job_loss_falls(capsys, tmp_path):
    assert main(["finetune", "--steps", "40", "--sample-tokens", "0", "--nvme-path", str(tmp_path)]) == 0
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", capsys.readouterr().out).groups())
    # ln(257) = 5.55 nats at the start; byte statistics alone bring a model well below it
    assert first > 5.0 and last < first - 0.5


transformers = pytest.importorskip("transformers")


def test_hf_model_with_lora_save_resume_export(capsys, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    original = transformers.LlamaForCausalLM(cfg)
    original.save_pretrained(tmp_path / "hf")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join('{"text": "def f(x):\\n    return x * %d\\n"}' % i for i in range(200)))
    common = ["finetune", "--model", str(tmp_path / "hf"), "--data", str(data), "--lora", "4", "--seq-len", "32",
              "--sample-tokens", "0", "--save", str(tmp_path / "ckpt"), "--nvme-path", str(tmp_path), "--lr", "1e-2"]
    assert main([*common, "--steps", "3"]) == 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step3"
    assert main([*common, "--steps", "5", "--resume", str(tmp_path / "ckpt"), "--export", str(tmp_path / "out")]) == 0
    assert "resumed from" in capsys.readouterr().out
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # LoRA merged, no adapter tensors left
    before = original.state_dict()
    after = tuned.state_dict()
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"].to(after["model.layers.0.self_attn.q_proj.weight"].dtype))
    assert torch.equal(after["model.norm.weight"].float(), before["model.norm.weight"])  # frozen, not adapted


# ---- what a run leaves on disk ----------------------------------------------------------------


def tiny_hf_model(directory, vocab: int = 300, tokenizer_vocab: int = 0) -> str:
    """A 2-layer Llama saved in Hugging Face's layout; with a byte-level BPE tokenizer of
    `tokenizer_vocab` entries beside it when that is not 0."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    if tokenizer_vocab:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=tokenizer_vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([TEXT] * 4, trainer)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                             eos_token="</s>").save_pretrained(directory)
    return str(directory)


TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(60))


@pytest.fixture
def job(tmp_path):
    """Arguments of a run that takes a second: a tiny Llama directory, a small text file, an
    NVMe directory of its own."""
    (tmp_path / "data.txt").write_text(TEXT)
    (tmp_path / "nvme").mkdir()
    return ["finetune", "--model", tiny_hf_model(tmp_path / "hf"), "--data", str(tmp_path / "data.txt"),
            "--seq-len", "32", "--sample-tokens", "0", "--nvme-path", str(tmp_path / "nvme")]


def start_job(argv: list[str], nvme, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """`infinity finetune` in a process of its own, returned once its NVMe stores are open."""
    # Run from the NVMe directory: a checkout's root would shadow the installed package (CI).
    # PYTHONFAULTHANDLER: a SIGABRT makes it print every thread's stack (`wait_or_show`)
    proc = subprocess.Popen([sys.executable, "-m", "infinity.apps.cli", *argv], stdout=subprocess.DEVNULL, cwd=nvme,
                            stderr=stderr, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while len(glob.glob(f"{nvme}/**/rank0.lock", recursive=True)) < 2:  # parameters and optimizer state
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended before its stores opened"
        time.sleep(0.1)
    return proc


def wait_or_show(proc: subprocess.Popen, stderr, timeout: float = 60) -> int:
    """The job's exit status; a job still running after `timeout` seconds fails the test with
    its threads' stacks (faulthandler, on SIGABRT) instead of living on past it."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.flush()
        with open(stderr.name) as f:
            pytest.fail(f"the job had not ended {timeout} s after the signal; its stacks:\n{f.read()[-20000:]}")


def test_what_kill_9_leaves_is_reclaimed_under_the_nvme_path(job, tmp_path, capsys):
    nvme = tmp_path / "nvme"
    proc = start_job([*job, "--steps", "100000"], nvme)
    proc.kill()
    proc.wait()
    assert os.listdir(nvme)  # nothing ran: the files stay
    assert main(["clean", str(nvme), "--dry-run"]) == 0
    assert capsys.readouterr().out.count("stale") == 3  # both stores listed, then the summary
    assert main([*job, "--steps", "1"]) == 0  # the next run on the same --nvme-path removes them
    assert os.listdir(nvme) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_without_save_leaves_nothing(job, tmp_path, signum):
    nvme = tmp_path / "nvme"
    with open(tmp_path / "stderr", "w") as err:
        proc = start_job([*job, "--steps", "100000"], nvme, stderr=err)
        proc.send_signal(signum)
        code = wait_or_show(proc, err)
    assert code != 0
    assert os.listdir(nvme) == []
    if signum == signal.SIGINT:  # Ctrl-C: one line, not a KeyboardInterrupt traceback
        said = (tmp_path / "stderr").read_text()
        assert code == 130 and "infinity finetune: interrupted" in said and "Traceback" not in said, said


# ---- save, export ------------------------------------------------------------------------------


def test_export_carries_the_tokenizer(tmp_path):
    (tmp_path / "data.txt").write_text(TEXT)
    model = tiny_hf_model(tmp_path / "hf", tokenizer_vocab=280)
    assert main(["finetune", "--model", model, "--data", str(tmp_path / "data.txt"), "--seq-len", "32",
                 "--sample-tokens", "0", "--steps", "1", "--nvme-path", str(tmp_path),
                 "--export", str(tmp_path / "out")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(model)
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")  # not the byte tokenizer's fallback
    assert ours.get_vocab() == theirs.get_vocab() and ours.encode(TEXT[:200]) == theirs.encode(TEXT[:200])
    assert ours.eos_token == "</s>"


def test_the_last_checkpoint_is_written_once(job, tmp_path, monkeypatch):
    from infinity.engine import Engine

    saved = []
    real = Engine.save_checkpoint

    def save_checkpoint(engine, save_dir, *args, **kwargs):
        saved.append(engine.global_steps)
        return real(engine, save_dir, *args, **kwargs)

    monkeypatch.setattr(Engine, "save_checkpoint", save_checkpoint)
    assert main([*job, "--steps", "4", "--save-every", "2", "--save", str(tmp_path / "ckpt")]) == 0
    assert saved == [2, 4]
    assert main([*job, "--steps", "5", "--save-every", "2", "--save", str(tmp_path / "ckpt")]) == 0
    assert saved == [2, 4, 2, 4, 5]


# ---- bad input: one line naming the flag, before the model is built ---------------------------


def finetune(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `infinity finetune`."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc: int, out: str, err: str, flag: str, said: str) -> None:
    """Exit 2 with one line naming the flag, nothing built and nothing trained (no `model:` line)."""
    assert rc == 2, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"infinity finetune: {flag}"), err
    assert said in err
    assert "model:" not in out


@pytest.mark.parametrize("flag,target,said", [
    ("--save", "FILE", "not a directory"),
    ("--export", "FILE", "not a directory"),
    ("--save", "/proc/infinity-x", "cannot create files in /proc"),
    ("--export", "/proc/infinity-x", "cannot create files in /proc"),
    ("--trace", "DIR", "is a directory"),
    ("--trace", "/proc/infinity-x/t.json", "cannot create files in /proc"),
    ("--plot", "DIR", "is a directory")])
def test_bad_destinations_are_refused_before_the_run(job, tmp_path, capsys, flag, target, said):
    path = {"FILE": str(tmp_path / "data.txt"), "DIR": str(tmp_path / "nvme")}.get(target, target)
    rc, out, err = finetune([*job, "--steps", "1", flag, path], capsys)
    assert_refused(rc, out, err, flag, said)
    assert os.listdir(tmp_path / "nvme") == []  # no stray trace file, nothing offloaded


@pytest.mark.parametrize("case,flag,said", [
    ("resume_missing", "--resume", "not a directory"),
    ("resume_empty", "--resume", "no checkpoint"),
    ("small_vocabulary", "--model", "too small for the byte tokenizer"),
    ("not_utf8", "--data", "not UTF-8 text"),
    ("tokenizer_too_big", "--model", "beyond the model's vocabulary of 200")])
def test_bad_inputs_are_one_line_naming_the_flag_before_the_model_is_built(job, tmp_path, capsys, case, flag, said):
    argv = [*job, "--steps", "1"]
    if case == "resume_missing":
        argv += ["--resume", str(tmp_path / "nowhere")]
    elif case == "resume_empty":
        argv += ["--resume", str(tmp_path / "nvme")]
    elif case == "small_vocabulary":
        argv += ["--model", tiny_hf_model(tmp_path / "small", vocab=100)]
    elif case == "not_utf8":
        (tmp_path / "bad.txt").write_bytes(TEXT.encode() + b"\xff\xfe")
        argv += ["--data", str(tmp_path / "bad.txt")]
    else:
        argv += ["--model", tiny_hf_model(tmp_path / "big", vocab=200, tokenizer_vocab=400)]
    capsys.readouterr()  # what saving the model printed
    assert_refused(*finetune(argv, capsys), flag, said)


def test_nvme_path_with_a_config_is_refused(job, tmp_path, capsys):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    rc, out, err = finetune([*job, "--steps", "1", "--config", str(tmp_path / "ds.json")], capsys)
    assert_refused(rc, out, err, "--nvme-path", "--config")
    without = [a for a in job if a not in ("--nvme-path", str(tmp_path / "nvme"))]
    assert main([*without, "--steps", "1", "--config", str(tmp_path / "ds.json")]) == 0  # the config's own places


def test_resume_at_or_past_steps_says_there_is_nothing_to_train(job, tmp_path, capsys):
    assert main([*job, "--steps", "2", "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main([*job, "--steps", "2", "--resume", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "--steps 2: the checkpoint is at step 2 already; nothing to train" in out


def test_the_built_in_config_is_sized_by_the_largest_unit_and_the_machine_not_the_vocabulary():
    """[Note: the built-in config's host budget]: two models alike but for a 32k and a 256k
    vocabulary get the same parameter pool and pieces (the embedding and head are tiles no larger
    than a layer); the optimizer pool and the accumulators share the rest, and the budget follows
    the machine."""
    import infinity
    from infinity.apps.finetune import TILE_SIZE, _default_config, largest_unit_numel
    from infinity.apps.models.llama import Llama

    def preset(vocab: int) -> dict:
        return {"vocab_size": vocab, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
                "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 64,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}

    gib = 1 << 30
    chosen = {}
    for vocab in (32000, 256000):
        with infinity.Init():
            model = Llama(preset(vocab))
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        assert largest_unit_numel(model) == max(layer, TILE_SIZE)
        config, said = _default_config("/nvme", "nvme", 1, 1e-4, model, total_memory=24 * gib)
        zero = config["zero_optimization"]
        chosen[vocab] = (zero["offload_param"], zero["offload_optimizer"], zero["sub_group_size"])
        assert "aio" not in config  # the disk's measured setting
        assert "host budget 4.8 GiB" in said and "largest unit" in said
        piece = min(int(1.5 * zero["sub_group_size"]), largest_unit_numel(model, trainable=True))
        param = zero["offload_param"]
        assert 4 <= param["buffer_count"] <= 6 and param["buffer_size"] >= largest_unit_numel(model)
        assert zero["stage3_max_live_parameters"] == 2 * param["buffer_size"]
        pools = param["buffer_count"] * param["buffer_size"] * 2 + zero["offload_optimizer"]["buffer_count"] * piece * 4
        # bf16 accumulators: one pass a step ([Note: one pass keeps its own dtype])
        assert pools + 2 * zero["offload_optimizer"]["max_grad_in_cpu"] <= 24 * gib // 5
    # the parameter pool and the pieces follow the largest unit, not the vocabulary; the optimizer
    # pool grows with the state (up to the budget), and the accumulators get what it leaves
    assert chosen[32000][0] == chosen[256000][0] and chosen[32000][2] == chosen[256000][2]
    assert chosen[32000][1]["buffer_count"] <= chosen[256000][1]["buffer_count"]
    assert chosen[32000][1]["max_grad_in_cpu"] >= chosen[256000][1]["max_grad_in_cpu"]
    small, _ = _default_config("/nvme", "nvme", 1, 1e-4, model, total_memory=12 * gib)
    big, _ = _default_config("/nvme", "nvme", 1, 1e-4, model, total_memory=48 * gib)
    pools = [c["zero_optimization"]["offload_optimizer"]["buffer_count"] for c in (small, big)]
    assert pools[0] < pools[1]  # the optimizer pool first ([Note: the built-in config's host budget])


def test_the_built_in_optimizer_pool_comes_before_the_gradient_accumulators():
    """[Note: the built-in config's host budget]: a state larger than the budget gives the
    optimizer pool all the budget the parameter pool leaves, and every gradient spills; a state
    the budget holds gives the pool the whole state and a pipeline, and the accumulators the rest."""
    from infinity.apps.finetune import OPTIMIZER_BUFFERS, builtin_budget

    gib = 1 << 30
    # llama-3b's shapes on a 24 GiB machine: a layer of 100.7M elements, 3.2B trained
    budget, count, largest, piece, buffers, grads = builtin_budget(24 * gib, 100_700_000, 100_700_000, 3_213_000_000)
    pools = count * largest * 2 + buffers * piece * 4
    assert buffers > 2 * OPTIMIZER_BUFFERS and pools <= budget < pools + piece * 4 and grads == (budget - pools) // 2
    assert grads < piece  # what the pool leaves is less than one of its buffers
    # a 60M model of 10M units: its buffers are sub-groups (25M elements: the tier counts buffer_count
    # so where the state is larger than one), as many as its whole state (3 x 60M fp32, a quarter
    # more for the cut's waste) and 12 besides; the rest to the accumulators
    budget, count, largest, piece, buffers, grads = builtin_budget(24 * gib, 10_000_000, 10_000_000, 60_000_000)
    assert piece == 25_000_000 and buffers == 9 + OPTIMIZER_BUFFERS
    assert grads == (budget - count * largest * 2 - buffers * piece * 4) // 2 and grads > 60_000_000
    # a budget short of the least pool still gets it (a piece reading, updating, writing of each kind)
    assert builtin_budget(2 * gib, 100_700_000, 100_700_000, 3_213_000_000)[4] == OPTIMIZER_BUFFERS
