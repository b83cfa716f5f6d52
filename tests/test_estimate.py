"""`infinity estimate`: the byte accounting by hand, frozen parameters, what the engine really
keeps on NVMe, fit decisions, presets against transformers, and bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

import infinity
from gpt import TinyGPT, config
from infinity.apps.cli import main as infinity_main
from infinity.config import ZeroConfig, load_config
from infinity.apps.models import PRESETS, param_count, preset
from infinity.apps.tools.estimate import (
    Machine,
    ModelSize,
    UnitSize,
    model_from_config,
    model_from_count,
    nvme_gbps_needed,
    placements,
    recommend,
    shortfalls,
)
from infinity.zero.unit import SHARD_ALIGN_BYTES

GiB, TiB = 1 << 30, 1 << 40


def _row(options, param: str, optimizer: str):
    return next(p for p in options if (p.param, p.optimizer) == (param, optimizer))


def _page(nbytes: int) -> int:
    """Pool buffers are whole pages."""
    return -(-nbytes // 4096) * 4096


def _machine(gpus=1, gpu=80 * GiB, cpu=256 * GiB, nvme=2 * TiB, tflops=100.0) -> Machine:
    return Machine(gpus=gpus, gpu_bytes=gpu, cpu_bytes=cpu, nvme_free=nvme, nvme_path="/nvme", nvme_gbps=None,
                   tflops=tflops)


def test_one_billion_parameters_on_nvme_by_hand():
    # 1e9 parameters, 1 GPU, bf16, everything trainable; with --params alone the units are
    # assumed equal: 32 of U = 31_250_000 elements, no root unit left over.
    model = model_from_count(10 ** 9)
    assert (model.num_layers, model.layer, model.root) == (32, UnitSize(31_250_000, 0), UnitSize(0, 0))
    p = _row(placements(model, 1, "/nvme"), "nvme", "nvme")

    # NVMe: bf16 parameter shards 2 B x 1e9 + fp32 master, exp_avg, exp_avg_sq 12 B x 1e9. The
    # gradient accumulators (bf16 with one pass a step: 2 B a parameter) stay in host memory:
    # max_grad_in_cpu (1e9 elements by default) holds all 32 units' 31.25M, so nothing spills.
    assert p.nvme == 2 * 10 ** 9 + 12 * 10 ** 9
    # Host: accumulators 2e9; offload_param pool: buffer_count 5 + max_in_cpu's cache
    # (1e9 elements x 2 B / 62.5 MB a shard = 32 shards, all of them) buffers of the largest
    # shard, 62.5 MB rounded up to a page; offload_optimizer pool: the bytes of 9 buffers (3 kinds
    # x reading, updating, writing) of a sub_group_size piece (1e9 > U: a unit, 31.25M elements),
    # cut into the pieces that let it hold the most state from one step to the next
    # ([Note: the pool is a budget] in offload/optimizer/sizing.py): the smaller the pieces, the more of the
    # 281.25M elements hold state (while two units' streamed pieces still fit beside them) and
    # the fewer stream, down to 8 MiB pieces; the largest cut within 2% of the most held is 14
    # pieces a unit of 2_232_320 elements (aligned to 1024), and 281.25M / 2_232_320 = 125
    # buffers of 8.9 MB; two gradient landing buffers of a bf16 shard, 62.5 MB.
    assert p.host == 2 * 10 ** 9 + 37 * _page(62_500_000) + 125 * _page(4 * 2_232_320) + 2 * _page(62_500_000)
    assert p.host == 2 * 10 ** 9 + 39 * 62_500_864 + 125 * 8_929_280
    # Device: two gathered units in bf16 (2 x 2 B x U), and bf16 gradients: the reduce buffer of
    # the one unit size plus autograd's .grad of the unit in backward (2 x 2 B x U).
    assert p.device == 2 * 2 * 31_250_000 + 2 * 2 * 31_250_000 == 250_000_000
    # The step moves 2 B x 1e9 read in forward, again in backward, 2 B x 1e9 written back, and
    # 12 B x 1e9 of state read and written: 30e9 bytes. 16384 tokens x 6 FLOPs x 1e9 at
    # 100 TFLOP/s is 0.98304 s of compute, so the disk must sustain 30e9 / 0.98304 B/s.
    assert p.step_nvme_bytes == 30 * 10 ** 9
    assert nvme_gbps_needed(p, model, _machine(), 16384) == pytest.approx(30 / 0.98304)


def test_frozen_parameters_cost_only_their_bf16_shard():
    trainable = model_from_count(10 ** 9)
    with_frozen = ModelSize(name="", layer=UnitSize(31_250_000, 31_250_000), num_layers=32, root=UnitSize(0, 0),
                            exact=False)  # the same trainable units plus as many frozen elements
    assert with_frozen.frozen == 10 ** 9
    for p, q in zip(placements(trainable, 1, "/nvme"), placements(with_frozen, 1, "/nvme")):
        shards = [next(i.nbytes for i in r.items if i.what == "bf16 parameter shards") for r in (p, q)]
        assert shards[1] - shards[0] == 2 * 10 ** 9, (p.param, p.optimizer)  # 2 bytes a frozen parameter
        fp32 = [{i for i in r.items if "fp32" in i.what} for r in (p, q)]  # master, moments, gradients
        assert fp32[0] == fp32[1], (p.param, p.optimizer)  # and nothing else


def test_lora_freezes_the_base_model():
    cfg = preset("llama-tiny")
    model = model_from_config("llama-tiny", cfg, lora_rank=8)
    # Adapters A (8 x in) and B (out x 8) on q, k, v, o (hidden 256, 4 kv heads of 32: k, v
    # out 128), gate, up (256 -> 704) and down (704 -> 256), in each of 4 layers.
    per_layer = 8 * ((256 + 256) + 2 * (256 + 128) + (256 + 256) + 2 * (256 + 704) + (704 + 256))
    assert model.trainable == 4 * per_layer == 149_504
    assert model.frozen == param_count(cfg)  # the whole base model, embeddings included
    nvme = _row(placements(model, 1, "/nvme"), "nvme", "nvme")
    assert nvme.nvme == 2 * (model.trainable + model.frozen) + 12 * model.trainable


@pytest.mark.parametrize("frozen_block", [False, True])
def test_nvme_bytes_match_what_the_engine_keeps_on_disk(tmp_path, frozen_block):
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    if frozen_block:
        model.blocks[0].requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    cfg = config(param="nvme", optim="nvme")
    cfg["bf16"] = {"enabled": True}
    zero = cfg["zero_optimization"]
    zero["offload_param"].update(nvme_path=str(tmp_path), buffer_count=9, max_in_cpu=0)
    zero["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    engine, *_ = infinity.initialize(model=model, config=cfg)
    try:
        units = len(engine.units)
        assert units == 3 + 1  # a unit per block and the root
        # The data files the store preallocated (not the lock files beside them, which hold an
        # owner record): real sizes on disk, not the engine's counters.
        on_disk = sum(os.stat(os.path.join(d, f)).st_size for d, _, files in os.walk(tmp_path)
                      for f in files if f.endswith(".bin"))
    finally:
        engine.close()
    estimate = ModelSize(name="", layer=UnitSize(trainable, frozen), num_layers=1, root=UnitSize(0, 0), exact=False)
    predicted = _row(placements(estimate, 1, str(tmp_path)), "nvme", "nvme").nvme
    assert predicted == 2 * (trainable + frozen) + 12 * trainable
    if not frozen_block:  # what `infinity estimate --params P` prints for this model
        assert _row(placements(model_from_count(trainable), 1, str(tmp_path)), "nvme", "nvme").nvme == predicted

    # The only slack allowed: each region of a unit's shard is padded to SHARD_ALIGN_BYTES per
    # rank ([Note: flat layout] in unit.py), under 2048 bf16 elements: < 4 KiB of parameters a
    # unit and region (trainable, frozen), and the trainable padding also has fp32 master,
    # exp_avg and exp_avg_sq (< 3 x 8 KiB). Extents are whole pages, which these already are;
    # the store's MiB alignment applies to extents of 1 MiB or more, which this model has none of.
    assert 4 * (trainable + frozen) < 1 << 20
    half_pad = SHARD_ALIGN_BYTES // 2  # elements of bf16 padding, at most, per region
    slack = units * (2 * SHARD_ALIGN_BYTES + 3 * 4 * half_pad)  # 2 regions in bf16, 3 fp32 kinds
    assert predicted <= on_disk < predicted + slack


def test_fit_decisions_follow_the_preference_order():
    model = model_from_config("llama-7b", preset("llama-7b"))
    options = placements(model, 1, "/nvme")

    def chosen(**machine) -> tuple[str, str] | None:
        p = recommend(options, _machine(**machine))
        return p and (p.param, p.optimizer)

    assert chosen() == ("none", "cpu")  # 80G GPU, 256G host: the optimizer state goes to host memory
    assert chosen(cpu=64 * GiB) == ("none", "nvme")  # 114 GiB of fp32 state no longer fits the host
    assert chosen(gpu=12 * GiB, cpu=64 * GiB) == ("cpu", "nvme")  # 13 GiB of bf16 shards off the GPU too
    assert chosen(gpu=12 * GiB, cpu=24 * GiB) == ("cpu", "nvme")  # 19.5 GiB: bf16 shards and pools of tiles
    assert chosen(gpu=12 * GiB, cpu=16 * GiB) == ("nvme", "nvme")  # 9.3 GiB
    assert chosen(gpu=12 * GiB, cpu=16 * GiB, nvme=95 * GiB) is None  # 99 GiB on NVMe needed (bf16 spill)

    # Exactly at a tier's capacity fits, a byte less does not; host and NVMe are the node's,
    # shared by its ranks; on a CPU-only machine the device is host memory too.
    p = _row(placements(model, 4, "/nvme"), "nvme", "nvme")
    assert shortfalls(p, _machine(gpus=4, gpu=p.device, cpu=4 * p.host, nvme=4 * p.nvme)) == []
    assert shortfalls(p, _machine(gpus=4, gpu=p.device - 1, cpu=4 * p.host - 1, nvme=4 * p.nvme - 1)) == [
        "device", "host", "nvme"]
    q = _row(placements(model, 1, "/nvme"), "cpu", "cpu")
    assert shortfalls(q, _machine(gpus=0, gpu=None, cpu=q.device + q.host)) == []
    assert shortfalls(q, _machine(gpus=0, gpu=None, cpu=q.device + q.host - 1)) == ["memory"]


def test_units_are_tiled_as_the_engine_tiles_them():
    """[Note: memory-centric tiling]: the tied 128k embedding of llama-3b is 12 tiles, not a
    394M-element root, and Llama 2 7B's 45M-element MLP projections are tiles too; the
    counts are the model's all the same."""

    for name, tiles in (("llama-3b", 12), ("llama-7b", 2 * 4 + 32 * 3 * 2)):
        cfg = preset(name)
        model = model_from_config(name, cfg)
        assert model.numel == param_count(cfg)
        assert len(model.tiles) == tiles
        assert max(u.numel for u in model.units) <= max(model.layer.numel, ZeroConfig().tile_size)


