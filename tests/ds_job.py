"""A training script written for DeepSpeed's API, as a DeepSpeed user has it.

tests/test_migration.py runs it with one line changed, `import deepspeed` to
`import infinity as deepspeed`, and compares what it records with plain PyTorch.

    python ds_job.py --deepspeed --deepspeed_config ds.json --ckpt DIR --out log.json [--stop-after N | --resume]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x), y)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, int(x[:4].argmax())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-after", type=int, default=0, help="save a checkpoint after this many steps and exit")
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters(),
                                                                training_data=Data())
    log = {"getters": {"train_batch_size": engine.train_batch_size(),
                       "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
                       "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                       "gradient_clipping": engine.gradient_clipping(),
                       "zero_optimization_stage": engine.zero_optimization_stage(),
                       "global_rank": engine.global_rank, "local_rank": engine.local_rank,
                       "world_size": engine.world_size, "optimizer_is_returned": optimizer is not None,
                       "scheduler_is_engines": scheduler is engine.lr_scheduler},
           "steps": []}
    start_epoch, skip = 0, 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.ckpt)
        log["loaded"] = path is not None
        start_epoch, skip = client_state["epoch"], client_state["batches"]
        log["resumed_at"] = engine.global_steps

    for epoch in range(start_epoch, args.epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue
            lr = engine.get_lr()[0]
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            entry = {"epoch": epoch, "batch": i, "loss": loss.item(), "boundary": boundary}
            if boundary:
                entry.update(lr=lr, grad_norm=float(engine.get_global_grad_norm()),
                             applied=engine.was_step_applied(), global_steps=engine.global_steps)
            log["steps"].append(entry)
            if boundary and engine.global_steps == args.stop_after:
                engine.save_checkpoint(args.ckpt, client_state={"epoch": epoch, "batches": i + 1})
                with open(args.out, "w") as f:
                    json.dump(log, f)
                return
    log["global_steps"] = engine.global_steps
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        log["weights"] = {name: p.detach().cpu().flatten().tolist() for name, p in engine.module.named_parameters()}
    with open(args.out, "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()
