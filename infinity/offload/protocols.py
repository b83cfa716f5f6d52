"""What the engine, the fetcher and the hooks need from a parameter tier and an optimizer tier,
and what a tier reads of a unit (`TierUnit`: infinity/zero/unit.py's `Unit` is one; the tiers
sit below the partitioner and never import it).

`ResidentParams` (infinity.offload.params.memory) and `NvmeParams` (infinity.offload.params.nvme) are
parameter tiers; `ResidentOptimizerState` (infinity.offload.optimizer.memory) and `NvmeOptimizerState`
(infinity.offload.optimizer.nvme) are optimizer tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import torch

from infinity.device import InFlight

if TYPE_CHECKING:
    from infinity.optim.functional import AdamHyper


class Segment(NamedTuple):
    """A run of this rank's shard that belongs to one optimizer param group."""

    group: int
    start: int  # elements from the start of the shard
    count: int


class ShardParts(NamedTuple):
    """A shard as its two regions ([Note: flat layout] in infinity/zero/unit.py); either may
    have 0 elements."""

    train: torch.Tensor  # 1-D, train_shard_numel elements
    frozen: torch.Tensor  # 1-D, frozen_shard_numel elements


class TierUnit(Protocol):
    """What a tier reads of a unit: which it is and how its shard is laid out."""

    index: int  # the unit's key in every tier
    dtype: torch.dtype  # the compute dtype of its parameters
    shard_numel: int  # elements of this rank's shard, both regions, padded
    train_shard_numel: int  # of the trainable region (what has optimizer state)
    frozen_shard_numel: int  # of the frozen region
    segments: list[Segment]  # the trainable region, by optimizer param group
    mp_rows: torch.Tensor | None  # norm rows of model-parallel slices ([Note: model parallelism])

    @property
    def trainable(self) -> bool: ...

    def split(self, shard: torch.Tensor) -> ShardParts:
        """The shard's two regions, as views."""


class ParamTier(Protocol):
    """What the fetcher and the optimizer need from a parameter tier."""

    def add(self, unit: TierUnit, values: torch.Tensor) -> None:
        """Takes ownership of the unit's first shard values (fp32, host)."""

    def prefetch(self, unit: TierUnit) -> bool:
        """Starts moving the shard toward the device and returns at once: True if a transfer
        was issued for the next `fetch`, False if none could be (one pending, or no buffer)."""

    def ready(self, unit: TierUnit) -> bool:
        """Whether `fetch(unit)` would not block the host (its prefetch has arrived in host
        memory; a host -> device copy may still be in flight, which `fetch` orders on the
        device, not on the host); never blocks."""

    def fetch(self, unit: TierUnit) -> ShardParts:
        """The shard on the compute device, ready for the compute issued from now on (waits
        for a prefetch in flight); valid until `done`."""

    def done(self, unit: TierUnit) -> None:
        """The gathered unit has copied what `fetch` handed out: host buffers behind it go back
        once the device's copy has read them, never under it."""

    def drop_prefetched(self) -> None:
        """Forgets prefetches not fetched (the schedule changed, or the step ended)."""

    def set_schedule(self, order: list[int]) -> None:
        """The recorded order of unit uses, for eviction by next use."""

    def flush(self) -> None:
        """Waits for writes of new values in flight; raises if one failed."""

    def hold_writes(self) -> None:
        """Holds the writes of new values from now until `release_writes` (or until something
        waits for one): [Note: parameter writes held for the backward] in offload/held_writes.py."""

    def release_writes(self) -> None:
        """Submits the writes held, and holds no more."""

    def update_target(self, unit: TierUnit, on_device: bool) -> torch.Tensor:
        """A tensor of `train_shard_numel` elements in the compute dtype, on the compute device
        when `on_device` (the optimizer's state lives there) else in host memory, that the
        optimizer fills with the new trainable part of the shard (the frozen part never changes);
        the tier takes it back at `commit` and hands it out again only once what `commit`
        started has finished reading it."""

    def commit(self, unit: TierUnit) -> None:
        """The new values in `update_target(unit)` are final: make them the shard's trainable part."""

    def replace(self, unit: TierUnit, shard: torch.Tensor) -> None:
        """Makes `shard` (host, compute dtype, both parts) the unit's shard, at once."""

    def host_copy(self, unit: TierUnit) -> torch.Tensor:
        """A host tensor with the shard's current values (for checkpoints)."""

    def io_stats(self) -> dict[str, float]:
        """NVMe traffic since the last call, for the step report (empty without NVMe)."""

    def close(self) -> None: ...


