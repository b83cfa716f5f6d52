"""Collectives over torch.distributed, with world size 1 as the same code path without a group.

gloo (the CPU backend) has no reduce-scatter and no all-gather into one tensor, so on gloo
those are built from all_reduce / all_gather of lists; NCCL gets the single-tensor versions.

[Note: the data-parallel group]
ZeRO partitions over the data-parallel ranks: every process of the job, or, under model
parallelism (`initialize(mpu=...)`, [Note: model parallelism] in zero/model_parallel.py), the
ranks of `mpu.get_data_parallel_group()`, which hold the same model-parallel slice of the model.
The collectives here (and `rank()`, `world_size()`) are over that group; the engine sets it
(`set_data_parallel_group`), one per process as DeepSpeed keeps its groups in one module: an
engine over another group while one is open is refused. What must reach every process of the
job (a failed save, a signal) passes `everyone=True`.
"""

from __future__ import annotations

import os
import weakref

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


_group = None  # the data-parallel group; None: the whole job ([Note: the data-parallel group])
_users: weakref.WeakSet = weakref.WeakSet()  # the engines partitioned over it


def set_data_parallel_group(group, user) -> None:
    """The group ZeRO partitions over from now on (None: every process), for the engine `user`.
    An engine over another group while one is open would pull the open one's collectives onto
    its group: refused."""
    global _group
    others = [u for u in _users if not getattr(u, "closed", True)]  # one whose construction failed is not open
    if others and group is not _group:
        raise ValueError("mpu: this process has an open engine over "
                         f"{'the whole job' if _group is None else 'another data-parallel group'}; its collectives "
                         "would move to the new one. Give every engine of a process the same mpu (or none), or "
                         "close the open one first (engine.close())")
    _group = group
    _users.add(user)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(everyone: bool = False) -> int:
    """Ranks of the data-parallel group (`everyone`: of the whole job)."""
    return dist.get_world_size(None if everyone else _group) if _initialized() else 1


def rank(everyone: bool = False) -> int:
    """This process's rank in the data-parallel group (`everyone`: in the whole job)."""
    return dist.get_rank(None if everyone else _group) if _initialized() else 0


def global_rank(group_rank: int) -> int:
    """The job-wide rank of the data-parallel group's rank `group_rank` (what broadcast's src is)."""
    return group_rank if _group is None else dist.get_global_rank(_group, group_rank)


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def all_gather(full: torch.Tensor, shard: torch.Tensor) -> None:
    """Fills `full` (world * len(shard)) with every rank's shard, in rank order."""
    if world_size() == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return
    if _nccl():
        dist.all_gather_into_tensor(full, shard, group=_group)
    else:
        dist.all_gather(list(full.chunk(world_size())), shard, group=_group)


def reduce_scatter_mean(full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the element-wise mean of `full` over ranks."""
    world = world_size()
    if world == 1:
        return full
    if _nccl():
        shard = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG, group=_group)
        return shard
    shard = full.chunk(world)[rank()]
    if full.dtype in (torch.float16, torch.bfloat16):
        # The sum of several ranks' fp16 gradients can pass 65504 where their mean does not (a
        # loss-scaled gradient near the top of the range): it would read as an overflow and skip
        # the step. Summed in fp32, it is rounded once, to the mean.
        wide = full.float()
        dist.all_reduce(wide, group=_group)
        return shard.copy_(wide.chunk(world)[rank()].div_(world))
    dist.all_reduce(full, group=_group)
    return shard.div_(world)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sums `t` over the data-parallel group, or over `group` (a model-parallel group) when given."""
    if group is not None:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
    elif world_size() > 1:
        dist.all_reduce(t, group=_group)
    return t


def barrier(everyone: bool = False) -> None:
    if world_size(everyone) > 1:
        dist.barrier(group=None if everyone else _group)


def all_gather_object(obj, everyone: bool = False):
    """Every rank's `obj` (picklable, small), in rank order."""
    world = world_size(everyone)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=None if everyone else _group)
    return out


def all_reduce_max(t: torch.Tensor, everyone: bool = False) -> torch.Tensor:
    if world_size(everyone) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=None if everyone else _group)
    return t


def broadcast(t: torch.Tensor, src: int) -> torch.Tensor:
    """`t` of the data-parallel group's rank `src`, on every rank of the group."""
    if world_size() > 1:
        dist.broadcast(t, global_rank(src), group=_group)
    return t
