"""Bad input is refused before any work, with one line naming the flag (issue #30, section 4):
the command-line tools must exit non-zero without a traceback, without files under the NVMe path
and without building the model (the first case of each tool in a process of its own, as a user
runs it; the others through the same `main` in this process, which spares each the two seconds a
process takes to import torch); a model whose engine was closed is refused by
`infinity.initialize` with what to do instead."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import infinity


def run_tool(module: str, argv: list[str], cwd, capsys=None) -> subprocess.CompletedProcess:
    """`python -m module argv` from `cwd` (a checkout's root would shadow the installed package);
    with `capsys`, the module's `main(argv)` in this process, reported the same way."""
    if capsys is None:
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, capture_output=True, text=True,
                              timeout=300)
    capsys.readouterr()  # what the test printed before
    try:
        code = importlib.import_module(module).main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # SystemExit("message"): the interpreter prints it and exits 1
        err, code = err + code + "\n", 1
    return subprocess.CompletedProcess([module, *argv], code or 0, out, err)


def assert_one_line_naming(done: subprocess.CompletedProcess, flag: str, said: str) -> None:
    err = done.stderr.strip()
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert flag in err and said in err, err


# ---- aio_bench_sweep ----------------------------------------------------------------------------


SWEEP_REFUSALS = [
    (["--block-sizes", "3"], "--block-sizes", "multiple of 4096"),  # was a ValueError traceback
    (["--block-sizes", "1M", "6000"], "--block-sizes", "multiple of 4096"),  # measured as 8K, reported as 6000
    (["--block-sizes", "2G"], "--block-sizes", "block_size <= 1073741824"),
    (["--queue-depths", "5000"], "--queue-depths", "queue_depth <= 1024"),
    (["--threads", "1000"], "--threads", "thread_count <= 256"),
    (["--queue-depths", "four"], "--queue-depths", "expected an integer"),
    (["--io-size", "1000"], "--io-size", "multiple of 4096"),  # partly buffered: not what the sweep times
    (["--io-size", "8M", "--block-sizes", "4K", "--engines", "psync", "--repeat", "0"], "--repeat", "at least 1"),
]


@pytest.mark.parametrize("argv,flag,said", SWEEP_REFUSALS)
def test_sweep_refuses_bad_values_in_one_line_before_any_work(tmp_path, capsys, argv, flag, said):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    in_process = capsys if (argv, flag, said) != SWEEP_REFUSALS[0] else None
    done = run_tool("infinity.apps.tools.aio_bench_sweep", ["--nvme-path", str(nvme), "--quick", *argv], tmp_path,
                    in_process)
    assert_one_line_naming(done, flag, said)
    assert done.returncode == 2
    assert os.listdir(nvme) == []


