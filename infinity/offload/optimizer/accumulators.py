"""Gradients on their way to the optimizer: copied to the host (`GradientLanding`), their norm
taken by rows (`row_norms_sq`), and, in the NVMe tier, accumulated between micro-steps in host
memory or spilled to the store (`Accumulators`).

[Note: gradient spill]
Gradients are reduced to this rank's shard and accumulated on the host (in fp32 where passes
accumulate: [Note: one pass keeps its own dtype]). When the update
waits for the step (clipping or fp16 needs the global norm first, or several micro-steps
accumulate), every unit needs an accumulator until then: units are given one in host memory in
the order the step updates them while `max_grad_in_cpu` elements last (backward order; forward
order when the updates wait for the next forward, where the embedding's gradient, final last,
is the first one needed); the gradients of the others spill to the
store as kind "grad", cut into the same pieces as the state, so the update reads them beside
master, exp_avg and exp_avg_sq (4 bytes a parameter written in backward and read in the step;
a later micro-step reads, adds and writes back). With the update in backward on one micro-step
no accumulator is needed: the fp32 shard goes straight into the update.

[Note: one pass spills its own dtype]
When an accumulation is one pass (gradient_accumulation_steps 1), a spilled gradient is never
added to: it is the landed gradient itself, in the compute dtype, so it spills as it landed (2
bytes a parameter in bf16 or fp16, not 4). The fp32 copy held nothing the half one lacks: each
value widens exactly, the kernel widens it in its pass as it does a fresh gradient, and the row
norms are taken from the same values ([Note: gradient norm by rows]), so the step's bits do not
change. A clipped or fp16 step whose gradients spill then writes and reads half the bytes for
them: the 3B preset's 12.8 GB of fp32 spill became 6.4 GB each way. Should passes accumulate all
the same (`set_gradient_accumulation_boundary(False)` against a config of 1), a unit that spilled
half takes an fp32 accumulator in host memory from then on, beyond `max_grad_in_cpu` (the
placement plan does not count it), and says so once: a half sum would round.

[Note: one pass keeps its own dtype]
The same holds in host memory: with one pass an accumulation, a unit's accumulator is in the
compute dtype (2 bytes a parameter instead of 4), the landed gradient copied in as it is, in
the NVMe tier and in the CPU one (offload_optimizer cpu, where the CPU kernel reads it; a client
torch optimizer, or torch ops on the device, take fp32 ones). The
clipped step's backward then writes half the bytes into it and its update reads half, and
`max_grad_in_cpu` elements take half the memory (a 3.2B model's: 6.4 GB, not 12.8). A pass
that starts an accumulation of several all the same replaces it by an fp32 one (`_widen`, said
once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from infinity.device import Device, InFlight
from infinity.device.timeline import TIMELINE
from infinity.offload import BufferPool, Swapper
from infinity.offload.protocols import TierUnit

log = logging.getLogger("infinity")

GRAD = "grad"  # the store's kind of spilled gradient accumulators ([Note: gradient spill])

NORM_ROW = 1024  # elements; see [Note: gradient norm by rows]
# [Note: one pass keeps its own dtype]; the tests set it False for the fp32 accumulators they compare the bits with
ONE_PASS_KEEPS_ITS_DTYPE = True
_WIDEN_BLOCK = 256 * NORM_ROW


def widened(numel: int, device: torch.device, said: bool) -> torch.Tensor:
    """The fp32 accumulator that replaces a unit's half one (kept or spilled) when a pass starts an
    accumulation of several ([Note: one pass keeps its own dtype]); logs why, unless `said`."""
    if not said:
        log.warning("offload_optimizer: gradients accumulate over several passes although "
                    "gradient_accumulation_steps is 1 (set_gradient_accumulation_boundary(False)); the units whose "
                    "gradients wait in bf16/fp16 (in host memory, or spilled to NVMe) take fp32 accumulators in host "
                    "memory for it, twice the bytes, and beyond offload_optimizer.max_grad_in_cpu for those that "
                    "spilled: set gradient_accumulation_steps to the passes accumulated")
    return torch.zeros(numel, dtype=torch.float32, device=device)


def row_norms_sq(g: torch.Tensor) -> torch.Tensor:
    """Squared 2-norms, in fp32, of `g`'s consecutive rows of NORM_ROW elements (the last row
    may be shorter); `g` may be any float dtype. Inf or nan where a row holds one.

    [Note: gradient norm by rows]
    The squared norm of a gradient shard is the sum of its row norms, summed in one call over
    the whole shard's rows. A spilled gradient meets the update piece by piece, but pieces
    start on row boundaries (PIECE_ALIGN), so their rows are the shard's rows: concatenated,
    they give the same vector and the same sum, to the bit, as the gradient whole in memory,
    and the clip coefficient does not depend on where the gradient lived or on sub_group_size.
    """
    n = g.numel()
    full = n // NORM_ROW * NORM_ROW
    out = torch.empty(-(-n // NORM_ROW), dtype=torch.float32, device=g.device)
    if g.dtype == torch.float32:
        torch.linalg.vector_norm(g[:full].view(-1, NORM_ROW), dim=1, out=out[:full // NORM_ROW])
    else:
        # Widened a block at a time into one small buffer: converting the whole shard would
        # allocate (and page-fault) 4 bytes an element, slower than the norm itself.
        scratch = torch.empty(min(full, _WIDEN_BLOCK), dtype=torch.float32, device=g.device)
        for lo in range(0, full, _WIDEN_BLOCK):
            hi = min(full, lo + _WIDEN_BLOCK)
            block = scratch[:hi - lo]
            block.copy_(g[lo:hi])
            torch.linalg.vector_norm(block.view(-1, NORM_ROW), dim=1, out=out[lo // NORM_ROW:hi // NORM_ROW])
    if full < n:
        out[-1] = torch.linalg.vector_norm(g[full:], dtype=torch.float32)
    return out.square_()


def norm_parts(rows: torch.Tensor, mp_rows: torch.Tensor | None) -> torch.Tensor:
    """A shard's squared norm from its row norms, as [model-parallel part, the rest] (float32;
    [Note: model parallelism] in zero/model_parallel.py): `mp_rows` marks the rows of
    model-parallel slices; None, as without model parallelism, puts every row in the rest."""
    if mp_rows is None:
        return torch.stack([torch.zeros((), dtype=torch.float32, device=rows.device), rows.sum()])
    mp_rows = mp_rows.to(rows.device)
    return torch.stack([rows[mp_rows].sum(), rows[~mp_rows].sum()])


class GradientLanding:
    """Gradient shards on their way from the compute device into host memory.

    [Note: gradients to the host]
    A unit's reduced gradient shard is copied device -> host on the device's copy-out stream into
    a page-locked pool buffer (`land`), and the host consumes it (accumulation, spill, norm) one
    unit later (`consume_landed`, called by the next `land` and before anything reads the gradients), so
    the copy runs under the next unit's backward instead of stopping the compute for each unit.
    The copy reads the engine's reused gradient buffer: the engine waits for it
    (`Device.wait_compute`) before the next unit overwrites that buffer.
    """

    def __init__(self, device: Device, units: list[TierUnit], name: str):
        self.device = device
        largest = max((u.train_shard_numel * u.dtype.itemsize for u in units), default=1)
        # One buffer for the copy in flight, one for the gradient a host consumer still holds.
        self.pool = BufferPool(2, largest, pin=device.pin() or None, name=name, on_release=device.scribble)
        self._in_flight: list[tuple[InFlight, torch.Tensor, Callable[[torch.Tensor], bool]]] = []

    def land(self, grad_shard: torch.Tensor, consume: Callable[[torch.Tensor], bool]) -> InFlight:
        """Starts the copy of `grad_shard`; `consume(host_copy)` runs at the next `consume_landed` and
        returns True when it keeps the buffer (then `release` gives it back later)."""
        self.consume_landed()
        nbytes = grad_shard.numel() * grad_shard.element_size()
        buffer = self.pool.acquire(nbytes)
        copy = self.device.to_host(grad_shard, buffer.view(grad_shard.dtype))
        self._in_flight.append((copy, buffer, consume))
        return copy

    def consume_landed(self) -> None:
        """Consumes every gradient in flight (waiting for its copy). If a consumer raises (a
        spilled gradient's read failed), its buffer goes back and the rest stay pending."""
        while self._in_flight:
            copy, buffer, consume = self._in_flight.pop(0)
            with TIMELINE.span("gradient copy to host", "wait"):
                self.device.wait_host(copy)
            kept = False
            try:
                kept = consume(copy.tensor)
            finally:
                if not kept:
                    self.pool.release(buffer)

    def release(self, host_copy: torch.Tensor) -> None:
        self.pool.release(host_copy)

    def discard(self) -> None:
        """Drops the gradients in flight (a failed backward), once their copies have landed."""
        pending, self._in_flight = self._in_flight, []
        for copy, buffer, _ in pending:
            self.device.wait_host(copy)
            self.pool.release(buffer)


class Accumulators:
    """Where each unit's gradient waits for its update in the NVMe tier ([Note: gradient spill]):
    an accumulator in host memory (`host`: the compute dtype with one pass, else fp32), one spilled to the store as kind GRAD, cut into
    the pieces of the unit's state (`spilled`), or none: the landed gradient feeds the update at
    once (`fresh`, until the update gives its buffer back)."""

    def __init__(self, device: Device, units: list[TierUnit], room: int, no_accumulator: set[int],
                 update_order: list[int], one_pass: bool = False):
        self.landing = GradientLanding(device, units, "offload_optimizer")
        self.host: dict[int, torch.Tensor] = {}  # unit -> its accumulator, 1-D, train_shard_numel
        self.spilled: set[int] = set()
        # unit -> the dtype its spilled gradient is stored in ([Note: one pass spills its own dtype])
        self.spill_dtype: dict[int, torch.dtype] = {}
        self._numel = {u.index: u.train_shard_numel for u in units}
        self.fresh: dict[int, torch.Tensor] = {}  # unit -> its landed gradient (a landing buffer)
        self.sq: dict[int, torch.Tensor] = {}  # unit -> its final gradient's squared row norms
        place = {index: k for k, index in enumerate(update_order)}
        for u in sorted(units, key=lambda u: place.get(u.index, len(place))):
            if u.index in no_accumulator:
                continue
            if u.train_shard_numel <= room:  # in the order the step needs them, while room lasts
                room -= u.train_shard_numel
                half = one_pass and ONE_PASS_KEEPS_ITS_DTYPE  # [Note: one pass keeps its own dtype]
                self.host[u.index] = torch.zeros(u.train_shard_numel, dtype=u.dtype if half else torch.float32)
            else:
                self.spilled.add(u.index)
                self.spill_dtype[u.index] = u.dtype if one_pass else torch.float32
        self._swapper: Swapper | None = None  # the store's, once it exists (`bind`)
        self._pool: BufferPool | None = None
        self._widened = False  # said once that a half spill took an fp32 accumulator

    def bind(self, swapper: Swapper, pool: BufferPool) -> None:
        """The store and pool that spilled accumulators live in (they are sized knowing whether
        any unit spills, so they come after the placement above)."""
        self._swapper, self._pool = swapper, pool

    def consume(self, index: int, g: torch.Tensor, first: bool, last: bool, cuts: list[tuple[int, int]]) -> bool:
        """Adds a landed gradient (host, compute dtype) in; True when it keeps `g`'s buffer.
        `cuts`: the unit's pieces, which a spilled accumulator is cut into."""
        with TIMELINE.span("grad_accumulate", unit=index):
            # Any float dtype: copy_/add_ and the Adam kernel convert it in their pass.
            if index in self.host:
                if not (first and last) and self.host[index].dtype != torch.float32:
                    self._widen(index)  # [Note: one pass keeps its own dtype]
                acc = self.host[index]
                acc.copy_(g) if first else acc.add_(g)
                if last:
                    self.sq[index] = row_norms_sq(acc)
                return False
            if index in self.spilled and not (first and last) and self.spill_dtype[index] != torch.float32:
                self._widen(index)  # [Note: one pass spills its own dtype]
                return self.consume(index, g, first, last, cuts)
            if index in self.spilled:
                self._spill(index, g, first, last, cuts)
                return False
            # Kept for the update that follows at once, which gives the buffer back.
            assert first and last, "gradients without an accumulator must be used by the update they feed"
            self.fresh[index] = g
            self.sq[index] = row_norms_sq(g)
            return True

    def spill_layout(self, cuts: dict[int, list[tuple[int, int]]]) -> dict[tuple[int, int], int]:
        """The store's bytes for each piece of each spilled unit (`cuts`: its pieces' (start, count))."""
        return {(i, k): n * self.spill_dtype[i].itemsize for i in self.spilled for k, (_, n) in enumerate(cuts[i])}

    def dtype(self, kind: str, index: int) -> torch.dtype:
        """The dtype unit `index`'s `kind` (master, or GRAD) is stored in: a spilled gradient's own
        ([Note: one pass spills its own dtype]), else fp32."""
        return self.spill_dtype[index] if kind == GRAD else torch.float32

    def _widen(self, index: int) -> None:
        """A unit whose gradient is kept or spilled in its compute dtype meets an accumulation of
        several passes: it takes an fp32 accumulator in host memory ([Note: one pass spills its
        own dtype], [Note: one pass keeps its own dtype]). A pass that is not the first of its
        accumulation has an fp32 one already, so nothing held is lost."""
        self.spilled.discard(index)
        self.host[index] = widened(self._numel[index], torch.device("cpu"), said=self._widened)
        self._widened = True

    def _spill(self, index: int, g: torch.Tensor, first: bool, last: bool, cuts: list[tuple[int, int]]) -> None:
        swapper = self._swapper
        dtype = self.spill_dtype[index]  # fp32, or the landed dtype when one pass is the sum
        size = dtype.itemsize
        rows = []
        for k, (start, n) in enumerate(cuts):
            if first:
                acc = swapper.acquire(n * size).view(dtype)[:n]
                acc.copy_(g[start:start + n])
            else:
                acc = swapper.wait(swapper.fetch(GRAD, (index, k))).view(torch.float32)[:n]
                acc.add_(g[start:start + n])
            if last:
                rows.append(row_norms_sq(acc))
            if first:
                swapper.evict(GRAD, (index, k), self._pool.base(acc)[:n * size])
            else:
                swapper.release(GRAD, (index, k), dirty=True)
        if last:
            self.sq[index] = torch.cat(rows)

    def for_update(self, unit: TierUnit) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the gradient the update reads, or None where it reads a spilled one piece by piece;
        the landing buffer the update gives back with `release`, or None)."""
        index = unit.index
        fresh = self.fresh.pop(index, None)
        grad = self.host.get(index, fresh)
        if grad is None and index not in self.spilled:
            grad = torch.zeros(unit.train_shard_numel, dtype=torch.float32)  # no gradient reached this unit
        return grad, fresh

    def release(self, fresh: torch.Tensor) -> None:
        self.landing.release(fresh)

    def end_step(self) -> None:
        """A landed gradient that no update used (a skipped step) goes back; the norms go."""
        for g in self.fresh.values():
            self.landing.release(g)
        self.fresh.clear()
        self.sq.clear()
