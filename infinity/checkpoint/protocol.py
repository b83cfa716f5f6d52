"""What checkpointing needs of an engine: `Checkpointable`, the one view of it that `save`,
`load`, `export` and `pretrained` take. The engine implements it (infinity/engine/engine.py), and a
test implements it with plain tensors (tests/test_checkpoint_protocol.py), so this package can
be read and tested without the engine, and imports nothing of it.

[Note: the checkpoint protocol]
A checkpoint holds three things of an engine, and the protocol has one group of calls for each:
- this rank's shards of every unit: its fp32 optimizer state (master, exp_avg, exp_avg_sq) of
  the trainable region and its compute-dtype shard (read_* and write_*, `flush_shards` first);
- its small state (`TrainingState`: the counters, the optimizer's hyperparameters, the LR
  scheduler's and loss scaler's state, the device RNG), whose file format is this package's;
- whole units in the compute dtype or fp32 (export, pretrained weights), which every rank
  gathers together.
Around them, the engine says when values may be read or replaced (`check_step_boundary`), is
told when a load has replaced them (`after_load`) or failed half way (`mark_broken`), and
releases the units it keeps gathered while their shards are replaced (`replacing_shards`).
The units themselves (`infinity.zero.unit.Unit`) describe the layout: names, shapes, offsets
and shard lengths; the protocol never hands out a tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.zero.model_parallel import ModelParallel
from infinity.zero.unit import Unit


class TrainingState(NamedTuple):
    """An engine's state besides its shards and its module's buffers. On load, a field that is
    None keeps the engine's own value."""

    global_steps: int
    skipped_steps: int
    global_samples: int  # samples over all ranks in the steps taken (DeepSpeed's counter)
    micro_steps: int  # `step()` calls, a partial accumulation included
    optimizer: dict[str, Any] | None  # {"step_count": int, "param_groups": [each group but its "params"]}
    lr_scheduler: dict[str, Any] | None  # the scheduler's state_dict
    loss_scaler: dict[str, Any] | None  # the fp16 loss scaler's state_dict
    device_rng: torch.Tensor | None  # the accelerator's RNG state


class Checkpointable(Protocol):
    """An engine as checkpointing sees it ([Note: the checkpoint protocol])."""

    rank: int  # in the data-parallel group ([Note: the data-parallel group] in zero/dist.py)
    world_size: int  # of the data-parallel group
    model_parallel: ModelParallel | None  # the mpu's groups ([Note: model parallelism] in zero/model_parallel.py)
    config: InfinityConfig  # read: aio, batch sizes, zero placement, checkpoint, compute dtype
    module: nn.Module  # the model: its buffers, parameter names (tied ones too), Hugging Face config
    units: Sequence[Unit]  # the layout of every parameter; never gathered or released from here

    # ---- when values may be read or replaced -------------------------------------------------

    def check_step_boundary(self, what: str, replaces_all: bool = False) -> None:
        """Raises unless the engine is between steps (naming `what`) with every update
        applied; `replaces_all`: a load of every value, which mends a half-updated state."""

    def mark_broken(self, why: str, *, until_load: bool = False) -> None:
        """The values may be half-replaced: nothing is saved until a load succeeds."""

    def after_load(self) -> None:
        """New values were loaded: nothing of the step before them carries over."""

    # ---- the small state ----------------------------------------------------------------------

    def training_state(self) -> TrainingState: ...

    def load_training_state(self, state: TrainingState) -> None:
        """Takes every field of `state` that is not None."""

    # ---- this rank's shards -------------------------------------------------------------------

    def flush_shards(self) -> None:
        """Waits for the writes in flight: what is read next is the last step's result."""

    def optimizer_kinds(self) -> tuple[str, ...]:
        """The optimizer state this engine keeps per trainable shard: "master", then its update
        rule's moments (Adam both, Adagrad exp_avg_sq, Lion exp_avg, a client optimizer none:
        its state travels in its state_dict). A checkpoint holds these and no others."""

    def read_optimizer_shard(self, unit: Unit, kind: str) -> torch.Tensor:
        """This rank's `kind` (one of `optimizer_kinds()`) of a trainable unit: fp32,
        host, `train_shard_numel` elements; a view the caller must not change."""

    def read_param_shard(self, unit: Unit) -> torch.Tensor:
        """A host copy of this rank's shard in the compute dtype (`shard_numel` elements)."""

    def write_optimizer_shards(self, unit: Unit, values: dict[str, torch.Tensor]) -> None:
        """Replaces this rank's master, exp_avg and exp_avg_sq of a trainable unit."""

    def write_param_shard(self, unit: Unit, shard: torch.Tensor) -> None:
        """Replaces this rank's compute-dtype shard (host, `shard_numel` elements)."""

    def replacing_shards(self) -> AbstractContextManager[None]:
        """Units kept gathered for the whole run are released for the body, and gathered again
        from their new shards at its end (all ranks: the gather is a collective)."""

    # ---- whole units (every rank calls these together) ----------------------------------------

    def full_compute_values(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat buffer in the compute dtype, on the host."""

    def full_fp32_values(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat buffer in fp32 on the host (the masters where trainable)."""

    def set_fp32_values(self, unit: Unit, full: torch.Tensor) -> None:
        """Makes `full` (fp32, identical on every rank) the unit's masters and shards."""
