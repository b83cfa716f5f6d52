"""A unit: the parameters that are gathered and released together.

[Note: flat layout]
A unit's parameters are laid end to end in one flat buffer of the compute dtype, in two regions:
the trainable parameters first (ordered by optimizer param group, so each group is one
contiguous run and the optimizer updates a shard in a few long segments), then the frozen ones
([Note: frozen parameters]). Each region is padded so that every rank's chunk of it has the
same length, a whole number of 4 KiB pages. Rank r's shard is its chunk of the trainable
region followed by its chunk of the frozen region:

    flat:   [ train 0 | train 1 | ... | frozen 0 | frozen 1 | ... ]
    shard r: [ train r | frozen r ]      (train_shard_numel + frozen_shard_numel elements)

So the optimizer state of a shard is its first `train_shard_numel` elements, the same length on
every rank, and an update rewrites only that page-aligned prefix of the shard.

[Note: frozen parameters]
A parameter is frozen when it does not require grad or is in no optimizer param group. It has
a compute-dtype shard and nothing else: no fp32 master, moments or gradient buffer, and it is
never written back. Parameters that become trainable after `initialize` stay frozen.

[Note: releasing frees the memory]
Autograd keeps views of gathered parameters for backward (a Linear saves `weight.t()`), so
pointing `param.data` elsewhere frees nothing. The unit owns one flat tensor for its whole life;
its storage is freed in place (resized to 0 bytes) on release and refilled in place on the next
gather, as FSDP2 does. Views that autograd saved keep pointing into that same storage: they
hold no memory while the unit is released and see the values again once it is gathered, which
the pre-backward hook does before autograd reads them. While released, the parameters' `.data`
is an empty tensor, so user code that reads a released parameter sees 0 elements rather than
freed memory. A view of a parameter taken while gathered (`w = layer.weight.detach()` in a
forward hook) points into that storage too: it must not be used after the release. What users
gather by hand (`GatheredParameters`) goes into a fresh buffer instead, which lives as long as
any view of it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import nn

from infinity.offload.optimizer.accumulators import NORM_ROW
from infinity.offload.protocols import Segment, ShardParts
from infinity.zero import dist as zdist
from infinity.zero.model_parallel import is_model_parallel

SHARD_ALIGN_BYTES = 4096


class UnitState(enum.Enum):
    """Where a unit's full parameters are.

    RELEASED: the flat buffer's storage is 0 bytes and the parameters are empty tensors; only
        this rank's shard exists, in its tier.
    GATHERED: the flat buffer holds every rank's shard on the compute device and the
        parameters are views into it.
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
    group: int  # optimizer param group index; -1 for a frozen parameter


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Unit:
    """A group of parameters fetched and released together, flattened and sharded across ranks."""

    index: int
    name: str
    slots: list[ParamSlot]
    numel: int  # real elements (no padding)
    train_numel: int  # real trainable elements
    train_shard_numel: int  # elements per rank of the trainable region, padded
    frozen_shard_numel: int  # elements per rank of the frozen region, padded
    dtype: torch.dtype  # compute dtype
    device: torch.device
    persistent: bool  # gathered for the whole run (stage 1/2, small parameters)
    state: UnitState
    segments: list[Segment]  # the trainable part of this rank's shard, split by param group
    _flat: torch.Tensor  # 1-D, padded_numel, compute dtype, on device; storage 0 bytes when RELEASED
    _gathered: torch.Tensor | None  # the buffer the parameters point into: _flat, or a fresh one; GATHERED only

    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter, int]],
                 dtype: torch.dtype, device: torch.device, rank: int, world: int, persistent: bool = False,
                 model_parallel: bool = False):
        self.index, self.name, self.dtype, self.device = index, name, dtype, device
        self.persistent = persistent
        self.rank, self.world = rank, world
        align = world * SHARD_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        # Under model parallelism each group's model-parallel slices come first, and the others
        # start on a fresh norm row ([Note: model parallelism] in zero/model_parallel.py).
        marked = (lambda p: is_model_parallel(p)) if model_parallel else (lambda p: False)
        trainable = sorted((t for t in params if t[2] >= 0), key=lambda t: (t[2], not marked(t[1])))
        frozen = [t for t in params if t[2] < 0]
        self.slots = []
        offset, previous, mp_spans = 0, False, []
        for pname, p, group in trainable:
            if previous != marked(p):
                offset = _round_up(offset, NORM_ROW)
                previous = marked(p)
            self.slots.append(ParamSlot(p, pname, p.shape, offset, p.numel(), group))
            if marked(p):
                mp_spans.append((offset, offset + p.numel()))
            offset += p.numel()
        self.train_numel = offset  # real elements, and any gaps of the model-parallel layout
        train_padded = _round_up(offset, align)
        offset = train_padded
        for pname, p, group in frozen:
            self.slots.append(ParamSlot(p, pname, p.shape, offset, p.numel(), -1))
            offset += p.numel()
        self.numel = self.train_numel + offset - train_padded
        self.train_shard_numel = train_padded // world
        self.frozen_shard_numel = _round_up(offset - train_padded, align) // world
        self.segments = self._segments()
        self.mp_rows = self._mp_rows(mp_spans)
        self._gaps = bool(self.slots) and sum(s.numel for s in self.slots if s.group >= 0) != self.train_numel
        self.state = UnitState.RELEASED
        self._flat = torch.empty(0, dtype=dtype, device=device)
        self._gathered = None

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, numel={self.numel}, {self.state.value})"

    @property
    def shard_numel(self) -> int:
        return self.train_shard_numel + self.frozen_shard_numel

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def train_padded_numel(self) -> int:
        """Elements of the trainable region of the flat buffer (what gradients cover)."""
        return self.train_shard_numel * self.world

    @property
    def trainable(self) -> bool:
        return self.train_numel > 0

    @property
    def full(self) -> torch.Tensor:
        """The gathered flat buffer (every rank's shard, [Note: flat layout])."""
        assert self.state is UnitState.GATHERED, self
        return self._gathered

    def _regions(self) -> list[tuple[int, int, int]]:
        """(start in the flat buffer, start in this rank's shard, elements) of this rank's chunks."""
        ts, fs = self.train_shard_numel, self.frozen_shard_numel
        return [(self.rank * ts, 0, ts), (self.train_padded_numel + self.rank * fs, ts, fs)]

    def _segments(self) -> list[Segment]:
        lo, hi = self.rank * self.train_shard_numel, (self.rank + 1) * self.train_shard_numel
        runs: list[Segment] = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if s.group < 0 or a >= b:
                continue
            if runs and runs[-1].group == s.group and runs[-1].start + runs[-1].count == a - lo:
                runs[-1] = runs[-1]._replace(count=runs[-1].count + b - a)
            else:
                runs.append(Segment(s.group, a - lo, b - a))
        return runs

    def _mp_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor | None:
        """Which norm rows of this rank's trainable shard hold model-parallel slices (the others
        hold parameters every model-parallel rank has alike, or padding); None when none do."""
        if not spans:
            return None
        ts = self.train_shard_numel
        assert ts % NORM_ROW == 0, (ts, NORM_ROW)  # shards start on norm rows
        rows = torch.zeros(ts // NORM_ROW, dtype=torch.bool)
        lo = self.rank * ts
        for a, b in spans:
            a, b = max(a, lo) - lo, min(b, lo + ts) - lo
            if a < b:
                rows[a // NORM_ROW:-(-b // NORM_ROW)] = True
        return rows

    def split(self, shard: torch.Tensor) -> ShardParts:
        """A shard's two regions, as views."""
        ts = self.train_shard_numel
        return ShardParts(shard[:ts], shard[ts:ts + self.frozen_shard_numel])

    def local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard (a new tensor) of a full flat buffer laid out as the unit's."""
        out = torch.empty(self.shard_numel, dtype=flat.dtype, device=flat.device)
        for flat_start, shard_start, count in self._regions():
            out[shard_start:shard_start + count].copy_(flat[flat_start:flat_start + count])
        return out

    def initial_shard(self) -> torch.Tensor:
        """This rank's fp32 shard of the parameters' current values (called once, at partition).
        Each parameter's own copy is freed as soon as it is in the flat buffer, and a shard that is
        the whole flat buffer (one rank) is that buffer: a unit's values are in memory about twice
        at the most, not four times (a 557M-element layer held 7.7 GB here)."""
        flat = torch.zeros(self.padded_numel, dtype=torch.float32)
        with torch.inference_mode(False):
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            s.param.data = empty  # the shard holds the values now (`bind_params`)
        if self.shard_numel == self.padded_numel and all(a == b for a, b, _ in self._regions()):
            return flat
        return self.local_shard(flat)

    def bind_params(self) -> None:
        """Frees the module's own copies of the parameters; the unit's shards hold the values now."""
        self._set_param_data(None)

    def _set_param_data(self, flat: torch.Tensor | None) -> None:
        with torch.inference_mode(False):  # released under inference_mode: still a normal tensor
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty if flat is None else flat[s.offset:s.offset + s.numel].view(s.shape)

    # ---- state changes --------------------------------------------------------------------

    def to_gathered(self, parts: ShardParts, fresh: bool = False) -> None:
        """Refills the flat buffer's storage with every rank's shard and points the parameters
        into it ([Note: releasing frees the memory]); `fresh`: into a new buffer instead, one
        that views taken by the user may outlive the release."""
        assert self.state is UnitState.RELEASED, self
        assert parts.train.numel() == self.train_shard_numel and parts.frozen.numel() == self.frozen_shard_numel
        with torch.inference_mode(False):  # a first gather under inference_mode must not leave
            self._gather(parts, fresh)     # inference tensors that training cannot write into

    def _gather(self, parts: ShardParts, fresh: bool) -> None:
        if fresh:
            flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        elif self._flat.numel() == 0:  # the first gather: views autograd saves must all share this tensor
            flat = self._flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        else:
            flat = self._flat
            flat.untyped_storage().resize_(self.padded_numel * flat.element_size())
        self._gathered = self.gather_into(flat, parts)
        self._set_param_data(flat)
        self.state = UnitState.GATHERED

    def gather_into(self, flat: torch.Tensor, parts: ShardParts) -> torch.Tensor:
        """Fills `flat` (padded_numel elements, the dtype of `parts`) with every rank's shard,
        without changing the unit's state. Every rank must call it."""
        with torch.no_grad():
            tp = self.train_padded_numel
            for region, part in ((flat[:tp], parts.train), (flat[tp:], parts.frozen)):
                if part.numel():
                    zdist.all_gather(region, part)
        return flat

    def param_values(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """One parameter's view of a full flat buffer."""
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def to_released(self) -> None:
        assert self.state is UnitState.GATHERED, self
        self._set_param_data(None)
        if self._gathered is self._flat:
            self._flat.untyped_storage().resize_(0)
        self._gathered = None
        self.state = UnitState.RELEASED

    def take_grad(self, out: torch.Tensor) -> torch.Tensor:
        """The flat gradient of the trainable region (zeros where a parameter got none); clears
        .grad of every parameter.

        `out`: a buffer of train_padded_numel elements to reuse (a fresh one per call would be
        page-faulted in every time: 25 ms per 100 MB here). Units of other sizes that pad to the
        same size share it, so the padding is cleared too: it goes into the gradient norm."""
        assert out.numel() == self.train_padded_numel and out.dtype == self.dtype
        out[0 if self._gaps else self.train_numel:].zero_()
        for s in self.slots:
            g = s.param.grad
            s.param.grad = None
            if s.group < 0:
                continue
            region = out[s.offset:s.offset + s.numel]
            if g is not None:
                region.copy_(g.reshape(-1))
            else:
                region.zero_()
        return out
