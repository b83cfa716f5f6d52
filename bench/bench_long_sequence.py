"""Peak RSS (VmHWM, measured in a child) and step time of one training step against sequence
length, for an HF Llama with a 128k vocabulary (dim 512, 2 layers, fp32, parameters and optimizer
state on NVMe, batch 1), with and without the chunked LM loss ([Note: the chunked LM loss]).

    python bench/bench_long_sequence.py --nvme /tmp --tokens 1024 8192 --whole 1024 4096 --torch 1024 4096

(--torch: the same step in plain PyTorch, everything in memory, at the lengths given.)

With --preset, `infinity finetune`'s step instead (its built-in config, infinity's Llama of the
preset's shapes, one sequence), its peak RSS beside `infinity estimate`'s prediction:

    python bench/bench_long_sequence.py --preset llama-1b --layers 4 --tokens 1024 4096 16384 --modes ckpt plain
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, torch, transformers, infinity
tokens, chunked, nvme = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
cfg = transformers.LlamaConfig(vocab_size=131072, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=tokens,
                               tie_word_embeddings=False)
with infinity.Init():
    model = transformers.LlamaForCausalLM(cfg)
off = {"device": "nvme", "nvme_path": nvme}
engine, *_ = infinity.initialize(model, config={
    "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "chunked_loss": {"enabled": chunked},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1 << 24,
                          "offload_param": dict(off, max_in_cpu=0), "offload_optimizer": dict(off, buffer_count=4)}})
with open("/proc/self/status") as f:
    built = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
vocab, forward = 131072, lambda ids: engine(input_ids=ids, labels=ids).loss
record = {"tokens": tokens, "chunked": chunked, "rss_built": built}
"""

# One timed step, then peak RSS: the end of both children (each sets vocab, forward, record).
_STEP = r"""ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
loss = forward(ids)
engine.backward(loss)
engine.step()
step = time.perf_counter() - t0
engine.close()
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
print(json.dumps({**record, "peak_rss": hwm, "step_s": step, "loss": loss.item()}))
"""
CHILD += _STEP

# The same model and step in plain PyTorch (no infinity): everything in memory, torch's AdamW
# (foreach), HF's loss over whole logits, clipping 1.0. The reference beside the chunked step.
TORCH_CHILD = r"""
import json, sys, time, torch, transformers
tokens = int(sys.argv[1])
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=131072, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=tokens,
                               tie_word_embeddings=False)
model = transformers.LlamaForCausalLM(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
with open("/proc/self/status") as f:
    built = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
ids = torch.randint(0, 131072, (1, tokens), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
step = time.perf_counter() - t0
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
print(json.dumps({"tokens": tokens, "torch": True, "rss_built": built, "peak_rss": hwm, "step_s": step,
                  "loss": loss.item()}))
"""


# `infinity finetune`'s step with its built-in config on infinity's Llama of a preset's shapes (a
# few layers fewer with --layers), one sequence of `tokens`: peak RSS measured here and predicted
# by `infinity estimate`'s model ([Note: the activations of a finetune step]).
FINETUNE = r"""
import json, sys, time, torch, infinity
from infinity.apps.finetune_config import _default_config
from infinity.apps.models.llama import Llama
from infinity.apps.models.presets import preset
tokens, name, layers, checkpointing, chunked, nvme = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                                     sys.argv[4] == "1", sys.argv[5] == "1", sys.argv[6])
cfg = {**preset(name), "max_position_embeddings": max(tokens, 2048)}
if layers:
    cfg["num_hidden_layers"] = layers
with infinity.Init():
    model = Llama(cfg)
model.gradient_checkpointing = checkpointing
config, _ = _default_config(nvme, "nvme", 1, 1e-4, model, checkpointing=checkpointing)
config["chunked_loss"] = {"enabled": chunked}
engine, *_ = infinity.initialize(model=model, config=config)
vocab, forward = cfg["vocab_size"], lambda ids: engine(ids, ids)
record = {"tokens": tokens, "checkpointing": checkpointing, "chunked": chunked, "cfg": cfg}
""" + _STEP


