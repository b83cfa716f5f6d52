"""`deepspeed.comm`: torch.distributed's collectives under DeepSpeed's module, with
`init_distributed` (infinity's: the launcher's environment, else one process) and the few
helpers DeepSpeed adds. Every call is torch.distributed's own, on its default process group."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed import (P2POp, ReduceOp, all_gather, all_gather_into_tensor, all_gather_object, all_reduce,
                               all_to_all, all_to_all_single, barrier, batch_isend_irecv, broadcast,
                               broadcast_object_list, destroy_process_group, gather, get_backend, get_global_rank,
                               get_rank, get_world_size, irecv, is_available, is_initialized, isend, monitored_barrier,
                               new_group, recv, reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)

from infinity.deepspeed._compat import init_distributed

__all__ = ["P2POp", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
           "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank",
           "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
           "inference_all_reduce", "init_distributed", "irecv", "is_available", "is_initialized", "isend",
           "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
           "send"]


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (LOCAL_RANK; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group():
    return dist.group.WORLD


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's all-reduce for inference kernels: torch.distributed's all_reduce here."""
    return all_reduce(tensor, op=op, group=group)
