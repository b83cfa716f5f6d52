"""DeepSpeed's model-parallel unit (`initialize(mpu=...)`) as the engine uses it.

[Note: model parallelism]
A model-parallel framework (Megatron-LM's tensor slicing) gives each process a slice of the
model and hands DeepSpeed an `mpu` that names two groups: the ranks holding the other slices of
the same replica (the model-parallel group) and the ranks holding the same slice in other
replicas (the data-parallel group). Under it, ZeRO is what it is without one, over the
data-parallel group only ([Note: the data-parallel group] in zero/dist.py): each model-parallel
rank's parameters are partitioned, gathered and their gradients averaged over its data-parallel
group, and the batch-size rule counts data-parallel ranks.

What crosses the model-parallel group is the global gradient norm, for clipping and for the
overflow check: a tensor-parallel parameter's slices are different numbers on each model-parallel
rank and their squares are summed over the group, while a parameter every model-parallel rank
holds alike (a layer norm, a replicated head) counts once. Parameters are told apart by the
attribute Megatron and DeepSpeed set on the slices, `tensor_model_parallel` or `model_parallel`
(true). A unit keeps its model-parallel parameters ahead of the others and starts the others on a
fresh norm row, so that its gradient's row norms ([Note: gradient norm by rows]) split cleanly into
the two sums (`Unit.mp_rows`).

Checkpoints are written per model-parallel rank, `<tag>/mp_rank_XX/` (DeepSpeed's naming), each a
whole checkpoint of that rank's slice over its data-parallel group ([Note: model-parallel
checkpoints] in checkpoint/model_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_MPU_METHODS = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group",
                "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")


def is_model_parallel(param: torch.Tensor) -> bool:
    """Whether `param` is one model-parallel rank's slice of a larger tensor (Megatron's marks)."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


class ModelParallel:
    """The groups of an `mpu`, read and checked once."""

    def __init__(self, mpu: Any):
        missing = [m for m in _MPU_METHODS if not callable(getattr(mpu, m, None))]
        if missing:
            raise TypeError(f"mpu: expected DeepSpeed's model-parallel unit, with {', '.join(_MPU_METHODS)}; "
                            f"{type(mpu).__name__} lacks {', '.join(missing)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("mpu: the model-parallel unit's groups are torch.distributed groups; initialise the "
                               "default process group first (torchrun, or torch.distributed.init_process_group)")
        self.rank, self.world = int(mpu.get_model_parallel_rank()), int(mpu.get_model_parallel_world_size())
        self.group = mpu.get_model_parallel_group()
        self.dp_rank, self.dp_world = int(mpu.get_data_parallel_rank()), int(mpu.get_data_parallel_world_size())
        self.dp_group = mpu.get_data_parallel_group()
        checks = [("get_model_parallel", self.group, self.rank, self.world),
                  ("get_data_parallel", self.dp_group, self.dp_rank, self.dp_world)]
        for name, group, rank, world in checks:
            if (dist.get_rank(group), dist.get_world_size(group)) != (rank, world):
                raise ValueError(f"mpu: {name}_rank() / _world_size() say {rank} of {world}, but this process is "
                                 f"rank {dist.get_rank(group)} of {dist.get_world_size(group)} in "
                                 f"{name}_group()")
        if self.world * self.dp_world != dist.get_world_size():
            raise ValueError(f"mpu: {self.world} model-parallel x {self.dp_world} data-parallel ranks, but the job "
                             f"has {dist.get_world_size()} processes (pipeline parallelism is not supported)")

    def __repr__(self) -> str:
        return f"ModelParallel(rank {self.rank} of {self.world}, data-parallel rank {self.dp_rank} of {self.dp_world})"
