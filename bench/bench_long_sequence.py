"""Peak RSS (VmHWM, measured in a child) and step time of one training step against sequence
length, for an HF Llama with a 128k vocabulary (dim 512, 2 layers, fp32, parameters and optimizer
state on NVMe, batch 1), with and without the chunked LM loss ([Note: the chunked LM loss]).

    python bench/bench_long_sequence.py --nvme /tmp --tokens 1024 8192 --whole 1024 4096
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
ids = torch.randint(0, 131072, (1, tokens), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
step = time.perf_counter() - t0
engine.close()
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
print(json.dumps({"tokens": tokens, "chunked": chunked, "peak_rss": hwm, "rss_built": built, "step_s": step,
                  "loss": loss.item()}))
"""


def run(tokens: int, chunked: bool, nvme: str) -> dict:
    with tempfile.TemporaryDirectory(dir=nvme) as d:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "INFINITY_DEVICE": "cpu"}
        out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(int(chunked)), d],
                             capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode:
            return {"tokens": tokens, "chunked": chunked, "error": out.stderr[-500:]}
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", default="/tmp")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--whole", type=int, nargs="*", default=[1024, 4096], help="lengths also run with whole logits")
    ap.add_argument("--output")
    args = ap.parse_args()
    rows = []
    for tokens in args.tokens:
        for chunked in (True, False) if tokens in args.whole else (True,):
            t0 = time.time()
            r = run(tokens, chunked, args.nvme)
            rows.append(r)
            gib = r.get("peak_rss", 0) / 2**30
            print(f"{tokens:6d} tokens {'chunked' if chunked else 'whole  '}: peak RSS {gib:6.2f} GiB, "
                  f"step {r.get('step_s', float('nan')):6.1f} s ({time.time() - t0:.0f} s in all) {r.get('error', '')}",
                  flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
