"""Peak host memory against the vocabulary: the same two Llama layers (dim 1024) with a 32k and a
256k-token tied vocabulary, fp32, parameters and optimizer state on NVMe (`max_in_cpu` 0),
batch 1 x 64, three steps (issue #34; [Note: memory-centric tiling] in infinity/zero/tiling.py).
The pools' knobs are budgets ([Note: the pool is a budget] in infinity/offload/optimizer/sizing.py), so
they are given as a budget that does not grow with the model: 5 parameter buffers of a tile,
12 optimizer sub-groups of 2.5e7, fp32 gradient accumulators spilled (`max_grad_in_cpu` 0).

    python bench/bench_vocab.py --nvme-path /work            # every case, each in a child process
    python bench/bench_vocab.py --case 256k --tile-size 0    # one case; 0 turns tiling off

Each case runs in a process of its own, so that its peak resident set (ru_maxrss) is its own;
MALLOC_MMAP_THRESHOLD_=65536 makes every large tensor its own mapping, given back when freed,
so the peak follows the tensors alive. Prints one JSON line per case: parameters, units, the
largest unit, peak RSS, the RSS after the last step and the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VOCABS = {"32k": 32000, "256k": 256000}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("INFINITY_DEVICE", "cpu")
    import torch

    import infinity
    from infinity.apps.models.llama import Llama

    torch.manual_seed(0)
    torch.set_num_threads(2)
    shape = {"vocab_size": VOCABS[args.case], "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
             "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": True}
    nvme = tempfile.mkdtemp(prefix="vocab-", dir=args.nvme_path)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "tile_size": args.tile_size, "sub_group_size": 2.5e7,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0,
                                                      "buffer_count": 5, "buffer_size": 1 << 25},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 12,
                                                          "max_grad_in_cpu": 0}}}
    with infinity.Init(config=config):
        model = Llama(shape)
    engine, *_ = infinity.initialize(model=model, config=config)
    tokens = torch.randint(0, shape["vocab_size"], (1, 65))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    out = {"case": args.case, "tile_size": args.tile_size, "parameters": engine.trainable_numel,
           "units": len(engine.units), "largest_unit": max(u.padded_numel for u in engine.units),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss_after_bytes": _rss(), "step_s": times, "step_s_median": statistics.median(times[1:] or times)}
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=[*VOCABS, "all"], default="all")
    p.add_argument("--tile-size", type=int, default=1 << 25, help="zero_optimization.tile_size (0: no tiling)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    args = p.parse_args()
    if args.case != "all":
        print(json.dumps(_run(args)), flush=True)
        return
    results = []
    for case in VOCABS:
        argv = [sys.executable, os.path.abspath(__file__), "--case", case, "--tile-size", str(args.tile_size),
                "--steps", str(args.steps), "--nvme-path", args.nvme_path]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        line = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        print(line, flush=True)
        results.append(json.loads(line))
    small, large = results
    print(json.dumps({"peak_rss_difference_bytes": large["peak_rss_bytes"] - small["peak_rss_bytes"],
                      "parameters_difference": large["parameters"] - small["parameters"]}))


if __name__ == "__main__":
    main()
