"""The loader `initialize(training_data=...)` returns (DeepSpeed's `deepspeed_io`)."""

from __future__ import annotations

from typing import Any

import torch


class _Sampler(torch.utils.data.DistributedSampler):
    """A DistributedSampler that knows whether its user set the epoch since the last pass."""

    user_set_epoch = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.user_set_epoch = True


class TrainingDataLoader(torch.utils.data.DataLoader):
    """The third value `initialize(training_data=...)` returns, batched as DeepSpeed's is:
    `train_micro_batch_size_per_gpu` samples a batch, a shuffled DistributedSampler (seed 0)
    over the data-parallel ranks, and each new pass over it a new epoch (another order) unless
    the script calls `loader.sampler.set_epoch` itself. Batches stay on the host; the engine
    moves them. Unlike DeepSpeed's loader it loads in the calling process (no worker processes)."""

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, collate_fn: Any = None,
                 drop_last: bool = False):
        sampler = _Sampler(dataset, num_replicas=world_size, rank=rank)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
        self._passes = 0

    def __iter__(self):
        sampler = self.sampler
        if self._passes and not sampler.user_set_epoch:
            sampler.epoch += 1
        sampler.user_set_epoch = False
        self._passes += 1
        return super().__iter__()
