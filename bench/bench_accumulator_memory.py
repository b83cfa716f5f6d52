"""Host memory of the gradient accumulators with one pass a step: compute dtype against fp32.

    python bench/bench_accumulator_memory.py --nvme-path /work            # 134M GPT, 2 rounds
    python bench/bench_accumulator_memory.py --layers 2 --vocab 8000 --rounds 1

[Note: one pass keeps its own dtype] (infinity/offload/optimizer/accumulators.py): with
gradient_accumulation_steps 1, the accumulators that wait for the step's norm keep the landed
bf16 gradient, 2 bytes a parameter, where they kept 4. This runs bench_user_configs.py's GPT
(bf16, clipping 1.0, 1 x 16 tokens, 3 steps) with the optimizer state in host memory
(`offload_optimizer: cpu`) and on NVMe, each in a fresh process, with the accumulators in the
compute dtype ("half") and in fp32 (`ONE_PASS_KEEPS_ITS_DTYPE` off: the code before), the
variants alternating. Printed per run: the accumulators' own storages (bytes), the process's
peak RSS (getrusage), and the median step time of the last two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def child(spec: dict) -> dict:
    sys.path.insert(0, HERE)
    import infinity
    from infinity.apps.models import gpt
    from infinity.offload.optimizer import accumulators

    accumulators.ONE_PASS_KEEPS_ITS_DTYPE = spec["kept"] == "half"
    offload = {"device": spec["optimizer"]}
    if spec["optimizer"] == "nvme":
        offload.update(nvme_path=spec["work"], buffer_count=12)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "sub_group_size": 2e6, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": offload}}
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=spec["vocab"], seq_len=16, dim=768, layers=spec["layers"], heads=12)
    engine, *_ = infinity.initialize(model=gpt.GPT(cfg), config=config)
    times = []
    for step in range(3):
        idx = torch.randint(0, spec["vocab"], (1, 16), generator=torch.Generator().manual_seed(step))
        t0 = time.perf_counter()
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    tier = engine.optim_state
    accs = tier.acc.host.values() if hasattr(tier, "acc") else tier._grads.values()
    out = {"accumulator_bytes": sum(a.untyped_storage().nbytes() for a in accs),
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step_s": sorted(times[1:])[0], "loss": round(loss.item(), 4)}
    engine.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=64000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    results = []
    for r in range(args.rounds):
        for optimizer in ("cpu", "nvme"):
            for kept in (("half", "fp32") if r % 2 == 0 else ("fp32", "half")):
                with tempfile.TemporaryDirectory(dir=args.nvme_path) as work:
                    spec = dict(optimizer=optimizer, kept=kept, work=work, layers=args.layers, vocab=args.vocab)
                    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], check=True,
                                          stdout=subprocess.PIPE, text=True)
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                results.append({"round": r, "optimizer": optimizer, "kept": kept, **got})
                print(f"round {r} optimizer {optimizer:>4} accumulators {kept:>4}: {got['accumulator_bytes'] / 1e9:.3f} GB, "
                      f"peak RSS {got['peak_rss'] / 1e9:.2f} GB, step {got['step_s']:.3f} s, loss {got['loss']}",
                      flush=True)
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, stdout=subprocess.PIPE,
                                text=True).stdout.strip()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "commit": commit, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