def test_cli_prints_the_table_and_a_config_the_engine_reads(tmp_path, capsys):
    argv = ["estimate", "--model", "llama-7b", "--gpus", "1", "--gpu-mem", "12G", "--cpu-mem", "64G",
            "--nvme-free", "2T", "--nvme-gbps", "6", "--nvme-path", str(tmp_path)]
    assert infinity_main(argv) == 0
    out = capsys.readouterr().out
    assert "llama-7b: 6.74B parameters" in out and "activations not counted" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["none"], ["cpu"], ["nvme"])]
    assert len(rows) == 9 and rows[0][:2] == ["none", "none"] and rows[-1][:2] == ["nvme", "nvme"]
    assert "recommended: offload_param cpu, offload_optimizer nvme" in out
    block = json.loads(out[out.index("\n{") + 1:out.index("\n}\n") + 2])
    zero = block["zero_optimization"]
    # 12 buffers: 3 kinds and the spilled gradient (6.74B > max_grad_in_cpu), each reading, updating, writing
    assert zero["offload_param"] == {"device": "cpu"} and zero["offload_optimizer"]["buffer_count"] == 12
    parsed = load_config({"train_micro_batch_size_per_gpu": 1, **block})  # no warning: the pools are sized
    assert parsed.zero.offload_optimizer.device == "nvme" and str(parsed.zero.offload_optimizer.nvme_path) == str(
        tmp_path)