def test_sweep_refuses_an_io_size_beyond_memory_before_writing(tmp_path, monkeypatch, capsys):
    from infinity.apps.tools import aio_bench_sweep

    monkeypatch.setattr(aio_bench_sweep, "_memory_available", lambda: 64 << 20)
    with pytest.raises(SystemExit) as exit_:
        aio_bench_sweep.main(["--nvme-path", str(tmp_path), "--io-size", "128M", "--block-sizes", "1M",
                              "--queue-depths", "4", "--threads", "1", "--engines", "psync"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--io-size" in err and "memory" in err, err
    assert os.listdir(tmp_path) == []


def test_sweep_refuses_an_engine_this_kernel_lacks(tmp_path, monkeypatch, capsys):
    from infinity.apps.tools import aio_bench_sweep

    monkeypatch.setattr(aio_bench_sweep, "available_engines", lambda: ["aio", "psync"])
    with pytest.raises(SystemExit) as exit_:
        aio_bench_sweep.main(["--nvme-path", str(tmp_path), "--quick", "--io-size", "8M", "--engines", "io_uring"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engines io_uring" in err and "aio, psync" in err, err
    assert os.listdir(tmp_path) == []


def test_sweep_grid_falls_back_to_psync_where_it_is_the_only_engine(monkeypatch):
    from infinity.apps.tools import aio_bench_sweep

    monkeypatch.setattr(aio_bench_sweep, "available_engines", lambda: ["psync"])
    args = argparse.Namespace(quick=False, block_sizes=None, queue_depths=None, threads=None, single_submit=None,
                              overlap_events=None, engines=None)
    assert {s.engine for s in aio_bench_sweep._grid(args)} == {"psync"}  # was an empty grid, then IndexError


# ---- infinity finetune --------------------------------------------------------------------------


def finetune(tmp_path, *argv: str, capsys=None) -> subprocess.CompletedProcess:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    (tmp_path / "data.txt").write_text("def f(x):\n    return x + 1\n\n" * 40)
    return run_tool("infinity.apps.cli", ["finetune", "--data", str(tmp_path / "data.txt"), "--steps", "1",
                                     "--sample-tokens", "0", "--nvme-path", str(nvme), *argv], tmp_path, capsys)


FINETUNE_REFUSALS = [
    # above the preset's 512 positions: trained silently on positions the model never had
    (["--model", "llama-tiny", "--seq-len", "513"], "--seq-len 513", "max_position_embeddings 512"),
    (["--seq-len", "1000000"], "--seq-len 1000000", "max_position_embeddings 1024"),  # the built-in model
    # 9 TB of activations at the least: an allocator failure after the engine was built
    (["--model", "llama-1b", "--seq-len", "131072", "--batch", "64"], "--seq-len 131072", "activations"),
    (["--model", "llama-tiny", "--lora", "1000000000000"], "--lora 1000000000000", "at most 128"),
    (["--seed", str(2**64)], "--seed", "expected an integer"),
    (["--steps", "many"], "--steps", "expected a positive integer"),
]


@pytest.mark.parametrize("argv,flag,said", FINETUNE_REFUSALS)
def test_finetune_refuses_bad_sizes_in_one_line_before_the_model_is_built(tmp_path, capsys, argv, flag, said):
    done = finetune(tmp_path, *argv, capsys=capsys if (argv, flag, said) != FINETUNE_REFUSALS[0] else None)
    err = done.stderr.strip()
    assert done.returncode == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].find(flag) >= 0 and said in err, err
    if not flag.startswith(("--seed", "--steps")):  # argparse's own errors come after its usage line
        assert_one_line_naming(done, flag, said)
    assert "model:" not in done.stdout  # nothing was built
    assert os.listdir(tmp_path / "nvme") == []


def test_finetune_refuses_a_sample_beyond_learned_positions(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    # an IndexError in the position embedding while sampling, after the model was built
    done = finetune(tmp_path, "--model", str(tmp_path / "gpt2"), "--seq-len", "32", "--sample-tokens", "100",
                    capsys=capsys)
    assert_one_line_naming(done, "--sample-tokens 100", "max_position_embeddings 40")
    assert "model:" not in done.stdout and os.listdir(tmp_path / "nvme") == []


def test_finetune_size_checks_pass_what_fits():
    from infinity.apps.data import ByteTokenizer
    from infinity.apps.finetune import DEFAULT_MODEL, check_model_sizes
    from infinity.apps.models.presets import preset

    class Args:
        model, config, batch, seq_len, lora, sample_tokens = None, None, 4, 1024, 128, 48

    check_model_sizes(Args, dict(DEFAULT_MODEL), ByteTokenizer())  # the built-in model at its longest
    Args.batch, Args.seq_len, Args.lora = 1, 4096, 0
    check_model_sizes(Args, preset("llama-7b"), ByteTokenizer())  # 4.7 GB at the least: not refused here
    # 32k tokens of llama-1b: 10.7 GB of layer inputs; the logits (25 GB more) are never whole
    # with the chunked loss, so not refused on this 24 GiB machine (they were counted before)
    Args.seq_len = 32768
    check_model_sizes(Args, preset("llama-1b"), ByteTokenizer())


# ---- infinity.initialize on a closed engine's model ---------------------------------------------


CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def offloaded(tmp_path, device: str) -> dict:
    place = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
    optimizer = {**place, "buffer_count": 9} if device == "nvme" else place  # the fewest it takes without a warning
    return {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], "offload_param": place,
                                            "offload_optimizer": optimizer}}


@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_initialize_on_a_closed_engines_model_says_to_build_it_again(tmp_path, device):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    engine, *_ = infinity.initialize(model=model, config=offloaded(tmp_path, device))
    engine.close()
    # nvme: "layout: expected a non-empty mapping ..."; cpu: an engine over empty parameters
    with pytest.raises(ValueError, match=r"model: its parameters were released by engine\.close\(\).*build"):
        infinity.initialize(model=model, config=offloaded(tmp_path, device))
    assert os.listdir(tmp_path) == []


def test_initialize_on_a_live_engines_model_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    engine, *_ = infinity.initialize(model=model, config=CONFIG)
    try:
        with pytest.raises(ValueError, match=r"model: its parameters are partitioned by a live engine"):
            infinity.initialize(model=model, config=CONFIG)  # was an engine over empty parameters
        out = engine(torch.ones(1, 16))  # the first engine is untouched
        assert out.shape == (1, 2)
    finally:
        engine.close()


def test_a_model_built_again_after_close_runs(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    engine, *_ = infinity.initialize(model=model, config=CONFIG)
    engine.close()
    torch.manual_seed(0)
    again = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    reference = again(torch.ones(1, 16)).detach()
    engine, *_ = infinity.initialize(model=again, config=CONFIG)
    try:
        torch.testing.assert_close(engine(torch.ones(1, 16)).detach(), reference)
    finally:
        engine.close()