def predicted(cfg: dict, tokens: int, checkpointing: bool, chunked: bool) -> int:
    """`infinity estimate`'s peak for the same run."""
    import psutil

    from infinity.apps.tools.estimate_finetune import activation_parts, finetune_host_peak
    from infinity.apps.tools.estimate_model import model_from_config

    parts = finetune_host_peak(model_from_config("bench", cfg), cfg, psutil.virtual_memory().total, tokens,
                               seq_len=tokens, checkpointing=checkpointing)
    if not chunked:  # the estimate counts infinity finetune's default, the chunked loss; swap in the whole logits
        parts = parts[:-1] + activation_parts(cfg, tokens, tokens, checkpointing=checkpointing, chunk_bytes=0)[-1:]
    return sum(n for _, n in parts)


def run_finetune(tokens: int, args: argparse.Namespace, checkpointing: bool, chunked: bool) -> dict:
    with tempfile.TemporaryDirectory(dir=args.nvme) as d:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "INFINITY_DEVICE": "cpu"}
        out = subprocess.run([sys.executable, "-c", FINETUNE, str(tokens), args.preset, str(args.layers or 0),
                              str(int(checkpointing)), str(int(chunked)), d],
                             capture_output=True, text=True, env=env, timeout=4 * 3600)
        if out.returncode:
            return {"tokens": tokens, "checkpointing": checkpointing, "chunked": chunked, "error": out.stderr[-800:]}
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["predicted"] = predicted(r.pop("cfg"), tokens, checkpointing, chunked)
        return r


def run(tokens: int, chunked: bool | None, nvme: str) -> dict:
    """One step in a child: infinity's, chunked or whole logits, or (chunked None) plain PyTorch's."""
    with tempfile.TemporaryDirectory(dir=nvme) as d:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "INFINITY_DEVICE": "cpu"}
        argv = [TORCH_CHILD, str(tokens)] if chunked is None else [CHILD, str(tokens), str(int(chunked)), d]
        out = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode:
            return {"tokens": tokens, "chunked": chunked, "error": out.stderr[-500:]}
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", default="/tmp")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--whole", type=int, nargs="*", default=[1024, 4096], help="lengths also run with whole logits")
    ap.add_argument("--torch", type=int, nargs="*", default=[], help="lengths also run in plain PyTorch (no infinity)")
    ap.add_argument("--output")
    ap.add_argument("--preset", help="instead: `infinity finetune`'s step on infinity's Llama of this preset's "
                                     "shapes, its peak RSS beside `infinity estimate`'s")
    ap.add_argument("--layers", type=int, help="with --preset: this many decoder layers instead of the preset's")
    ap.add_argument("--modes", nargs="+", default=["ckpt"], choices=["ckpt", "plain", "ckpt-whole", "plain-whole"],
                    help="with --preset: gradient checkpointing (spilled) or not, chunked loss or whole logits")
    args = ap.parse_args()
    rows = []
    if args.preset:
        for tokens in args.tokens:
            for mode in args.modes:
                t0 = time.time()
                r = run_finetune(tokens, args, mode.startswith("ckpt"), not mode.endswith("whole"))
                rows.append({**r, "preset": args.preset, "layers": args.layers, "mode": mode})
                gib = r.get("peak_rss", 0) / 2**30
                print(f"{args.preset}{f' ({args.layers} layers)' if args.layers else ''} {tokens:6d} tokens {mode:11s}: "
                      f"peak RSS {gib:6.2f} GiB, estimate {r.get('predicted', 0) / 2**30:6.2f} GiB, step "
                      f"{r.get('step_s', float('nan')):7.1f} s ({time.time() - t0:.0f} s in all) {r.get('error', '')}",
                      flush=True)
                if args.output:
                    with open(args.output, "w") as f:
                        json.dump(rows, f, indent=1)
        return
    for tokens in args.tokens:
        for chunked in (True, False, None)[:2 if tokens in args.whole else 1] + ((None,) if tokens in args.torch else ()):
            t0 = time.time()
            r = run(tokens, chunked, args.nvme)
            rows.append(r)
            gib = r.get("peak_rss", 0) / 2**30
            what = {True: "chunked", False: "whole  ", None: "torch  "}[chunked]
            print(f"{tokens:6d} tokens {what}: peak RSS {gib:6.2f} GiB, "
                  f"step {r.get('step_s', float('nan')):6.1f} s ({time.time() - t0:.0f} s in all) {r.get('error', '')}",
                  flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
