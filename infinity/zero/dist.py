"""Collectives over torch.distributed, with world size 1 as the same code path without a group.

gloo (the CPU backend) has no reduce-scatter and no all-gather into one tensor, so on gloo
those are built from all_reduce / all_gather of lists; NCCL gets the single-tensor versions.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# [Note: importing torch.distributed.nn early]
# torch.distributed.nn.functional declares `group=group.WORLD` as default arguments, which
# capture the process group that exists when the module is first imported. torch imports it
# lazily (through torch._dynamo) the first time any torch optimizer is built, so a job that
# initialises its group and then builds an engine (or any optimizer) pins that group for the
# life of the process: destroy_process_group() can no longer free it, gloo's threads run into
# interpreter shutdown, and one of them, dropping the last reference to a finished collective's
# tensor, needs the GIL and aborts the process ("terminate called without an active
# exception"; one run in 5 in a two-rank job with 20 all_gathers). Importing it here, before
# any group exists (a job imports infinity first), makes the defaults None.
if dist.is_available():
    import torch.distributed.nn


def init_distributed(nccl: bool) -> tuple[int, int]:
    """(rank, world size). Initialises the default process group when none exists yet, as
    DeepSpeed's initialize does, one process included (frameworks on DeepSpeed call
    torch.distributed.get_rank() and broadcast without asking whether a group exists): NCCL
    when `nccl` (the device layer has put this process on its GPU already), else gloo. Under a
    launcher (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR) from its environment; a process
    started without one is rank 0 of 1 over an in-process store, so it takes no port."""
    if dist.is_available() and not dist.is_initialized():
        backend = "nccl" if nccl else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def all_gather(full: torch.Tensor, shard: torch.Tensor) -> None:
    """Fills `full` (world * len(shard)) with every rank's shard, in rank order."""
    if world_size() == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return
    if _nccl():
        dist.all_gather_into_tensor(full, shard)
    else:
        dist.all_gather(list(full.chunk(world_size())), shard)


def reduce_scatter_mean(full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the element-wise mean of `full` over ranks."""
    world = world_size()
    if world == 1:
        return full
    if _nccl():
        shard = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
        return shard
    shard = full.chunk(world)[dist.get_rank()]
    if full.dtype in (torch.float16, torch.bfloat16):
        # The sum of several ranks' fp16 gradients can pass 65504 where their mean does not (a
        # loss-scaled gradient near the top of the range): it would read as an overflow and skip
        # the step. Summed in fp32, it is rounded once, to the mean.
        wide = full.float()
        dist.all_reduce(wide)
        return shard.copy_(wide.chunk(world)[dist.get_rank()].div_(world))
    dist.all_reduce(full)
    return shard.div_(world)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(t)
    return t



def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_gather_object(obj):
    """Every rank's `obj` (picklable, small), in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
