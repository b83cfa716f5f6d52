"""Checkpoints: exact resume in a fresh process, re-sharding across world sizes and placements,
crash safety under SIGKILL, checksums, saving from a SIGTERM handler, and export to a Hugging
Face model directory, each checked against an uninterrupted run or the plain model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import infinity
from infinity.checkpoint import CheckpointError
from infinity.checkpoint.layout import LATEST, MANIFEST_CRC, Manifest, manifest_crc, shard_file, state_file

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "ckpt_job.py")


def job(mode: str, tmp_path, *args: str, world: int = 1, timeout: int = 300) -> dict:
    """Runs tests/ckpt_job.py in a fresh process (torchrun for two ranks); its last JSON line."""
    if world == 1:
        cmd = [sys.executable, JOB]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(_free_port()), JOB]
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    out = subprocess.run([*cmd, mode, "--nvme", str(nvme), *args], capture_output=True, text=True, cwd=tmp_path,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[:6000]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_step(result: dict) -> dict[int, float]:
    return {int(k): v for k, v in result["losses"].items()}


def _assert_values_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(torch.tensor(a[name]), torch.tensor(b[name]), atol=tol, rtol=tol, msg=name)


# ---- exact resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["nvme/nvme",  # the default run keeps the one with every tier below
                                       pytest.param("cpu/cpu", marks=pytest.mark.slow),
                                       pytest.param("none/none", marks=pytest.mark.slow)])
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, placement):
    whole = job("run", tmp_path, "--placement", placement, "--steps", "6")
    job("save", tmp_path, "--placement", placement, "--steps", "3", "--save", str(tmp_path / "ckpt"))
    resumed = job("resume", tmp_path, "--placement", placement, "--steps", "6", "--save", str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == "global_step3"
    assert _by_step(resumed) == {k: v for k, v in _by_step(whole).items() if k >= 3}
    assert resumed["digest"] == whole["digest"]  # masters of every parameter, to the bit


@pytest.mark.slow  # the control of the test above: it shows the test can fail
def test_resume_without_the_rng_state_would_differ(tmp_path):
    """The dropout in the job makes the test above see the RNG: a resume from a checkpoint whose
    RNG state was replaced by another one's does not match."""
    whole = job("run", tmp_path, "--placement", "cpu/cpu", "--steps", "5")
    ckpt = tmp_path / "ckpt"
    job("save", tmp_path, "--placement", "cpu/cpu", "--steps", "3", "--save", str(ckpt))
    path = ckpt / "global_step3" / state_file(0)
    state = torch.load(path, weights_only=True)
    state["rng"]["torch"] = torch.manual_seed(99).get_state()
    torch.save(state, path)
    manifest = json.loads((ckpt / "global_step3" / "manifest.json").read_text())
    from infinity.checkpoint.files import crc_of_file
    size, crc = crc_of_file(str(path))
    manifest["files"][state_file(0)] = {"bytes": size, "crc32": crc}
    manifest[MANIFEST_CRC] = manifest_crc(manifest)  # a consistent checkpoint whose RNG state is another's
    (ckpt / "global_step3" / "manifest.json").write_text(json.dumps(manifest))
    resumed = job("resume", tmp_path, "--placement", "cpu/cpu", "--steps", "5", "--save", str(ckpt))
    assert _by_step(resumed) != {k: v for k, v in _by_step(whole).items() if k >= 3}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["nvme/nvme", "cpu/cpu", "none/none"])
def test_two_rank_resume_is_bit_identical(tmp_path, placement):
    whole = job("run", tmp_path, "--placement", placement, "--steps", "5", world=2)
    job("save", tmp_path, "--placement", placement, "--steps", "2", "--save", str(tmp_path / "ckpt"), world=2)
    resumed = job("resume", tmp_path, "--placement", placement, "--steps", "5", "--save", str(tmp_path / "ckpt"),
                  world=2)
    manifest = Manifest.read(str(tmp_path / "ckpt" / "global_step2"))
    assert manifest.world_size == 2 and shard_file(1, "master") in manifest.files
    assert _by_step(resumed) == {k: v for k, v in _by_step(whole).items() if k >= 2}
    assert resumed["digest"] == whole["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded", [((2, "nvme/nvme"), (1, "cpu/cpu")), ((1, "nvme/nvme"), (2, "none/none")),
                                          ((1, "cpu/cpu"), (1, "nvme/nvme"))])