class OptimizerTier(Protocol):
    """fp32 master, exp_avg, exp_avg_sq and gradient accumulator of the trainable part of each
    unit's shard: what a tier is. How it follows the step's schedule is `StepListener`'s."""

    on_device: bool  # the state lives on the compute device: `update`'s `out` must be there too
    # Whether updates after the norm may wait for each unit's next use ([Note: update modes] in
    # step_policy.py): then the tier is a `StepListener` whose reads follow the pending order.
    updates_can_wait: ClassVar[bool]
    chosen: dict | None  # what the tier sized itself within the config's budgets (the NVMe pool), for reports

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        """Takes the unit's first fp32 master values (host)."""

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight | None:
        """Adds a reduced gradient shard (on the compute device) into the fp32 accumulator
        (`first`: replaces it); `last`: the final micro-step's, so the unit's state may start
        moving for the step. Returns the copy that reads `grad_shard`, if one is in flight: the
        caller waits for it (`Device.wait_compute`) before it overwrites that memory."""

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        """Squared 2-norm of the unit's final gradient ([Note: gradient norm by rows]), on the host,
        as [model-parallel slices' part, the rest's] (`norm_parts`)."""

    def update(self, unit: TierUnit, hypers: list["AdamHyper"], step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        """One Adam step of the unit's shard, writing the new values in `out`'s dtype into `out`
        (`ParamTier.update_target(unit, on_device)`)."""

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor | None:
        """The unit's fp32 "master", "exp_avg", "exp_avg_sq" or accumulated "grad" in host memory
        (a copy, or the tier's own tensor where it lives there: read it before the next update);
        None for a gradient no accumulator keeps."""

    def write(self, unit: TierUnit, values: dict[str, torch.Tensor]) -> None:
        """Makes the given kinds of `values` (host fp32; any of master, exp_avg, exp_avg_sq) the unit's."""

    def flush(self) -> None:
        """Completes the previous step's writes, raising a failed one."""

    def io_stats(self) -> dict[str, float]:
        """NVMe traffic since the last call, for the step report (empty without NVMe)."""

    def close(self) -> None: ...


class StepListener(Protocol):
    """How an optimizer tier follows the step ([Note: the step's orders] in offload/schedule.py):
    when to read state ahead and when to give back what it read. Each call comes after the
    schedule has recorded what it says."""

    def begin_pass(self, last: bool) -> None:
        """A training forward starts; `last`: its micro-step ends an accumulation (its gradients are final)."""

    def step_order(self, units: list[TierUnit]) -> list[TierUnit]:
        """The order in which to update `units` (those whose state is read already first)."""

    def set_pending(self) -> None:
        """The schedule's pending updates wait for their next use (`updates_can_wait` tiers
        only): the tier may start reading their state now."""

    def drop_pending(self) -> None:
        """The pending updates will not run: their reads ahead go back."""

    def finish_step(self) -> None:
        """The step's updates are done (or it was abandoned): what it read ahead or kept goes back."""

    def abort_pass(self) -> None:
        """A backward failed: gradients in flight are dropped, buffers given back."""

    def poll(self) -> None:
        """The compute thread is between two ops of a unit, in forward or backward ([Note: between
        a unit's ops] in infinity/zero/hooks.py): the tier may start the reads its pool has room
        for now, never waiting."""
