"""`offload_optimizer.device: nvme`: the fp32 master and the rule's moments (fp32, bf16 or 8-bit:
[Note: update rules] in infinity/optim/rules.py) of every shard live in the NVMe store, cut into pieces (sizing.py: [Note: cutting pieces], [Note: the pool is a budget]),
each a record that says where its bytes are (pieces.py: [Note: a piece's place]); gradients wait
for the update in accumulators (accumulators.py: [Note: gradient spill]). This module is the
update pipeline over them: what is read ahead, in which order, and how a failed update resumes.

[Note: pipelined step]
A unit's update streams its pieces through the pool: the reads of piece k+1 (one per kind) are in
flight while the CPU kernel updates piece k in place, and piece k-1's writes (issued by
`release(dirty=True)` the moment its update ended) drain behind both. Pieces of the next unit
are read while the last pieces of this one are updated, so the disk never waits for a unit
boundary. The update's pass also writes the new compute-dtype parameter into the parameter tier's
target buffer, so no second pass over the shard is needed.

Reads start earlier than the step: when a unit's gradient becomes final during the last
micro-step's backward, the reads of its pieces are issued (`accumulate(last=True)`) as long as
the pool has buffers to spare beyond the step's own pipeline, and the step updates units in
that order. A larger `offload_optimizer.buffer_count` therefore moves more of the state
traffic under backward's compute.

[Note: reading ahead in the expected order]
In the last micro-step the reads do not wait for a unit's gradient: units become final in the
same order every step (reverse forward order), so the order recorded in the previous step (in
the first step, the order the engine expects from the module order) says which unit comes next,
and its pieces are read from the start of that micro-step's forward, while the units before it
compute, as far as the pool allows (`_read_ahead`). When updates wait for the next forward
([Note: updates after the norm] in step_policy.py) they run in that forward's order, not in the
order gradients became final: the reads then follow the last pending order instead, so the
first units the next forward updates (the embedding, whose gradient is final last) are the first
read; where the pool has room, a unit's pieces are fetched again for the next step right after
its update released them, while their write is in flight, which costs no read at all. With the
update during backward (no clipping, no fp16: [Note: update during backward] in step_policy.py)
the state of a unit is then in memory when its gradient is final, its update runs at once, and
its writes drain behind the next unit's backward. Those writes hold the buffers the next unit's
reads need and give them back while that unit computes, where the tier is not called: so the
unit hooks `poll` inside each unit's compute ([Note: between a unit's ops] in zero/hooks.py), and
the reads start there, not at the unit's end (where each unit's update waited on its own reads).

[Note: reads in update order]
An update takes its pieces one after the other and needs buffers for the piece it updates and
the next; reads issued ahead wait in the pool until their update comes. If the pool fills with
reads of pieces whose updates come later while a piece updated sooner is still on disk, the
update waits for a buffer that only a later update would give back: it never comes. So reads
ahead are issued in the order the updates will take them (`in_order`), keeping two pieces'
buffers back; when the order changes under reads already issued (the first step's order is a
guess, and `step()` then learns the forward's), those after the first piece still on disk go back
(`_in_update_order`); and an updated piece the pool would hold is written back instead when
keeping it would leave the rest of the update less than a piece's buffers. An update also reads
its unit's later pieces as the writes before them give buffers back (`_refill`), not only the
next one, which streamed a unit the pool had not read ahead one piece at a time.

[Note: failed transfers give their buffers back]
A read that failed holds nothing; every other buffer an update holds when a read or a fetch
fails (the piece's other kinds, the piece read ahead, the gradient it was given, the reads of
its later pieces issued ahead) goes back to the pool before the error is raised: nothing waits
for a buffer that nobody will release. A failed write leaves its shard INVALID: its bytes are
never taken for good, and the state is damaged ([Note: resuming an update]).

[Note: resuming an update]
An update writes each piece back as soon as it is updated (or keeps it, held, in its buffers:
[Note: the pool is a budget]), so when piece k's read fails, pieces 0..k-1 hold the new values
on disk, on their way there or in the pool, and the others the old ones. Running
the whole update again would apply Adam twice to 0..k-1, so the tier records how many pieces are
done (`_resume`, set before a piece's writes start) and the next `update` of the unit, with the
same arguments, starts at the first piece not done: the result is the same, bit for bit, as one
update that never failed. A failed read changes nothing on disk, so that is exact whenever the
failure is an OSError and no shard of the unit lost its bytes to a failed write. Otherwise (a
write failed, a gradient spilled to a shard whose write failed, any other exception) the unit is
damaged: the tier tells the engine's lifecycle (`on_damage`), which refuses steps and saves until a
load replaces all of the state ([Note: failed updates] in infinity/engine/step_policy.py). The parameter tier keeps the target
buffer of an unfinished update, with the values of the pieces done, for the resumed one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from infinity.device import Device, InFlight
from infinity.device.timeline import TIMELINE
from infinity.offload import BufferPool, NvmeStore, Swapper
from infinity.offload.nvme_io import IOTally, make_handle
from infinity.offload.optimizer.accumulators import GRAD, Accumulators, norm_parts
from infinity.offload.optimizer.pieces import Piece, Pieces, PieceState
from infinity.offload._messages import human_bytes
from infinity.offload.optimizer.sizing import (choose_pieces, cut_pieces, held_pieces, held_spread, host_elements,
                                               piece_buffers, pool_classes, streamed_floor, units_streaming)
from infinity.offload.protocols import TierUnit
from infinity.offload.schedule import StepSchedule
from infinity.offload.state import ShardState
from infinity.offload.store import default_job_id
from infinity.optim.rules import STREAMED, AdamRule

log = logging.getLogger("infinity")


class NvmeOptimizerState:
    """The NVMe optimizer tier (same methods as `ResidentOptimizerState`), over the trainable
    part of each unit's shard (`units`: those with one).

    no_accumulator: units whose gradient feeds their update the moment it is final (update in
    backward, one micro-step); every other unit's gradient outlives its backward in an
    accumulator, in host memory or spilled ([Note: gradient spill] in accumulators.py).
    schedule: the step's orders ([Note: the step's orders] in offload/schedule.py): before the
    first step, its `expected` order is the one the step is expected to update units in (the
    first ones keep their accumulators in memory, and the first step reads ahead in it: [Note:
    reading ahead in the expected order]); this tier records the order gradients become final.
    at_next_use: whether the updates wait for each unit's next use (the engine's update mode,
    [Note: update modes] in infinity/engine/step_policy.py), so that they run in forward order.
    """

    on_device = False  # the state is updated by the CPU kernel, from host buffers
    updates_can_wait = True  # their I/O then overlaps the next forward ([Note: updates after the norm] in step_policy.py)

    def __init__(self, device: Device, offload, aio, sub_group_size: int, *, rank: int, units: list[TierUnit],
                 schedule: StepSchedule, at_next_use: bool, no_accumulator: set[int] = frozenset(),
                 on_damage: Callable[[str], None] = lambda why: None, rule=None, one_pass: bool = False):
        self.device = device
        self.rule = rule or AdamRule()
        if self.rule.client:
            raise TypeError(f"optimizer: {self.rule.name} cannot stream its state to NVMe; infinity streams "
                            f"{', '.join(STREAMED)} (or use offload_optimizer.device cpu)")
        self.kinds = self.rule.kinds  # master, then the rule's moments ([Note: update rules])
        self.schedule, streaming = schedule, units_streaming(in_backward=not at_next_use)  # [Note: the pool is a budget]
        self._on_damage = on_damage  # the run's health hears why its state is not a step's ([Note: resuming an update])
        self.acc = Accumulators(device, units, offload.max_grad_in_cpu, set(no_accumulator), schedule.expected, one_pass)
        # Units with something to update; the others' state is never read for an update.
        self._updatable = {u.index for u in units if u.segments}
        # Buffers a piece takes, and keeps while held, counted in fp32 ones ([Note: two sizes of buffer] in pool.py)
        self._per_piece, kept = piece_buffers(len(self.rule.moments), self.rule.format.bytes_per_value(),
                                              bool(self.acc.spilled))
        target, buffers = choose_pieces([u.train_shard_numel for u in units], sub_group_size, offload.buffer_count,
                                        self._per_piece, host_elements(), kinds=kept, streaming=streaming,
                                        planned=offload.pool_elements, min_streamed=streamed_floor(aio.min_request))
        cuts = {u.index: cut_pieces(u.train_shard_numel, target) for u in units}
        layout = {kind: {(i, k): self._nbytes(kind, n) for i, ps in cuts.items() for k, (_, n) in enumerate(ps)}
                  for kind in self.kinds}
        if self.acc.spilled:
            layout[GRAD] = self.acc.spill_layout(cuts)  # [Note: one pass spills its own dtype] in accumulators.py
        self.handle = make_handle(aio)
        self.store = NvmeStore(offload.nvme_path, layout, job_id=f"{default_job_id()}-optimizer", rank=rank,
                               handle=self.handle, name="offload_optimizer")
        largest = max((n for ps in cuts.values() for _, n in ps), default=1)
        pieces = sum(len(cuts[index]) for index in self._updatable)
        self.pool, buffers, kept = self._build_pool(device, offload, buffers, largest, kept)
        most = max((len(cuts[index]) for index in self._updatable), default=1)  # a unit's pieces, at most
        self._held_count = held_pieces(pieces, buffers, self._per_piece, most, kept, streaming)
        log.info("infinity: offload_optimizer pipeline: %d buffers, %s (pieces of up to %d elements; %d of the %d "
                 "pieces stay in the pool, the others stream) for buffer_count %d x sub_group_size %d "
                 "([Note: the pool is a budget])", self.pool.buffer_count, human_bytes(self.pool.stats.bytes_total),
                 largest, self._held_count, pieces, offload.buffer_count, sub_group_size)
        # A second handle for writes, so that reads never queue behind them.
        self.swapper = Swapper(self.store, self.pool, None, self.handle, make_handle(aio), on_lost=self._lost_write)
        self.acc.bind(self.swapper, self.pool)
        self.pieces = Pieces(self.swapper, cuts)
        self._hold_spread(schedule.expected)
        self.chosen = {"piece_elements": largest, "buffers": self.pool.buffer_count,
                       "pool_bytes": self.pool.stats.bytes_total, "least_streamed": min(target, streamed_floor(aio.min_request)),
                       "pieces_in_flight": int(buffers // self._per_piece), "pieces_held": self._held_count,
                       "pieces": pieces, "units_streaming": streaming}
        if offload.pool_elements is not None:  # max_in_cpu "auto" gave the pool the room (placement.py)
            self.chosen["planned_elements"] = offload.pool_elements
        self._updated: set[int] = set()  # units updated this step
        self._reading_ahead = False
        self._resume: dict[int, int] = {}  # unit -> pieces of its unfinished update done ([Note: resuming an update])
        self._at_next_use = at_next_use
        self._tally = IOTally(self.swapper)
        self._scratch_room: dict[str, torch.Tensor] = {}

    def _build_pool(self, device: Device, offload, buffers: float, largest: int, kept: float) -> tuple:
        """(pool, buffers, kept): the pool of `buffers` fp32 buffers' bytes of the largest piece
        (`pool_classes`), and `buffers` and `kept` again as it was made, which `_per_piece` follows."""
        two_sizes = kept < 1 + len(self.rule.moments)  # `piece_buffers` counted the moments smaller
        self._moment_bytes = self.rule.format.nbytes(largest) if two_sizes else None
        count, small, per_piece = pool_classes(buffers, largest, len(self.rule.moments), self._moment_bytes)
        if per_piece is not None:
            self._per_piece = kept = per_piece
            buffers = count * per_piece
        pin = (device.pin() or None) if offload.pin_memory else False
        pool = BufferPool(count, largest * 4, name="offload_optimizer", pin=pin, on_release=device.scribble, small=small)
        return pool, buffers, kept

    def _kinds(self, index: int) -> tuple[str, ...]:
        return self.kinds + (GRAD,) if index in self.acc.spilled else self.kinds

    def _nbytes(self, kind: str, n: int) -> int:
        """The bytes of n values of `kind`: moments in the rule's format ([Note: moment formats] in
        infinity/optim/formats.py), master in fp32 (a spilled gradient's are the layout's own)."""
        return self.rule.format.nbytes(n) if kind in self.rule.moments else 4 * n

    def _stored(self, kind: str, raw: torch.Tensor, n: int, index: int) -> torch.Tensor:
        """A buffer of unit `index`'s `kind` as stored: the moment format's form, else n values (`Accumulators.dtype`)."""
        return self.rule.format.view(raw, n) if kind in self.rule.moments else raw.view(self.acc.dtype(kind, index))[:n]

    def _scratch(self, kind: str, n: int) -> torch.Tensor:
        """fp32 room for an 8-bit moment's piece while it updates by torch ops (LAMB), one per kind, reused."""
        room = self._scratch_room.get(kind)
        if room is None or room.numel() < n:
            room = self._scratch_room[kind] = torch.empty(n, dtype=torch.float32)
        return room[:n]

    # ---- gradients ------------------------------------------------------------------------

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        ps = self.pieces.of[unit.index]
        largest = max(p.numel for p in ps)
        zeros = torch.zeros(largest, dtype=self.acc.spill_dtype.get(unit.index, torch.float32))
        fmt = self.rule.format
        starts = {}  # each piece size's first moments, in the stored form (8-bit ones hold scales too)
        for p in ps:
            n = p.numel
            self.swapper.write("master", p.key, master[p.start:p.start + n].contiguous())
            for kind in self.rule.moments:
                if (kind, n) not in starts:
                    starts[kind, n] = fmt.empty(n, self.rule.initial(kind), kind)
                self.swapper.write(kind, p.key, starts[kind, n])
            if unit.index in self.acc.spilled:
                self.swapper.write(GRAD, p.key, zeros[:n])
        self.swapper.flush()  # the sources are views of `master`, `starts` and `zeros`: alive until here

    def begin_pass(self, last: bool) -> None:
        """A training forward starts; `last`: the accumulation boundary's, whose gradients are
        final. State reads start now, under forward ([Note: reading ahead in the expected order]).
        Called again when the backward finds the boundary was not what the forward expected
        ([Note: the boundary of a pass] in step_policy.py): the reads start then, or the ones
        issued for this step's updates go back (those of the last step's pending ones stay)."""
        self._reading_ahead = last
        if last:
            self._read_ahead()
        else:
            self._drop_early(keep=self.schedule.pending)

    def poll(self) -> None:
        if (self._reading_ahead or self.schedule.pending) and self._can_spare(3):
            self._read_ahead()  # [Note: reading ahead in the expected order]

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight:
        # [Note: gradients to the host] in accumulators.py: consumed one unit later, or at the update.
        return self.acc.landing.land(grad_shard, lambda g: self._consume(unit.index, g, first, last))

    def _consume(self, index: int, g: torch.Tensor, first: bool, last: bool) -> bool:
        """Adds a landed gradient (host, compute dtype) in; True when it keeps `g`'s buffer."""
        cuts = [(p.start, p.numel) for p in self.pieces.of[index]]
        keep = self.acc.consume(index, g, first, last, cuts)
        if last and index in self._updatable:
            self.schedule.gradient_final(index)
            # Pending updates run in forward order: `_read_ahead` follows that; otherwise this unit's
            # update comes now, in the order gradients become final.
            if not any(i in self._updatable for i in self.schedule.last_pending):
                for p in self.pieces.of[index]:
                    if not self._read_early(p):
                        break  # the pool is as full as the step's own pipeline allows
            self._read_ahead()
        return keep

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        """Squared norm of the unit's final gradient, taken when it became final."""
        self.acc.landing.consume_landed()
        rows = self.acc.sq.get(unit.index)
        return torch.zeros(2, dtype=torch.float32) if rows is None else norm_parts(rows, unit.mp_rows)

    def step_order(self, units: list[TierUnit]) -> list[TierUnit]:
        """Units not yet updated, those whose state reads started in backward first, in that order."""
        rank = {index: pos for pos, index in enumerate(self.schedule.final)}
        rest = [u for u in units if u.index not in self._updated]
        return sorted(rest, key=lambda u: rank.get(u.index, len(rank) + u.index))

    # ---- the update -----------------------------------------------------------------------

    def _wait_piece(self, piece: Piece, handles: list) -> list[torch.Tensor]:
        """The piece's tensors, in `_kinds` order, each of its kind's dtype. If a read failed (its
        fetch then holds nothing), the piece's other buffers go back and the first error is raised."""
        tensors, error = [], None
        for kind, handle in zip(self._kinds(piece.unit), handles):
            try:
                tensors.append(self._stored(kind, self.swapper.wait(handle), piece.numel, piece.unit))
            except OSError as e:
                error = error or e
                tensors.append(None)
        if error is not None:
            waited = tuple(kind for kind, t in zip(self._kinds(piece.unit), tensors) if t is not None)
            self.pieces.untake(piece, waited, [])
            raise error
        return tensors

    def _hold_spread(self, order: list[int]) -> None:
        """Marks the pieces the pool holds ([Note: the pool is a budget] in sizing.py), spread over
        `order` (the expected one, then each step's as it was). Pieces held no longer let go of
        their buffers now, before the new ones take theirs: the pool holds no more pieces than it
        can while the others stream."""
        held = held_spread([(index, k) for index in order if index in self._updatable
                            for k in range(len(self.pieces.of[index]))], self._held_count)
        for p in self.pieces.in_memory():
            if p.held and p.key not in held:
                self.pieces.let_go(p)
        for ps in self.pieces.of.values():
            for p in ps:
                p.held = p.key in held

    def _read_early(self, piece: Piece, in_order: bool = False) -> bool:
        """Issues the reads of one piece before its update, if the pool can spare its buffers while
        keeping room for the update's pipeline (a piece updating, one reading, one writing). A
        spilled gradient is read only once it is final. `in_order`: the reads are issued in the
        order the updates will take them, so the pipeline of the next update never needs more
        than the two pieces' buffers kept back then (one updating, the next; an update run out
        of that order, for GatheredParameters, takes the same two), and streamed pieces fill the
        pool while the held ones update ([Note: the pool is a budget] in sizing.py)."""
        index = piece.unit
        kinds = [kind for kind in self._kinds(index) if kind not in piece.handles
                 and (kind != GRAD or index in self.schedule.final or index in self.schedule.pending)]
        if not kinds:
            return True
        if not self._can_spare(2 if in_order else 3, kinds):
            return False
        try:
            self.pieces.read_ahead(piece, kinds)
        except OSError:
            return False  # a shard whose last write failed: its update meets the error itself
        return True

    def _can_spare(self, pieces: int, kinds: list[str] = ()) -> bool:
        """Whether the pool has buffers free for `pieces` whole pieces and the `kinds` named, in
        each of its classes ([Note: two sizes of buffer] in pool.py)."""
        if self._moment_bytes is None:
            return self.swapper.can_spare(int(pieces * self._per_piece) + len(kinds))
        moments = sum(1 for kind in kinds if kind in self.rule.moments)
        return (self.swapper.can_spare(pieces * len(self.rule.moments) + moments, self._moment_bytes)
                and self.swapper.can_spare(pieces + len(kinds) - moments, self.pool.buffer_size))

    def abort_pass(self) -> None:
        """A backward failed: gradients in flight go, and what this step read ahead or kept."""
        self.acc.landing.discard()
        self.finish_step()

    def _read_ahead(self, done: int | None = None) -> None:
        """Reads the pieces of the units expected to become final next ([Note: reading ahead in
        the expected order]), as far as the pool allows; first those of pending updates, in the
        order they will run (but `done`, whose update just ran)."""
        for index in self.schedule.pending:
            if index == done or index not in self._updatable:
                continue
            for p in self.pieces.of[index][self._resume.get(index, 0):]:
                if not self._read_early(p, in_order=True):
                    return
        if not self._reading_ahead:
            return
        # Updates that wait for the next forward take the pending ones first (all read by now),
        # then these in this order; updates in backward or in the step take them in the order
        # gradients become final, which the expected one only predicts.
        for index in self.schedule.expected:
            if index in self._updated or index not in self._updatable:
                continue
            for p in self.pieces.of[index]:
                if not self._read_early(p, self._at_next_use):
                    return

    def update(self, unit: TierUnit, hypers: list, step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        self.acc.landing.consume_landed()
        index = unit.index
        pieces = self.pieces.of[index]
        kinds = self._kinds(index)
        grad, fresh = self.acc.for_update(unit)
        first = self._resume.get(index, 0)  # [Note: resuming an update]
        taken: dict[int, list] = {}  # piece -> its fetches, taken, not waited for
        current: Piece | None = None  # the piece being updated: waited for, not yet released
        k = first
        try:
            taken[first] = self.pieces.take(pieces[first], kinds)
            for k in range(first, len(pieces)):
                piece = pieces[k]
                if k + 1 < len(pieces):
                    taken[k + 1] = self.pieces.take(pieces[k + 1], kinds)  # read ahead while this piece updates
                self._refill(pieces, k + 2)
                handles = taken.pop(k)
                got = dict(zip(kinds, self._wait_piece(piece, handles)))  # the swapper times the waits
                current = piece
                self._update_piece(unit, k, piece, got, grad, hypers, step, grad_scale, out)
                current = None
                self._resume[index] = k + 1  # before its writes start: never updated twice
                # A held piece keeps its buffers only where the rest of the update still has a
                # piece's worth of them beside it ([Note: reads in update order]).
                if piece.held and self._can_spare(2):
                    self.pieces.keep(piece, dict(zip(kinds, handles)))
                else:
                    self.pieces.write_back(piece, kinds)
        except BaseException as e:
            self._abandon(index, kinds, current, taken, e, f"at piece {k} of {len(pieces)}")
            raise
        finally:
            if fresh is not None:
                self.acc.release(fresh)
        self._resume.pop(index, None)
        if index not in self.schedule.pending:  # this step's, not the last step's (which leaves `pending` now)
            self._updated.add(index)
        self._read_ahead(done=index)

    def _refill(self, pieces: list[Piece], start: int) -> None:
        """The reads of the updating unit's pieces from `start` on, as the writes before them give
        buffers back ([Note: reads in update order])."""
        for p in pieces[start:]:
            if p.state in (PieceState.ON_DISK, PieceState.READ_AHEAD) and not self._read_early(p, in_order=True):
                return

    def _update_piece(self, unit: TierUnit, k: int, piece: Piece, got: dict[str, torch.Tensor],
                      grad: torch.Tensor | None, hypers: list, step: int, grad_scale: float,
                      out: torch.Tensor) -> None:
        """The rule's step over one piece, its state in `got` (by kind) and its gradient spilled
        there too or in `grad`, the new values written into `out`'s run of the piece."""
        start, n = piece.start, piece.numel
        master = got["master"]
        g = got[GRAD] if GRAD in got else grad[start:start + n]
        runs = [(max(seg.start, start) - start, min(seg.start + seg.count, start + n) - start,
                 self.rule.hyper(hypers, seg)) for seg in self.rule.spans(unit)]
        half = None if out.dtype == torch.float32 else out  # the kernel rounds into it in its pass
        with TIMELINE.span("update", unit=unit.index, piece=k):
            # [Note: update rules] in infinity/optim/rules.py: the moments as stored, 8-bit ones too
            self.rule.update_stored(master, g, {kind: got[kind] for kind in self.rule.moments},
                                    [r for r in runs if r[0] < r[1]], step=step, grad_scale=grad_scale,
                                    half_out=None if half is None else half[start:start + n],
                                    scratch=self._scratch)
            if half is None:
                out[start:start + n].copy_(master)

    def _abandon(self, index: int, kinds: tuple[str, ...], current: Piece | None, taken: dict[int, list],
                 error: BaseException, where: str) -> None:
        """[Note: failed transfers give their buffers back]: what a failed update holds goes back
        unchanged; the pieces not done are read again when it resumes, or, when it cannot
        resume, the run's health hears why ([Note: resuming an update])."""
        pieces = self.pieces.of[index]
        if current is not None:
            self.pieces.untake(current, kinds, [])
        for j, handles in taken.items():
            self.pieces.untake(pieces[j], (), handles)
        self._drop_early(only=index)
        if not isinstance(error, OSError) or self._lost(index):
            self._resume.pop(index, None)
            self._on_damage(f"the update of unit {index} failed {where} ({type(error).__name__}: {error}) and "
                            "cannot be resumed")

    def norms(self, unit: TierUnit, hypers: list, step: int, grad_scale: float) -> torch.Tensor:
        """[Note: LAMB's two passes] in infinity/optim/rules.py: this shard's sums of p^2 and u^2 per
        tensor (float64, [tensors, 2]), piece by piece; nothing is written. The pieces read ahead go
        back first, so that the reads of this pass find buffers."""
        self.acc.landing.consume_landed()
        self._drop_early()
        index = unit.index
        kinds = self._kinds(index)
        grad = self.acc.host.get(index, self.acc.fresh.get(index))
        out = torch.zeros(self.rule.tensors, 2, dtype=torch.float64)
        fmt = self.rule.format
        for piece in self.pieces.of[index]:
            start, n = piece.start, piece.numel
            handles = [self.swapper.fetch(kind, piece.key) for kind in kinds]
            got, error = {}, None
            for kind, handle in zip(kinds, handles):
                try:
                    got[kind] = self._stored(kind, self.swapper.wait(handle), n, index)
                except OSError as e:  # a failed fetch holds nothing; the others are given back below
                    error = error or e
            try:
                if error is not None:
                    raise error
                g = got[GRAD] if GRAD in got else (grad[start:start + n] if grad is not None
                                                   else torch.zeros(n, dtype=torch.float32))
                values = {kind: fmt.decode(got[kind], n, kind) for kind in self.rule.moments}
                for span in self.rule.spans(unit):
                    lo, hi = max(span.start, start), min(span.start + span.count, start + n)
                    if lo < hi:
                        sl = slice(lo - start, hi - start)
                        out[span.tensor] += torch.tensor(self.rule.norm_terms(
                            got["master"][sl], g[sl], {k: v[sl] for k, v in values.items()},
                            self.rule.hyper(hypers, span), step=step, grad_scale=grad_scale), dtype=torch.float64)
            finally:
                for kind in got:
                    self.swapper.release(kind, piece.key)
        return out

    def set_pending(self) -> None:
        """The schedule's pending updates run later, in its order ([Note: updates after the norm]
        in step_policy.py): their reads issued so far are kept for them, and more start now."""
        self._reading_ahead = False  # the next step's reads start with its forward
        self._in_update_order()
        self._read_ahead()
        for index in self.schedule.pending:  # a shard whose last write failed fails the step now, not one later
            if index not in self._updatable:
                continue
            for p in self.pieces.of[index]:
                for kind in self.kinds:
                    if self.swapper.state(kind, p.key) is ShardState.INVALID:
                        self.swapper.fetch(kind, p.key)  # raises the error naming the shard

    def _in_update_order(self) -> None:
        """[Note: reads in update order]: of the pieces read ahead, those after a piece of the
        pending order that is still on disk go back, unless the pool holds them."""
        gap = False
        for index in self.schedule.pending:
            if index not in self._updatable:
                continue
            for p in self.pieces.of[index][self._resume.get(index, 0):]:
                if p.state is PieceState.ON_DISK:
                    gap = True
                elif gap and p.state is PieceState.READ_AHEAD and not p.held:
                    self.pieces.let_go(p)

    def _drop_early(self, keep: list[int] = (), only: int | None = None, held: bool = False) -> None:
        """Lets go of the pieces read ahead but `keep`'s (`only`: of that unit only) and held ones (`held`: those too)."""
        for p in self.pieces.in_memory():
            if p.unit not in keep and only in (None, p.unit) and (held or not p.held):
                self.pieces.let_go(p)

    def _lost(self, index: int) -> bool:
        """Whether a shard of the unit (any kind, its gradient too) lost its bytes to a failed write."""
        return any(self.swapper.state(kind, p.key) is ShardState.INVALID
                   for kind in self._kinds(index) for p in self.pieces.of[index])

    def _lost_write(self, kind: str, error: OSError) -> None:
        """A write of master or moments failed: the state is not a step's until they are written
        again. (A spilled gradient's loss damages only the update that meets it.)"""
        if kind in self.kinds:
            self._on_damage(f"a write of optimizer state failed ({error.strerror})")

    def drop_pending(self) -> None:
        """The pending updates will not run (the state is damaged): their reads ahead go back."""
        self._resume.clear()
        self._drop_early(held=True)

    def finish_step(self) -> None:
        """The step ended (the schedule's orders rolled over first): the pool holds the pieces the
        next step's order spreads, and reads for an update that did not come (a skipped step) go."""
        self._hold_spread(self.schedule.expected)
        self._drop_early(keep=self.schedule.pending)
        self.acc.end_step()  # a skipped step's gradient, never used
        self._updated.clear()
        self._reading_ahead = False

    def flush(self) -> None:
        """Waits for the writes in flight; a failed one raises here, naming the shard. The engine
        calls it at the start of the next step, so the last pieces' writes drain under its compute;
        a read of a shard being written waits for that write (the swapper's ordering)."""
        self.acc.landing.consume_landed()
        self.swapper.flush()

    # ---- checkpoints and GatheredParameters -------------------------------------------------

    def _read_all(self, index: int, kind: str) -> torch.Tensor:
        ps = self.pieces.of[index]
        out = torch.empty(sum(p.numel for p in ps), dtype=torch.float32)
        for p in ps:
            data = self.swapper.wait(self.swapper.fetch(kind, p.key))  # a failed read holds nothing
            try:
                stored = self._stored(kind, data, p.numel, index)
                out[p.start:p.start + p.numel].copy_(self.rule.format.to_fp32(stored, p.numel, kind)
                                                     if kind in self.rule.moments else stored)
            finally:
                self.swapper.release(kind, p.key)
        return out

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor | None:
        """A host copy of the unit's fp32 `kind` (master, exp_avg, exp_avg_sq, or its accumulated
        gradient "grad": None where none is kept, one that fed its update at once)."""
        if kind in self.kinds:
            return self._read_all(unit.index, kind)
        if kind != GRAD:  # a moment this rule does not keep: checkpoints still hold its zeros
            return torch.zeros(unit.train_shard_numel, dtype=torch.float32)
        self.acc.landing.consume_landed()
        if unit.index in self.acc.host:  # in the compute dtype with one pass ([Note: one pass keeps its own dtype])
            return self.acc.host[unit.index].to(torch.float32, copy=True)
        return self._read_all(unit.index, GRAD) if unit.index in self.acc.spilled else None

    def write(self, unit: TierUnit, values: dict[str, torch.Tensor]) -> None:
        """Makes `values` (host fp32, any of master, exp_avg, exp_avg_sq) the unit's state; all
        three replace an unfinished update ([Note: resuming an update])."""
        self._drop_early(only=unit.index, held=True)  # a shard being written is held by nobody
        sources = []
        for kind in self.kinds:
            if kind in values:
                for p in self.pieces.of[unit.index]:
                    part = values[kind][p.start:p.start + p.numel]
                    if kind in self.rule.moments:  # the rule's moment format, block by block of the piece
                        part = self.rule.format.encode(part, kind)
                    sources.append(part.contiguous())
                    self.swapper.write(kind, p.key, sources[-1])
        self.swapper.flush()  # the sources (views of `values`, or encoded from them) are alive until here
        if all(kind in values for kind in self.kinds):
            self._resume.pop(unit.index, None)

    def io_stats(self) -> dict[str, float]:
        return self._tally.take()

    def close(self) -> None:
        self.acc.landing.consume_landed()
        self.pieces.forget_unwritten()  # the store goes with the tier: nothing to write back
        self._drop_early(held=True)
        try:
            self.swapper.close()  # raises a failed write nobody has met yet
        finally:
            self.store.close()  # its files go all the same
