"""A unit: the parameters that are gathered and released together.

[Note: flat layout]
A unit's parameters are laid end to end in one flat buffer of the compute dtype, padded so that
every rank's shard has the same length and that length is a whole number of 4 KiB pages (so each
shard's byte offset in a file is O_DIRECT-aligned). Rank r owns elements
[r * shard_numel, (r + 1) * shard_numel). Parameters are ordered by optimizer param group first,
so each group is one contiguous run and the optimizer updates a shard in a few long segments.

[Note: parameter storage swap]
The nn.Parameter objects stay the module's attributes for the whole run (optimizers, tied
weights and user code keep working); only their `.data` changes: a view into the gathered flat
buffer while the unit is GATHERED, an empty tensor while it is RELEASED. Autograd saves leaf
parameters by reference, so a unit's backward needs it gathered again (the pre-backward hook).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import nn

from infinity.zero import dist as zdist

SHARD_ALIGN_BYTES = 4096


class UnitState(enum.Enum):
    """Where a unit's full parameters are.

    RELEASED: parameters are empty tensors; only this rank's shard exists, in its tier.
    GATHERED: `Unit.full` holds every rank's shard on the compute device and the parameters
        are views into it.
    """

    RELEASED = "released"
    GATHERED = "gathered"


class ParamSlot(NamedTuple):
    """One parameter's place in its unit's flat buffer."""

    param: nn.Parameter
    name: str
    shape: torch.Size
    offset: int  # elements from the start of the flat buffer
    numel: int
    group: int  # optimizer param group index


class Segment(NamedTuple):
    """A run of this rank's shard that belongs to one optimizer param group."""

    group: int
    start: int  # elements from the start of the shard
    count: int


class Unit:
    """A group of parameters fetched and released together, flattened and sharded across ranks."""

    index: int
    name: str
    slots: list[ParamSlot]
    numel: int  # real elements (no padding)
    shard_numel: int  # elements per rank, padded
    dtype: torch.dtype  # compute dtype
    device: torch.device
    persistent: bool  # gathered for the whole run (stage 1/2, small parameters)
    state: UnitState
    full: torch.Tensor | None  # 1-D, world * shard_numel, compute dtype, on device; GATHERED only
    segments: list[Segment]  # this rank's shard split by param group

    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter, int]],
                 dtype: torch.dtype, device: torch.device, rank: int, world: int, persistent: bool = False):
        self.index, self.name, self.dtype, self.device = index, name, dtype, device
        self.persistent = persistent
        self.rank, self.world = rank, world
        self.slots = []
        offset = 0
        for pname, p, group in sorted(params, key=lambda t: t[2]):
            self.slots.append(ParamSlot(p, pname, p.shape, offset, p.numel(), group))
            offset += p.numel()
        self.numel = offset
        align = SHARD_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        per_rank = -(-max(self.numel, 1) // world)
        self.shard_numel = -(-per_rank // align) * align
        self.segments = self._segments()
        self.state = UnitState.RELEASED
        self.full = None

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, numel={self.numel}, {self.state.value})"

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    def _segments(self) -> list[Segment]:
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        runs: list[Segment] = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a >= b:
                continue
            if runs and runs[-1].group == s.group and runs[-1].start + runs[-1].count == a - lo:
                runs[-1] = runs[-1]._replace(count=runs[-1].count + b - a)
            else:
                runs.append(Segment(s.group, a - lo, b - a))
        return runs

    def initial_shard(self) -> torch.Tensor:
        """This rank's fp32 shard of the parameters' current values (called once, at partition)."""
        shard = torch.zeros(self.shard_numel, dtype=torch.float32)
        lo = self.rank * self.shard_numel
        for s in self.slots:
            a, b = max(lo, s.offset), min(lo + self.shard_numel, s.offset + s.numel)
            if a < b:
                flat = s.param.detach().reshape(-1)
                shard[a - lo:b - lo].copy_(flat[a - s.offset:b - s.offset])
        return shard

    def detach_params(self) -> None:
        """Frees the module's own copies of the parameters; the unit's shards hold the values now."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty

    # ---- state changes --------------------------------------------------------------------

    def to_gathered(self, shard: torch.Tensor) -> None:
        """All-gathers every rank's shard into `full` and points the parameters into it."""
        assert self.state is UnitState.RELEASED, self
        assert shard.numel() == self.shard_numel and shard.dtype == self.dtype, (shard.shape, shard.dtype)
        if self.world == 1:
            self.full = shard  # a view: nothing to gather
        else:
            self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
            zdist.all_gather(self.full, shard)
        for s in self.slots:
            s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)
        self.state = UnitState.GATHERED

    def to_released(self) -> None:
        assert self.state is UnitState.GATHERED, self
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty
        self.full = None
        self.state = UnitState.RELEASED

    def take_grad(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat gradient of the full unit (zeros where a parameter got none); clears .grad.

        `out`: a buffer of padded_numel elements to reuse, whose padding is already zero (a
        fresh one per call would be page-faulted in every time: 25 ms per 100 MB here)."""
        if out is None:
            out = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        assert out.numel() == self.padded_numel and out.dtype == self.dtype
        for s in self.slots:
            g = s.param.grad
            region = out[s.offset:s.offset + s.numel]
            if g is not None:
                region.copy_(g.reshape(-1))
                s.param.grad = None
            else:
                region.zero_()
        return out

    def params_requiring_grad(self) -> int:
        return sum(1 for s in self.slots if s.param.requires_grad)
