"""The LM head and its loss alone, forward and backward: the chunked loss ([Note: the chunked LM
loss]) against plain `F.cross_entropy` over whole logits, interleaved rounds, medians.

    python bench/bench_head_loss.py --tokens 4096 --dim 512 --vocab 131072 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from infinity.zero.head_loss import chunked_lm_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--chunk-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    head = nn.Linear(args.dim, args.vocab, bias=False)
    h = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.tokens))

    def whole() -> torch.Tensor:
        z = F.linear(h, head.weight).float()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(z.view(-1, args.vocab), shifted.view(-1), ignore_index=-100)

    def chunked() -> torch.Tensor:
        return chunked_lm_loss(head, h, labels, chunk_bytes=args.chunk_bytes)

    times: dict[str, list[float]] = {"whole": [], "chunked": []}
    for _ in range(args.rounds):
        for name, f in (("whole", whole), ("chunked", chunked)):
            head.weight.grad = h.grad = None
            t0 = time.perf_counter()
            f().backward()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name:8s} forward+backward: median {statistics.median(ts):.2f} s "
              f"(min {min(ts):.2f}, max {max(ts):.2f}, {len(ts)} rounds)")
    print(f"chunked / whole: {statistics.median(times['chunked']) / statistics.median(times['whole']):.2f}x")


if __name__ == "__main__":
    main()