def test_resume_into_another_world_size_or_placement(tmp_path, saved, loaded):
    """fp32 compute so that the only difference is the reduction order of the new world size (and
    no dropout: each world size draws its own masks)."""
    (w_save, p_save), (w_load, p_load) = saved, loaded
    same = ("--dtype", "fp32", "--no-dropout")
    whole = job("run", tmp_path, "--placement", p_load, *same, "--steps", "5", world=w_load)
    ckpt = str(tmp_path / "ckpt")
    job("save", tmp_path, "--placement", p_save, *same, "--steps", "2", "--save", ckpt, world=w_save)
    resumed = job("resume", tmp_path, "--placement", p_load, *same, "--steps", "5", "--save", ckpt, world=w_load)
    expected = {k: v for k, v in _by_step(whole).items() if k >= 2}
    assert _by_step(resumed).keys() == expected.keys()
    for step, loss in _by_step(resumed).items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-5), step
    _assert_values_close(resumed["values"], whole["values"], 1e-5)
    if w_save == w_load:  # the same arithmetic: placements are bit-identical
        assert resumed["digest"] == whole["digest"]


# ---- saving from a SIGTERM handler ------------------------------------------------------------


def test_sigterm_handler_saves_a_checkpoint_that_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    child = subprocess.Popen([sys.executable, JOB, "sigterm", "--placement", "nvme/nvme", "--steps", "1000", "--save",
                              ckpt, "--nvme", str(nvme)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in child.stdout:
        if line.startswith("step 2"):
            break
    time.sleep(0.05)  # inside the next step, most likely
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-4000:]
    saved_at = json.loads(out.strip().splitlines()[-1])["saved_at"]
    assert 3 <= saved_at < 1000  # the signal came mid-run (about 20 ms a step: it cannot end first)
    resumed = job("resume", tmp_path, "--placement", "nvme/nvme", "--steps", str(saved_at + 2), "--save", ckpt)
    whole = job("run", tmp_path, "--placement", "nvme/nvme", "--steps", str(saved_at + 2))
    assert _by_step(resumed) == {k: v for k, v in _by_step(whole).items() if k >= saved_at}
    assert resumed["digest"] == whole["digest"]


def test_signal_handlers_wait_for_the_step_boundary(tmp_path):
    """A signal that arrives in forward is handled once step() has ended, never inside it."""
    from gpt import TinyGPT, batches, config
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(engine.global_steps))
    try:
        hook = engine.module.blocks[1].register_forward_hook(lambda *a: os.kill(os.getpid(), signal.SIGUSR1))
        idx, tgt = batches(1, 4)[0]
        engine.backward(engine(idx, tgt))
        assert seen == []  # held through forward and backward
        engine.step()
        assert seen == [1]  # handled after the step ended
        hook.remove()
        os.kill(os.getpid(), signal.SIGUSR1)  # between steps: at once
        assert seen == [1, 1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        engine.close()


# ---- crash safety and corruption ------------------------------------------------------------------

KILL_IN_SAVE = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import torch, infinity
from gpt import TinyGPT, batches, config, engine_run
from infinity.checkpoint import files
cfg = config(3, "nvme", "nvme")
for s in ("offload_param", "offload_optimizer"):
    cfg["zero_optimization"][s].update(nvme_path=sys.argv[1], buffer_count=9)
torch.manual_seed(0)
engine, *_ = infinity.initialize(TinyGPT(layers=4), config=cfg)
engine_run(engine, batches(2, 4), gas=1)
engine.save_checkpoint(sys.argv[3], tag=sys.argv[4])
engine_run(engine, batches(1, 4), gas=1)
where = sys.argv[5]
if where == "writing":  # after the first extent of the second save is on its way
    write = files.ExtentWriter.write
    def die(self, *a):
        write(self, *a)
        os.kill(os.getpid(), signal.SIGKILL)
    files.ExtentWriter.write = die
else:  # in the middle of replacing an existing tag: the old one moved aside, the new one not yet in
    import infinity.checkpoint.save as save
    rename = os.rename
    def die(src, dst):
        rename(src, dst)
        if dst.endswith(".replaced"):
            os.kill(os.getpid(), signal.SIGKILL)
    save.os.rename = die
engine.save_checkpoint(sys.argv[3], tag=sys.argv[6])
"""


def _load_into_fresh_engine(tmp_path, ckpt, tag=None, layers=4):
    from gpt import TinyGPT, config
    torch.manual_seed(5)
    engine, *_ = infinity.initialize(TinyGPT(layers=layers), config=config(3, "cpu", "cpu"))
    try:
        path, _ = engine.load_checkpoint(ckpt, tag)
        return path, engine.global_steps, engine.consolidated_state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["writing", "replacing"])
def test_sigkill_while_saving_leaves_the_previous_checkpoint(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    second = "second" if where == "writing" else "first"
    out = subprocess.run([sys.executable, "-c", KILL_IN_SAVE, str(nvme), HERE, str(ckpt), "first", where, second],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert (ckpt / LATEST).read_text().strip() == "first"
    if where == "writing":
        assert [n for n in os.listdir(ckpt) if n.startswith(".second.partial-")] and not (ckpt / "second").exists()
    else:
        assert not (ckpt / "first").exists() and (ckpt / ".first.replaced").is_dir()
    path, steps, _ = _load_into_fresh_engine(tmp_path, str(ckpt))
    assert steps == 2  # the first save's state, whole
    assert path.endswith("first") or path.endswith(".first.replaced")


def _saved(tmp_path, layers: int = 2):
    from gpt import TinyGPT, batches, config, engine_run
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(layers=layers), config=config(3, "cpu", "cpu"))
    engine_run(engine, batches(2, 4), gas=1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    return tmp_path / "ckpt" / "global_step2"


@pytest.mark.parametrize("name", [shard_file(0, "master"), shard_file(0, "exp_avg_sq"), state_file(0),
                                  "buffers.safetensors"])
def test_a_flipped_byte_fails_the_load_naming_the_file(tmp_path, name):
    directory = _saved(tmp_path)
    path = directory / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load_into_fresh_engine(tmp_path, str(tmp_path / "ckpt"), layers=2)


def test_missing_and_truncated_files_are_named(tmp_path):
    directory = _saved(tmp_path)
    master = directory / shard_file(0, "master")
    master.write_bytes(master.read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=shard_file(0, "master").replace(".", r"\.")):
        _load_into_fresh_engine(tmp_path, str(tmp_path / "ckpt"), layers=2)
    (directory / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        _load_into_fresh_engine(tmp_path, str(tmp_path / "ckpt"), layers=2)


def test_another_model_is_refused_naming_the_parameters(tmp_path):
    from gpt import TinyGPT, config
    _saved(tmp_path, layers=2)
    engine, *_ = infinity.initialize(TinyGPT(layers=3, d=32), config=config(3, "cpu", "cpu"))
    try:
        with pytest.raises(CheckpointError, match=r"missing from the checkpoint: blocks\.2\."):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    engine, *_ = infinity.initialize(TinyGPT(layers=2, d=64), config=config(3, "cpu", "cpu"))
    try:
        with pytest.raises(CheckpointError, match=r"shape mismatch: blocks\.0\.ln1\.weight \(checkpoint \[32\], model \[64\]\)"):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()


def test_no_latest_returns_none_and_misuse_is_named(tmp_path):
    from gpt import TinyGPT, batches, config
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    try:
        assert engine.load_checkpoint(tmp_path) == (None, None)  # DeepSpeed's answer
        with pytest.raises(FileNotFoundError, match="nope"):
            engine.load_checkpoint(tmp_path, tag="nope")
        with pytest.raises(ValueError, match="custom_load_fn is not supported"):
            engine.load_checkpoint(tmp_path, custom_load_fn=lambda src, dst: None)
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(tmp_path, tag="../x")
        with pytest.raises(TypeError, match="client_state"):
            engine.save_checkpoint(tmp_path, client_state={"f": lambda: 0})
        idx, tgt = batches(1, 4)[0]
        engine.backward(engine(idx, tgt))
        with pytest.raises(RuntimeError, match=r"engine\.step\(\) first"):
            engine.save_checkpoint(tmp_path)
        engine.step()
        assert not os.listdir(tmp_path)  # nothing was written by the refused calls
    finally:
        engine.close()


# ---- export -------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _llama(layers=2, width=64, vocab=128, tie=True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=64, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def _train_llama(engine, steps=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


@pytest.mark.parametrize("tie", [True, False])
def test_consolidate_loads_with_from_pretrained_and_gives_the_engines_logits(tmp_path, tie):
    from gpt import config

    from infinity.apps.cli import main
    cfg = config(3, "nvme", "nvme")
    for s in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][s].update(nvme_path=str(tmp_path), buffer_count=9)
    engine, *_ = infinity.initialize(_llama(tie=tie), config=cfg)
    _train_llama(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    engine.close()
    ckpt = tmp_path / "ckpt" / "global_step2"
    for kind in ("exp_avg", "exp_avg_sq"):  # consolidate never reads the moments
        (ckpt / shard_file(0, kind)).unlink()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    from safetensors import safe_open
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (not tie)  # a tied weight once, under its first name
    assert "model.embed_tokens.weight" in names


def test_sharded_export_and_save_16bit_model(tmp_path):
    from gpt import config

    from infinity.checkpoint.export import consolidate
    cfg = config(3, "cpu", "cpu")
    cfg["bf16"] = {"enabled": True}
    engine, *_ = infinity.initialize(_llama(layers=3, tie=False), config=cfg)
    _train_llama(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_16bit_model(tmp_path / "bf16")
    state = engine.module.state_dict()
    engine.close()
    from safetensors.torch import load_file
    exported = load_file(tmp_path / "bf16" / "model.safetensors")
    assert exported.keys() == {k for k in state if not k.endswith("rotary_emb.inv_freq")}
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name  # the values the model computes with
    written = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "sharded"), dtype=torch.bfloat16,
                          max_shard_size=60_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len({*index["weight_map"].values()}) > 2 and len(written) > 3
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16)
    for name, value in model.state_dict().items():
        if name in state:
            # fp32 masters rounded to bf16 are the bf16 weights the engine computes with
            assert torch.equal(value, state[name]), name


CONSOLIDATE_PEAK = r"""
import json, sys, ctypes
ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: large buffers go back at free
import torch
from infinity.checkpoint import consolidate
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
base = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"growth": hwm() - base}))
"""


@pytest.mark.slow
def test_consolidate_peak_memory_is_about_one_unit(tmp_path):
    """16 layers of 2.6M parameters: the whole model is 170 MB of fp32, one unit 10.5 MB."""
    from gpt import config
    model = _llama(layers=16, width=512, vocab=256, tie=False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = infinity.initialize(model, config=config(3, "cpu", "cpu"))
    engine.save_checkpoint(tmp_path / "ckpt")
    unit_bytes = max(u.train_shard_numel for u in engine.units) * 4
    total = sum(v.numel() for v in expected.values()) * 4
    engine.close()
    out = subprocess.run([sys.executable, "-c", CONSOLIDATE_PEAK, str(tmp_path / "ckpt"), str(tmp_path / "hf")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    print(f"consolidate: peak growth {growth / 1e6:.1f} MB, one unit {unit_bytes / 1e6:.1f} MB, model {total / 1e6:.1f} MB")
    # The unit's extent read whole, one parameter converted, and staging: a few units at most.
    assert growth < 4 * unit_bytes, (growth, unit_bytes, total)
    assert total > 12 * unit_bytes  # ... and far from the whole model
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, value in expected.items():
        assert torch.equal(reloaded.state_dict()[name], value), name


# ---- what review found: signals and failures around checkpoints ---------------------------------


@pytest.mark.slow
def test_a_signal_on_one_rank_runs_the_handler_on_every_rank_at_the_same_boundary(tmp_path):
    """Rank 0 alone gets SIGUSR1 inside a step; its handler saves (a collective): both ranks must
    run it after the same step, or the save deadlocks."""
    ckpt = tmp_path / "ckpt"
    result = job("signal-rank0", tmp_path, "--placement", "cpu/cpu", "--steps", "4", "--save", str(ckpt), world=2,
                 timeout=240)
    assert result["saved"] == [3]  # after the step it arrived in; rank 1 saved with it or the save would hang
    manifest = Manifest.read(str(ckpt / "global_step3"))
    assert manifest.world_size == 2 and manifest.data["global_steps"] == 3


def _tiny_engine():
    from gpt import TinyGPT, config
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    return engine


def _one_step(engine):
    from gpt import batches
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    engine.step()


def test_a_signal_during_load_waits_for_the_load(tmp_path):
    engine = _tiny_engine()
    _one_step(engine)
    _one_step(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    engine = _tiny_engine()
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(engine.global_steps))
    try:
        from infinity.checkpoint import load
        original = load._load_unit

        def interrupted(*args):
            os.kill(os.getpid(), signal.SIGUSR1)
            original(*args)
        load._load_unit = interrupted
        try:
            engine.load_checkpoint(tmp_path / "ckpt")
        finally:
            load._load_unit = original
        assert seen == [2]  # once, after the load, with the loaded counters
    finally:
        signal.signal(signal.SIGUSR1, previous)
        engine.close()


def test_two_engines_interleaving_steps_keep_the_users_handler(tmp_path):
    a, b = _tiny_engine(), _tiny_engine()
    seen = []
    handler = lambda s, f: seen.append(s)  # noqa: E731
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        from gpt import batches
        idx, tgt = batches(1, 4)[0]
        la = a(idx, tgt)
        lb = b(idx, tgt)
        a.backward(la)
        a.step()
        os.kill(os.getpid(), signal.SIGUSR1)  # b is still inside its step
        assert seen == []
        b.backward(lb)
        b.step()
        assert seen == [signal.SIGUSR1]
        a.close()
        b.close()
        assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_no_checkpoint_of_a_half_updated_state(tmp_path):
    engine = _tiny_engine()
    _one_step(engine)
    engine.save_checkpoint(tmp_path / "ckpt", tag="good")
    from gpt import batches
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    update = engine.optim_state.update
    calls = []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "injected")
        update(*args, **kwargs)
    engine.optim_state.update = fail_third
    with pytest.raises(OSError, match="injected"):
        engine.step()
    engine.optim_state.update = update
    # Two units took step 2, the others not ([Note: failed updates] in infinity/engine/step_policy.py).
    with pytest.raises(RuntimeError, match=r"unit 2 in step failed .*restore the run from a checkpoint"):
        engine.save_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "global_step1").exists()
    with pytest.raises(RuntimeError, match="restore the run from a checkpoint"):
        _one_step(engine)  # another step would not mend the mix
    engine.load_checkpoint(tmp_path / "ckpt", tag="good")  # a load does
    _one_step(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()


def test_a_changed_manifest_is_refused(tmp_path):
    directory = _saved(tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["units"][0]["params"][0]["offset"] += 1  # every extent's checksum still matches
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        _load_into_fresh_engine(tmp_path, str(tmp_path / "ckpt"), layers=2)


def test_a_load_that_fails_part_way_is_said_and_blocks_saving(tmp_path):
    directory = _saved(tmp_path)
    path = directory / shard_file(0, "exp_avg")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1  # the last unit's extent: the units before it are loaded already
    path.write_bytes(bytes(raw))
    from gpt import TinyGPT, batches, config
    engine, *_ = infinity.initialize(TinyGPT(layers=2), config=config(3, "cpu", "cpu"))
    try:
        with pytest.raises(CheckpointError, match=r"rank00000\.exp_avg\.bin: checksum mismatch") as failed:
            engine.load_checkpoint(tmp_path / "ckpt")
        assert any("units before the failure hold the checkpoint's values" in n for n in failed.value.__notes__)
        with pytest.raises(RuntimeError, match="load_checkpoint failed part way"):
            engine.save_checkpoint(tmp_path / "other")
        # A step on half-loaded values does not mend them: still no checkpoint of the mix.
        idx, tgt = batches(1, 4)[0]
        engine.backward(engine(idx, tgt))
        engine.step()
        with pytest.raises(RuntimeError, match="load_checkpoint failed part way"):
            engine.save_checkpoint(tmp_path / "other")
        path.write_bytes(bytes(raw[:-100]) + bytes([raw[-100] ^ 1]) + bytes(raw[-99:]))  # repaired
        engine.load_checkpoint(tmp_path / "ckpt")
        engine.save_checkpoint(tmp_path / "other")  # a load that succeeded ends it
    finally:
        engine.close()


@pytest.mark.parametrize("stage,param,optim", [(1, "none", "cpu"), (1, "none", "none"), (2, "none", "cpu")])
def test_resume_is_exact_for_stages_1_and_2(tmp_path, stage, param, optim):
    from gpt import TinyGPT, batches, config, engine_run

    def build():
        cfg = config(stage, param, optim)
        if optim == "nvme":
            cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
        torch.manual_seed(0)
        return infinity.initialize(TinyGPT(), config=cfg)[0]

    data = batches(4, 4)
    engine = build()
    whole = engine_run(engine, data, gas=1)
    expected = engine.consolidated_state_dict()
    engine.close()
    engine = build()
    first = engine_run(engine, data[:2], gas=1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    engine = build()
    engine.load_checkpoint(tmp_path / "ckpt")
    second = engine_run(engine, data[2:], gas=1)
    got = engine.consolidated_state_dict()
    engine.close()
    assert first + second == whole
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_optimizer_state_dict_holds_the_state_and_loads_back(tmp_path):
    from gpt import batches, engine_run
    engine = _tiny_engine()
    engine_run(engine, batches(2, 4), gas=1)
    state = engine.optimizer.state_dict()
    assert state["step_count"] == 2 and state["state"]
    assert all(s["exp_avg"].abs().sum() > 0 for s in state["state"].values())
    expected = engine_run(engine, batches(2, 4, seed=5), gas=1)
    engine.close()
    engine = _tiny_engine()
    engine.optimizer.load_state_dict(state)
    assert engine_run(engine, batches(2, 4, seed=5), gas=1) == expected
    engine.close()


def test_exclude_frozen_parameters_saves_only_trainable_values_and_keeps_the_models_own(tmp_path):
    """DeepSpeed's save_checkpoint(exclude_frozen_parameters=True), as Hugging Face's Trainer calls
    it for PEFT models: no frozen values on disk, and a load takes the trainable values (and their
    optimizer state) from the checkpoint and leaves the frozen ones as the model has them."""
    from gpt import TinyGPT, batches, config, engine_run

    def build(seed):
        torch.manual_seed(seed)
        model = TinyGPT(layers=3)
        model.blocks[0].requires_grad_(False)
        model.emb.requires_grad_(False)
        return infinity.initialize(model, config=config(3, "cpu", "cpu"))[0]

    engine = build(0)
    engine_run(engine, batches(2, 4), gas=1)
    engine.save_checkpoint(tmp_path / "full", tag="t")
    engine.save_checkpoint(tmp_path / "lean", tag="t", exclude_frozen_parameters=True)
    trained = engine.consolidated_state_dict()
    engine_run(engine, batches(1, 4, seed=9), gas=1)
    after = engine.consolidated_state_dict()
    engine.close()
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    model.blocks[0].requires_grad_(False)
    model.emb.requires_grad_(False)  # the head is tied to it
    frozen = [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    assert frozen and all(torch.equal(trained[n], after[n]) for n in frozen)
    assert not (tmp_path / "lean" / "t" / shard_file(0, "frozen")).exists()
    assert (tmp_path / "full" / "t" / shard_file(0, "frozen")).exists()

    other = build(1)  # other frozen values: the load must keep them, and take every trainable one
    own = other.consolidated_state_dict()
    other.load_checkpoint(tmp_path / "lean")
    loaded = other.consolidated_state_dict()
    for name in trained:
        assert torch.equal(loaded[name], own[name] if name in frozen else trained[name]), name
    same = build(0)  # the run's own base weights: resuming continues the run exactly
    same.load_checkpoint(tmp_path / "lean")
    engine_run(same, batches(1, 4, seed=9), gas=1)
    resumed = same.consolidated_state_dict()
    same.close()
    other.close()
    assert all(torch.equal(resumed[n], after[n]) for n in after)


def test_load_module_only_loads_the_weights_and_returns_the_client_state(tmp_path):
    """DeepSpeed's load_module_only: the module's weights, not the optimizer state or the
    counters, and the client_state saved with them (it returned {} here)."""
    engine = _tiny_engine()
    _one_step(engine)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3})
    saved = engine.consolidated_state_dict()
    engine.close()
    fresh = _tiny_engine()
    path, client = fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert client == {"epoch": 3}
    assert fresh.global_steps == 0 and fresh.optimizer.step_count == 0
    assert all(torch.equal(v, saved[k]) for k, v in fresh.consolidated_state_dict().items())
    fresh.close()


# ---- what review found: export into a directory that already holds something --------------------


def _tree(directory) -> dict[str, bytes]:
    """Every file under `directory` (relative name -> bytes): what a user would find there."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def _llama_checkpoint(tmp_path, tie=True):
    from gpt import config
    engine, *_ = infinity.initialize(_llama(tie=tie), config=config(3, "cpu", "cpu"))
    _train_llama(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    return engine


def test_a_failed_export_leaves_the_out_dir_as_it_was(tmp_path, monkeypatch):
    """A damaged checkpoint (consolidate) or a write that fails part way (save_16bit_model):
    the previous export and the user's own files are there as they were, byte for byte, and a
    run into a new directory leaves no directory behind. A run that succeeds replaces the old
    export's files, removes its shards that the new one has not, and keeps the user's files."""
    from infinity.checkpoint import safetensors_io
    from infinity.checkpoint.export import consolidate
    engine = _llama_checkpoint(tmp_path)
    out = tmp_path / "out"
    consolidate(str(tmp_path / "ckpt"), str(out), max_shard_size=60_000)  # an earlier export, sharded
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00001.safetensors.bak").write_text("mine too")
    before = _tree(out)
    assert "model.safetensors.index.json" in before

    def failing_add(self, name, tensor):  # the disk fills up after a few tensors
        if self._next == 3:
            raise OSError(28, "No space left on device")
        return real_add(self, name, tensor)

    real_add = safetensors_io.StreamWriter.add
    monkeypatch.setattr(safetensors_io.StreamWriter, "add", failing_add)
    with pytest.raises(OSError, match="No space left"):
        engine.save_16bit_model(out)
    assert _tree(out) == before
    with pytest.raises(OSError, match="No space left"):
        engine.save_16bit_model(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(safetensors_io.StreamWriter, "add", real_add)

    master = tmp_path / "ckpt" / "global_step2" / shard_file(0, "master")
    raw = bytearray(master.read_bytes())
    raw[100] ^= 0x10
    master.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        consolidate(str(tmp_path / "ckpt"), str(out))
    assert _tree(out) == before
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        consolidate(str(tmp_path / "ckpt"), str(tmp_path / "new" / "deeper"))
    assert not (tmp_path / "new").exists()

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / f"model.safetensors.tmp-{int(gone.stdout)}").write_text("what an export killed outright left")
    (out / f"notes.txt.tmp-{int(gone.stdout)}").write_text("not ours")
    engine.save_16bit_model(out)  # one file now: the old shards and index go, the user's files stay
    state = engine.module.state_dict()
    engine.close()
    after = _tree(out)
    assert sorted(after) == ["config.json", "model-00001-of-00001.safetensors.bak", "model.safetensors", "notes.txt",
                             f"notes.txt.tmp-{int(gone.stdout)}"]
    assert after["notes.txt"] == b"mine" and after["model-00001-of-00001.safetensors.bak"] == b"mine too"
    from safetensors.torch import load_file
    for name, value in load_file(out / "model.safetensors").items():
        assert torch.equal(value, state[name]), name


def test_export_replaces_another_models_config(tmp_path):
    """save_16bit_model into a directory holding an untied model's config.json: the config is
    the saved (tied) model's own, so from_pretrained ties lm_head to the exported embeddings
    instead of initialising it at random."""
    engine = _llama_checkpoint(tmp_path, tie=True)
    out = tmp_path / "out"
    _llama(tie=False).save_pretrained(out)
    engine.save_16bit_model(out)
    state = engine.module.state_dict()
    engine.close()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_consolidate_refuses_an_out_dir_that_is_a_file_or_inside_the_checkpoint(tmp_path, capsys):
    from infinity.apps.cli import main
    _llama_checkpoint(tmp_path).close()
    tag = tmp_path / "ckpt" / "global_step2"
    (tmp_path / "data.txt").write_text("user data")
    checkpoint = _tree(tmp_path / "ckpt")
    for out in (tmp_path / "data.txt", tag, tag / "hf", tmp_path / "ckpt"):
        assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith(f"infinity consolidate: out_dir {out}:") and err.count("\n") == 1, err
        assert "Traceback" not in err
        assert _tree(tmp_path / "ckpt") == checkpoint  # nothing written into the checkpoint
    assert main(["consolidate", str(tag), str(tag)]) == 2
    assert "out_dir" in capsys.readouterr().err and _tree(tmp_path / "ckpt") == checkpoint
    assert (tmp_path / "data.txt").read_text() == "user data"


@pytest.mark.parametrize("tile_size", [0, 2048])
def test_finetune_export_merges_lora_adapters_tile_by_tile(tmp_path, tile_size):
    """`infinity finetune --lora --export` from the live engine: from_pretrained loads the export
    (no adapter tensors, no base_layer names) and computes what the engine computed."""
    from gpt import config

    from infinity.apps.finetune import add_lora, export_model
    model = _llama(tie=True)
    wrapped = add_lora(model, 4)
    engine, *_ = infinity.initialize(model, config=config(3, "cpu", "cpu", lr=1e-2, tile_size=tile_size))
    assert any(".base_layer.tiles." in u.name for u in engine.units) == bool(tile_size)
    _train_llama(engine, steps=3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    export_model(engine, str(tmp_path / "out"), wrapped, tokenizer=None)
    engine.close()
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_finetune_export_reads_adapters_ahead_when_their_unit_comes_after_the_weights_tiles(tmp_path):
    """A LoRA projection in the root unit (no layer list), its weight tiled: the tiles are units
    before the root, so the export reads the adapters ahead; the merged weight is the plain
    module's W + B @ A * scale."""
    from gpt import config
    from safetensors.torch import load_file

    from torch import nn

    from infinity.apps.finetune import add_lora, export_model

    class Root(nn.Module):  # the layers are the blocks; q_proj (and so its adapters) is the root's
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
            self.q_proj = nn.Linear(32, 64, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.q_proj(x).square().mean()

    torch.manual_seed(0)
    model = Root()
    wrapped = add_lora(model, 4)
    engine, *_ = infinity.initialize(model, config=config(3, "cpu", "cpu", lr=1e-2, tile_size=512))
    assert [u.name for u in engine.units][-1] == "<root>" and len(engine.units) > 2  # tiles, then the root
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 32)))
        engine.step()
    state = engine.consolidated_state_dict()
    export_model(engine, str(tmp_path / "out"), wrapped, tokenizer=None)
    engine.close()
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "q_proj.weight" in out and not [n for n in out if "lora" in n or "base_layer" in n]
    m = model.q_proj
    torch.testing.assert_close(out["q_proj.weight"], state["q_proj.base_layer.weight"]
                               + state["q_proj.lora_B"] @ state["q_proj.lora_A"] * m.scale)
    assert state["q_proj.lora_B"].abs().sum() > 0