def test_cli_on_a_cpu_only_machine(capsys):
    assert infinity_main(["estimate", "--params", "125M", "--gpus", "0", "--cpu-mem", "16G", "--nvme-free", "100G",
                          "--tflops", "0.5", "--frozen-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "CPU only: the CPU computes, device and host share 16.0 GiB" in out
    assert "125.00M parameters (62.50M trainable, 62.50M frozen)" in out
    assert "recommended: offload_param none, offload_optimizer none" in out


@pytest.mark.parametrize("name", ["llama-tiny", "llama-125m", "llama-3b", "llama-70b", "odd"])
def test_param_count_matches_transformers(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    # "odd": a head_dim of its own, biases, an untied head, and no num_key_value_heads (one per head).
    cfg = PRESETS.get(name) or dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                                    num_attention_heads=6, head_dim=24, attention_bias=True, mlp_bias=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_model_directory_is_read_as_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**preset("llama-tiny"), "model_type": "llama"}))
    assert infinity_main(["estimate", "--model", str(tmp_path), "--gpus", "1", "--gpu-mem", "8G", "--cpu-mem", "8G",
                          "--nvme-free", "8G"]) == 0
    assert f"{tmp_path}: 4.00M parameters" in capsys.readouterr().out


@pytest.mark.parametrize("argv, named, says", [
    (["--params", "70X"], "--params", "expected a count"),
    (["--params", "1e18"], "--params", "at most 1000T"),  # it hung, and 1e30 grew until the OOM killer came
    (["--params", "7B", "--largest-unit", "1e20"], "--largest-unit", "at most 1000T"),
    (["--params", "7B", "--gpu-mem", "lots"], "--gpu-mem", "expected a size"),
    (["--params", "7B", "--frozen-fraction", "1"], "--frozen-fraction", "below 1"),
    (["--params", "7B", "--gpus", "-1"], "--gpus", "expected"),
    (["--params", "7B", "--lora", "8"], "--lora", "needs --model"),
    (["--model", "llama-9b"], "--model", "known presets: llama-tiny"),
    (["--model", "llama-tiny", "--largest-unit", "1M"], "--largest-unit", "only with --params"),
    (["--params", "7B", "--gpus", "0", "--gpu-mem", "80G"], "--gpu-mem", "CPU-only"),
    (["--params", "7B", "--gpus", "1", "--world-size", "2"], "--world-size", "not allowed"),
])
def test_bad_input_is_an_argparse_error_naming_the_argument(argv, named, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        infinity_main(["estimate", *argv, "--cpu-mem", "1G", "--nvme-free", "1G"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and says in err


_PEAK = r"""
import sys
from infinity.apps.cli import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print("VmHWM", next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) * 1024)
sys.exit(code)
"""


def _peak_line(text: str) -> float:
    import re
    match = re.search(r"peak host memory about ([\d.]+) (MiB|GiB)", text)
    assert match, text
    return float(match.group(1)) * (1 << (20 if match.group(2) == "MiB" else 30))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4])
def test_the_finetune_peak_is_predicted_within_15_percent(tmp_path, lora):
    """`infinity estimate` on a CPU-only machine predicts the peak RSS of `infinity finetune` with
    its built-in config ([Note: the peak of a finetune step]); the run's VmHWM is read from
    /proc in its own process."""
    import subprocess
    import sys
    extra = ["--lora", str(lora)] if lora else []
    est = subprocess.run([sys.executable, "-m", "infinity.apps.cli", "estimate", "--model", "llama-125m", "--gpus", "0",
                          "--tokens-per-step", "512", "--seq-len", "128", "--nvme-path", str(tmp_path), *extra],
                         capture_output=True, text=True, check=True)
    predicted = _peak_line(est.stdout)
    run = subprocess.run([sys.executable, "-c", _PEAK, "finetune", "--model", "llama-125m", "--steps", "2",
                          "--seq-len", "128", "--batch", "4", "--sample-tokens", "0", "--nvme-path", str(tmp_path),
                          *extra], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = int(run.stdout.split("VmHWM")[-1])
    assert abs(predicted - measured) <= 0.15 * measured, (predicted / 2 ** 20, measured / 2 ** 20)


def test_the_meta_count_of_saved_tensors_is_what_a_real_cpu_forward_saves():
    """[Note: the activations of a finetune step]: the bytes autograd saves, counted on the meta
    device with the flash attention stand-in, equal those a real bf16 forward on the CPU saves
    (the meta device's own attention saved the [tokens, tokens] scores: 2.2 TiB for llama-7b);
    and they grow linearly with the sequence, as flash attention's do."""
    from infinity.apps.models.llama import Llama
    from infinity.apps.tools.estimate_finetune import saved_bytes

    cfg = {**preset("llama-tiny"), "num_hidden_layers": 2}
    torch.manual_seed(0)
    model = Llama(cfg).to(torch.bfloat16)
    params = {p.untyped_storage()._cdata for p in model.parameters()}  # noqa: SLF001
    storages = {}

    def pack(t):
        if t.untyped_storage()._cdata not in params:  # noqa: SLF001
            storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()  # noqa: SLF001
        return t

    ids = torch.randint(0, cfg["vocab_size"], (1, 256))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    assert saved_bytes(cfg, 2, 256) == sum(storages.values())
    assert saved_bytes(cfg, 2, 512) == 2 * saved_bytes(cfg, 2, 256)


def test_long_sequences_are_counted_with_the_chunked_loss_and_checkpointing(capsys):
    """llama-7b at 16,384 tokens in one sequence: was "2.2 TiB activations" (scores counted for every
    layer); with --gradient-checkpointing it is a layer recomputed, two kept inputs and the chunked
    loss's blocks, far below what the whole-logits loss alone would take (16,384 x 32,000 x 4 bytes,
    twice: 3.9 GiB)."""
    from infinity.apps.tools.estimate_finetune import activation_parts

    cfg = preset("llama-7b")
    plain = dict(activation_parts(cfg, 16384, 16384))
    ckpt = dict(activation_parts(cfg, 16384, 16384, checkpointing=True))
    assert 40 * GiB < sum(plain.values()) < 400 * GiB
    assert sum(ckpt.values()) < 10 * GiB
    loss = next(n for what, n in ckpt.items() if what.startswith("the chunked loss"))
    assert loss < GiB
    whole = dict(activation_parts(cfg, 16384, 16384, checkpointing=True, chunk_bytes=0))
    assert next(n for what, n in whole.items() if "whole logits" in what) >= 2 * 16383 * 32000 * 4  # fp32, shifted
    assert infinity_main(["estimate", "--model", "llama-7b", "--gpus", "0", "--cpu-mem", "24G", "--nvme-free", "1T",
                          "--tokens-per-step", "16384", "--seq-len", "16384", "--gradient-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "infinity finetune --gradient-checkpointing" in out and "on NVMe: two in memory" in out
    assert _peak_line(out) < 24 * GiB


def test_it_says_which_moment_format_fits_a_7b_full_fine_tune_on_this_machine(tmp_path, capsys):
    """llama-7b on a 24 GiB, 70 GB-disk machine without a GPU: fp32 moments (about 16 bytes a
    parameter on NVMe) fit nowhere; 8-bit ones fit, and the table with them recommends that block."""
    argv = ["estimate", "--model", "llama-7b", "--gpus", "0", "--cpu-mem", "24G", "--nvme-free", "70G",
            "--nvme-path", str(tmp_path)]
    assert infinity_main(argv) == 0
    out = capsys.readouterr().out
    formats = {line.split()[0]: line for line in out[out.index("moment formats"):].splitlines()[1:4]}
    assert "nothing fits" in formats["fp32"] and "nothing fits" not in formats["8bit"], formats
    assert infinity_main(argv + ["--moment-format", "8bit"]) == 0
    out = capsys.readouterr().out
    block = json.loads(out[out.index("\n{") + 1:out.index("\n}\n") + 2])
    assert block["optimizer"]["params"]["moment_format"] == "8bit"
    parsed = load_config({"train_micro_batch_size_per_gpu": 1, **block})
    assert parsed.optimizer.params.moment_format == "8bit"
