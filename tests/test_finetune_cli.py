"""`infinity finetune`, the main job: the embedded default in reduced size, the loss falling,
and a Hugging Face model fine-tuned with LoRA, saved, resumed and exported."""

from __future__ import annotations

import json
import re

import pytest
import torch

from infinity.cli import main


def test_default_job_runs_and_shows_the_table(capsys, tmp_path):
    assert main(["finetune", "--steps", "3", "--sample-tokens", "4", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sample before:" in out and "sample after:" in out
    for row in ("device (gathered units, peak)", "host (pinned pools)", "NVMe (parameter and optimizer files)",
                "moved per step", "I/O hidden behind compute"):
        assert row in out
    assert "{" not in out.split("what lived where")[1]  # a table, not a JSON dump
    assert not list(tmp_path.iterdir())  # the offload files went with the run


def test_trace_writes_a_timeline_of_the_steps(tmp_path):
    """--trace: a Chrome trace whose compute-thread slices and NVMe transfers lie in steps 2-4, with a
    forward and a backward phase per step, the optimizer state's transfers both ways and the parameters'
    write-back (the default config keeps parameters cached in host memory: no reads)."""
    trace = tmp_path / "t" / "trace.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assert main(["finetune", "--steps", "5", "--sample-tokens", "0", "--nvme-path", str(nvme),
                 "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    phases = [e["name"] for e in events if e.get("cat") == "phase"]
    assert phases.count("forward") >= 3 and phases.count("backward") == 3 and phases.count("step") == 3
    tracks = {e["cat"] for e in events if e["ph"] == "b"}
    assert {"offload_param writes", "offload_optimizer reads", "offload_optimizer writes", "units"} <= tracks
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


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