@pytest.mark.parametrize("tile_size", [0, 2048])
def test_consolidate_merges_lora_adapters_into_the_weights(tmp_path, capsys, tile_size):
    """A checkpoint of `infinity finetune --lora`: consolidate writes the fine-tuned model (each
    B @ A * scale added to its weight, the scale being the module's saved `lora_scale` buffer, no
    adapter tensors), also where the engine tiled the adapted projections (each tile's rows
    merged with theirs of B @ A). Adapters saved without their scale need --lora-scale: without
    it, a one-line error that says to pass it, and nothing written."""
    from gpt import config

    from infinity.checkpoint.export import consolidate
    from infinity.apps.cli import main
    from infinity.apps.finetune import add_lora
    model = _llama(tie=False)
    wrapped = add_lora(model, 4)
    scale = model.get_submodule(wrapped[0]).scale
    engine, *_ = infinity.initialize(model, config=config(3, "cpu", "cpu", lr=1e-2, tile_size=tile_size))
    assert any(".base_layer.tiles." in u.name for u in engine.units) == bool(tile_size)
    _train_llama(engine, steps=3)
    engine.save_checkpoint(tmp_path / "ckpt")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    state = engine.module.state_dict()
    engine.close()
    assert state[f"{wrapped[0]}.lora_B"].abs().sum() > 0  # trained: the merge changes the weight

    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from safetensors import safe_open
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert not [n for n in f.keys() if "lora" in n]
    merged = (state[f"{wrapped[0]}.base_layer.weight"]
              + state[f"{wrapped[0]}.lora_B"] @ state[f"{wrapped[0]}.lora_A"] * scale)
    torch.testing.assert_close(tuned.state_dict()[f"{wrapped[0]}.weight"], merged)
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)

    bare = _llama(tie=False)  # adapters saved without their scale (another LoRA module, an older checkpoint)
    for name in add_lora(bare, 4):
        del bare.get_submodule(name)._buffers["lora_scale"]  # noqa: SLF001
    engine, *_ = infinity.initialize(bare, config=config(3, "cpu", "cpu"))
    engine.save_checkpoint(tmp_path / "bare")
    engine.close()
    capsys.readouterr()
    assert main(["consolidate", str(tmp_path / "bare"), str(tmp_path / "bare_hf")]) == 2
    err = capsys.readouterr().err
    assert "LoRA" in err and "--lora-scale" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bare_hf").exists()
    assert main(["consolidate", str(tmp_path / "bare"), str(tmp_path / "bare_hf"), "--lora-scale", "2"]) == 0
    _llama_checkpoint(tmp_path / "plain").close()
    with pytest.raises(ValueError, match="lora_scale: the checkpoint holds no LoRA adapters"):
        consolidate(str(tmp_path / "plain" / "ckpt"), str(tmp_path / "x"), lora_scale=2)
    assert not (tmp_path / "x").exists()
