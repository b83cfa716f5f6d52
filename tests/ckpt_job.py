"""A training job for the checkpoint tests, run as its own process (`python ckpt_job.py ARGS`):
train, save, resume, with dropout so that a resume that does not restore the RNG differs.

    python ckpt_job.py run   --placement nvme/nvme --steps 6 --out result.json
    python ckpt_job.py save  --placement nvme/nvme --steps 3 --save DIR
    python ckpt_job.py resume --placement cpu/cpu --steps 6 --save DIR --out result.json
    python ckpt_job.py sigterm --placement nvme/nvme --steps 1000 --save DIR   (saves on SIGTERM)

Every mode prints one JSON line last: losses by global step and the final fp32 state's digest.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpt import TinyGPT, batches, config  # noqa: E402

import infinity  # noqa: E402


class DroppedGPT(TinyGPT):
    """TinyGPT with dropout on the embeddings: its mask comes from the torch RNG."""

    p = 0.1

    def forward(self, idx, targets):
        x = F.dropout(self.emb(idx), self.p, self.training) + self.pos[: idx.size(1)]
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(placement: str, nvme: str, dtype: str, world: int):
    param, optim = placement.split("/")
    cfg = config(3, param, optim, clip=1.0, micro=4 // world)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 4}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    for section, device in (("offload_param", param), ("offload_optimizer", optim)):
        if device == "nvme":
            cfg["zero_optimization"][section].update(nvme_path=nvme, buffer_count=9)
    torch.manual_seed(0)
    model = DroppedGPT()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    return engine


def train(engine, data, start: int, stop: int, world: int, rank: int, on_step=None) -> dict[int, float]:
    losses = {}
    for step in range(start, stop):
        idx, tgt = data[step % len(data)]  # a long run (sigterm) goes round the batches again
        n = idx.size(0) // world
        loss = engine(idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses[step] = total.item() / world
        if on_step is not None:
            on_step(step)
    return losses


def digest(engine) -> dict:
    state = engine.consolidated_state_dict()
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].float().contiguous().numpy().tobytes())
    return {"digest": h.hexdigest(), "values": {k: v.float().flatten()[:64].tolist() for k, v in state.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run", "save", "resume", "sigterm", "signal-rank0"])
    p.add_argument("--placement", default="nvme/nvme")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    p.add_argument("--nvme", default=os.getcwd())
    p.add_argument("--no-dropout", action="store_true", help="runs on other world sizes draw other masks")
    args = p.parse_args()
    if args.no_dropout:
        DroppedGPT.p = 0.0
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.set_num_threads(1)
    data = batches(64, 4, seed=3)
    engine = build(args.placement, args.nvme, args.dtype, world)
    start = 0
    if args.mode == "resume":
        torch.manual_seed(1234)  # the checkpoint's RNG state must win
        _, client = engine.load_checkpoint(args.save)
        start = client["next_step"]
        assert engine.global_steps == start, (engine.global_steps, start)
    on_step = None
    if args.mode == "sigterm":
        def save_and_exit(signum, frame):
            engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
            print(json.dumps({"saved_at": engine.global_steps}), flush=True)
            engine.close()
            os._exit(0)
        signal.signal(signal.SIGTERM, save_and_exit)
        on_step = lambda step: print(f"step {step}", flush=True)  # noqa: E731
    if args.mode == "signal-rank0":  # only rank 0 receives it, in the middle of step 2's forward
        saved = []

        def save(signum, frame):
            engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
            saved.append(engine.global_steps)
        signal.signal(signal.SIGUSR1, save)
        if rank == 0:
            calls = []

            def kill_in_third_forward(*a):
                calls.append(1)
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)
            engine.module.blocks[1].register_forward_hook(kill_in_third_forward)
        on_step = lambda step: print(json.dumps({"rank": rank, "step": step, "saved": saved}), flush=True)  # noqa: E731
    losses = train(engine, data, start, args.steps, world, rank, on_step)
    if args.mode == "save":
        engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
    result = {"losses": losses, "global_steps": engine.global_steps, **digest(engine)}
    if args.mode == "signal-rank0":
        result["saved"] = saved
    engine.close()
    if rank == 0:
        print(json.dumps(result), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
