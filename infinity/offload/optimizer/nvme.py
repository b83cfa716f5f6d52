"""`offload_optimizer.device: nvme`: fp32 master, exp_avg and exp_avg_sq of every shard live in
the NVMe store, cut into pieces of about `sub_group_size` elements ([Note: cutting pieces]).

[Note: cutting pieces]
Every pool buffer is as large as the largest piece, and a piece takes one buffer per kind
whatever its size. Cut at sub_group_size with the remainder left over, a transformer block of
50.3M elements at 2.5e7 gave two full pieces and a sliver of 0.3M, whose three buffers held
1% of their bytes: a third of the pool's pieces held almost nothing, and at 1.07B parameters
the state that fit in the pool before the next forward was two thirds of what its bytes
allowed. So a shard of n elements is cut into round(n / sub_group_size) pieces (at least one)
of equal size, rounded up to PIECE_ALIGN: a piece is at most 1.5x sub_group_size (DeepSpeed's
sub-groups, cut at parameter boundaries, also exceed it), and the tools/estimate.py pool
follows the same cut (`cut_pieces`).

[Note: pipelined step]
A unit's update streams its pieces through the pool: the three reads of piece k+1 are in
flight while CPU Adam updates piece k in place, and piece k-1's three writes (issued by
`release(dirty=True)` the moment its update ended) drain behind both. Pieces of the next unit
are read while the last pieces of this one are updated, so the disk never waits for a unit
boundary. The Adam pass also writes the new compute-dtype parameter into the parameter tier's
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
compute, as far as the pool allows (`_read_ahead`). When updates wait
for the next forward ([Note: updates after the norm] in step_policy.py) they run in that
forward's order, not in the order gradients became final: the reads then follow the last
pending order instead, so the first units the next forward updates (the embedding, whose
gradient is final last) are the first read; where the pool has room, a unit's pieces are
fetched again for the next step right after its update released them, while their write is in
flight, which costs no read at all. With the update
running during backward (no clipping, no fp16: see [Note: update during backward] in step_policy.py)
the state of a unit is then in memory when its gradient is final, its update runs at once, and
its writes drain behind the next unit's backward.

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
damaged: `damage()` says so until a load replaces all of its state, and the step policy refuses
to go on ([Note: updates after the norm] in step_policy.py). The parameter tier keeps the target
buffer of an unfinished update, with the values of the pieces done, for the resumed one.

[Note: gradient spill]
Gradients are reduced to this rank's shard and accumulated in fp32 on the host. When the update
waits for the step (clipping or fp16 needs the global norm first, or several micro-steps
accumulate), every unit needs an accumulator until then: units are given one in host memory in
the order the step updates them while `max_grad_in_cpu` elements last (backward order; forward
order when the updates wait for the next forward, where the embedding's gradient, final last,
is the first one needed); the gradients of the others spill to the
store as kind "grad", cut into the same pieces as the state, so the update reads them beside
master, exp_avg and exp_avg_sq (4 bytes a parameter written in backward and read in the step;
a later micro-step reads, adds and writes back). With the update in backward on one micro-step
no accumulator is needed: the fp32 shard goes straight into the update.

[Note: the pool is a budget]
`offload_optimizer.buffer_count` buffers of a `sub_group_size` sub-group (what DeepSpeed allocates
for them, a sub-group being no larger than the state) bound the host memory of the pipeline,
also capped at a quarter of the host's free memory; they do not fix its shape. The tier takes
the bytes those knobs allow (at least the 3 pieces a pipeline needs: reading, updating, writing)
and chooses how to cut the state into pieces and how many buffers of the largest piece to make
of them, for the most state the pool holds from one step to the next:

  * Held pieces stay in their buffers from one update to the next, neither read nor written
    (`_keep`): their newest bytes are in memory only, where every reader of the state (the
    update, checkpoints, `state`) finds them, and are written back the moment the pool lets go
    of the piece (`_give_back`: the held set changes, a load replaces the state, the state is
    damaged), never dropped unwritten; at `close` the store goes with them. The NVMe copy is
    swap space, not a checkpoint, so nothing is lost that a write each step would have kept.
    The pieces that stream instead are spread evenly over the order the step
    updates them (expected, then as each step went: `_hold_spread`), so each is read while the
    held ones before it update and their units compute; when the updates wait for the next
    forward, reads ahead fill every buffer but two pieces' (they are issued in the order the
    updates take them, so none waits on a later piece's buffer). Streaming the last pieces
    instead bunched their reads at the end of the forward: the 134M GPT below waited 0.13-0.17 s
    a step on them, 0.03 s spread. Without held pieces, a pool a little short of the state kept
    the pieces it wrote last and gave their buffers to the reads of the pieces needed next, the
    ones it had just dropped: DeepSpeed-style knobs on the 134M GPT (4 x 1e8 elements against
    403M of state) read the whole state every step.
  * Where the bytes hold every piece of every kind and `CACHED_SPARE` pieces more, the whole
    state is held: after the first step the state moves neither way; the pool then takes no
    buffer more than that.
  * Otherwise the streamed pieces keep `STREAM_PIECES` pieces' buffers (the one updating, the
    one reading, the one writing, three read ahead) and room for the streamed pieces of a unit
    (a unit's pieces update together, at its next use or when its gradient is final, so they
    are read while the unit before computes); the rest hold pieces. A
    state many times the pool then holds little and keeps the depth: at 1.07B (48 x 2.5e7
    against 3.2G elements) holding a quarter of the state in all but 6 pieces' buffers cut
    the reads by as much but hid less of them (0.38 of the optimizer's I/O behind compute
    against 0.59), and the step was no faster.
  * Buffers are as large as the largest piece, so pieces of unequal sizes (a 33.5M tile beside
    7.1M layers) waste the difference, and the spare buffers cost a piece each: smaller pieces
    hold more of the same bytes. The cuts tried are halvings of the piece that would leave
    `PIPELINE_DEPTH` pieces in flight, and the sizes that cut the largest shards into equal
    pieces; a whole state may be cut down to `MIN_CACHED_PIECE`, a state that streams only to
    `MIN_STREAMED_PIECE` (a streamed piece must move at the disk's speed). Of the cuts that
    hold within 2% of the most, the one with the largest pieces (fewest transfers) wins.
  * The pool never takes more buffers than every piece and `PIPELINE_DEPTH` more of each kind:
    DeepSpeed's `buffer_count` sub-groups of a small model (a LoRA's adapters) would be several
    times its whole state.

DeepSpeed's 4 buffers of 1e8 (or 1e9) elements, taken as they read, gave the pipeline 3 pieces
in flight and a step 1.4-1.6x its floor, where 48 buffers reached it. The choice is logged and
kept in `chosen` (`pieces_held` of `pieces`); the numbers of a step do not depend on it (Adam is
element-wise, and a held piece's bytes are those a read would bring).
"""

from __future__ import annotations

import logging
from collections import Counter

import psutil
import torch

from infinity.device.timeline import TIMELINE
from infinity.device import Device, InFlight
from infinity.optim.functional import AdamHyper, adam_step
from infinity.offload import BufferPool, NvmeStore, Swapper
from infinity.offload.state import ShardState
from infinity.offload.store import default_job_id
from infinity.offload.nvme_io import IOTally, make_handle
from infinity.offload.optimizer.memory import NORM_ROW, GradientLanding, row_norms_sq
from infinity.offload.protocols import TierUnit

KINDS = ("master", "exp_avg", "exp_avg_sq")
GRAD = "grad"  # spilled gradient accumulators ([Note: gradient spill])
PIECE_ALIGN = 1024  # elements: 4 KiB of fp32, so every piece's extent is O_DIRECT-aligned
PIPELINE_DEPTH = 16  # pieces the pool should hold at once ([Note: the pool is a budget])
MIN_PIECE = 1 << 22  # elements: 16 MiB of fp32, two 8 MiB aio blocks per kind
MIN_STREAMED_PIECE = 1 << 21  # elements: 8 MiB of fp32, the least piece cut to hold more of a state
MIN_CACHED_PIECE = 1 << 18  # elements: 1 MiB of fp32, the smallest piece of a state the pool holds whole
CACHED_SPARE = 2  # pieces' buffers beyond a whole state held: the first step's reads, spilled gradients
STREAM_PIECES = 6  # pieces' buffers left to those streamed beside the held ones: updating, reading, writing, 3 read ahead
HOST_SHARE = 4  # the pool takes at most a quarter of the host memory free when it is built
log = logging.getLogger("infinity")
assert PIECE_ALIGN % NORM_ROW == 0  # pieces start on norm rows ([Note: gradient norm by rows])


def choose_pieces(shards: list[int], sub_group_size: int, buffer_count: int, per_piece: int,
                  host_elements: int | None = None) -> tuple[int, int]:
    """(piece target in elements, buffers) for shards of these sizes ([Note: the pool is a budget]).
    `host_elements`: the most fp32 elements the pool may take of the host's free memory."""
    asked = max((n for numel in shards for _, n in cut_pieces(numel, sub_group_size)), default=1)
    total = sum(shards)
    # DeepSpeed's buffers: buffer_count sub-groups (a sub-group never larger than the state), and
    # at least the 3 pieces of a pipeline; never more than the host's share.
    budget = max(buffer_count * max(asked, min(int(sub_group_size), total)), 3 * per_piece * asked)
    budget = max(min(budget, host_elements or budget), 3 * per_piece * asked)
    target = min(int(sub_group_size), max(MIN_PIECE, budget // (PIPELINE_DEPTH * per_piece)))
    sizes = Counter(shards)
    options = []  # (elements of state held from one step to the next, piece target, buffers)
    for cut in _cuts(sizes, target):
        count, largest, most = 0, 1, 1
        for numel, times in sizes.items():
            ps = cut_pieces(numel, cut)
            count, largest, most = count + times * len(ps), max(largest, ps[0][1]), max(most, len(ps))
        held = held_pieces(count, budget // largest, per_piece, most)
        if held == count:  # the whole state stays: no buffer more than it and the spare pieces
            buffers = len(KINDS) * count + per_piece * CACHED_SPARE
        elif cut < min(target, MIN_STREAMED_PIECE):
            continue  # a piece that streams must stream at the disk's speed
        else:  # never more than the whole state and a pipeline's pieces besides: a buffer past that is never used
            buffers = max(3 * per_piece, min(budget // largest, per_piece * (count + PIPELINE_DEPTH)))
        options.append((total if held == count else held * total // count, cut, buffers))
    # The largest pieces (fewest transfers) among the cuts that hold within 2% of the most state.
    most = max(kept for kept, _, _ in options)
    _, cut, buffers = max((o for o in options if o[0] >= most * 0.98), key=lambda o: o[1])
    return cut, buffers


def held_pieces(pieces: int, buffers: int, per_piece: int, unit_pieces: int = 1) -> int:
    """How many of the state's pieces a pool of `buffers` holds from one step to the next
    ([Note: the pool is a budget]): all of them if their kinds and `CACHED_SPARE` pieces more
    fit; else as many as leave the streamed ones `STREAM_PIECES` pieces' buffers and room for
    the streamed pieces of a unit (`unit_pieces`: the most pieces a unit has), read while the
    unit before computes."""
    if len(KINDS) * pieces + per_piece * CACHED_SPARE <= buffers:
        return pieces
    most = (buffers - per_piece * STREAM_PIECES) // len(KINDS)
    # buffers - 3 h >= per_piece * (STREAM_PIECES + unit_pieces * (pieces - h) / pieces)
    spare = buffers - per_piece * (STREAM_PIECES + unit_pieces)
    slope = len(KINDS) * pieces - per_piece * unit_pieces
    if slope > 0:
        most = min(most, spare * pieces // slope)
    elif spare < 0:
        most = 0
    return max(0, min(pieces, most))


def _cuts(sizes: Counter, target: int) -> list[int]:
    """Piece targets worth trying: `target`, its halvings down to `MIN_CACHED_PIECE`, and the sizes
    that cut one of the largest distinct shards into equal pieces."""
    cuts = {target}
    t = target // 2
    while t >= MIN_CACHED_PIECE:
        cuts.add(t)
        t //= 2
    for numel in sorted(sizes, reverse=True)[:8]:
        for count in range(1, 257):
            cut = -(-numel // count)
            if cut < MIN_CACHED_PIECE:
                break
            if cut <= target:
                cuts.add(cut)
    return sorted(cuts, reverse=True)


def cut_pieces(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """(start, count) of each piece of a shard of `numel` elements ([Note: cutting pieces])."""
    target = max(PIECE_ALIGN, int(sub_group_size))
    count = max(1, (numel + target // 2) // target)
    size = -(-numel // count)
    size = -(-size // PIECE_ALIGN) * PIECE_ALIGN
    return [(s, min(size, numel - s)) for s in range(0, numel, size)]


class NvmeOptimizerState:
    """The NVMe optimizer tier (same methods as `ResidentOptimizerState`), over the trainable
    part of each unit's shard (`units`: those with one).

    no_accumulator: units whose gradient feeds their update the moment it is final (update in
    backward, one micro-step); every other unit's gradient outlives its backward in an
    accumulator, in host memory or spilled ([Note: gradient spill]).
    update_order: unit indices in the order the step is expected to update them (default:
    reverse unit order); the first ones keep their accumulators in memory ([Note: gradient spill]),
    and the first step reads ahead in it ([Note: reading ahead in the expected order]).
    at_next_use: whether the updates wait for each unit's next use (the engine's update mode,
    [Note: update modes] in infinity/engine/step_policy.py), so that they run in forward order.
    """

    on_device = False  # the state is updated by the CPU kernel, from host buffers
    updates_can_wait = True  # their I/O then overlaps the next forward ([Note: updates after the norm] in step_policy.py)

    def __init__(self, device: Device, offload, aio, sub_group_size: int, *, rank: int, units: list[TierUnit],
                 at_next_use: bool, no_accumulator: set[int] = frozenset(), update_order: list[int] | None = None):
        self.device = device
        self._landing = GradientLanding(device, units, "offload_optimizer")
        self._grads: dict[int, torch.Tensor] = {}  # host accumulators
        self._spilled: set[int] = set()  # units whose accumulators live in the store
        self._no_accumulator = set(no_accumulator)
        # Units with something to update; the others' state is never read for an update.
        self._updatable = {u.index for u in units if u.segments}
        room = offload.max_grad_in_cpu
        update_order = update_order or [u.index for u in reversed(units)]
        place = {index: k for k, index in enumerate(update_order)}
        for u in sorted(units, key=lambda u: place.get(u.index, len(place))):
            if u.index in self._no_accumulator:
                continue
            if u.train_shard_numel <= room:
                room -= u.train_shard_numel
                self._grads[u.index] = torch.zeros(u.train_shard_numel, dtype=torch.float32)
            else:
                self._spilled.add(u.index)
        self._per_piece = len(KINDS) + (1 if self._spilled else 0)
        host = psutil.virtual_memory().available // HOST_SHARE // 4  # fp32 elements
        target, buffers = choose_pieces([u.train_shard_numel for u in units], sub_group_size, offload.buffer_count,
                                        self._per_piece, host)
        self._pieces: dict[int, list[tuple[int, int]]] = {u.index: cut_pieces(u.train_shard_numel, target) for u in units}
        layout = {kind: {(i, k): n * 4 for i, ps in self._pieces.items() for k, (_, n) in enumerate(ps)}
                  for kind in KINDS}
        if self._spilled:
            layout[GRAD] = {(i, k): n * 4 for i in self._spilled for k, (_, n) in enumerate(self._pieces[i])}
        self.handle = make_handle(aio)
        self.store = NvmeStore(offload.nvme_path, layout, job_id=f"{default_job_id()}-optimizer", rank=rank,
                               handle=self.handle, name="offload_optimizer")
        largest = max((n for ps in self._pieces.values() for _, n in ps), default=1)
        pieces = sum(len(self._pieces[index]) for index in self._updatable)
        self._held_count = held_pieces(pieces, buffers, self._per_piece,
                                       max((len(self._pieces[index]) for index in self._updatable), default=1))
        self._held: set[tuple[int, int]] = set()
        self._unwritten: set[tuple[int, int]] = set()  # held pieces whose newest bytes are in memory only
        # (unit, piece) -> kind -> fetch handle issued before the update (held pieces' stay across steps)
        self._early: dict[tuple[int, int], dict] = {}
        self._hold_spread([index for index in update_order if index in self._updatable])
        self.chosen = {"piece_elements": largest, "buffers": buffers, "pool_bytes": buffers * largest * 4,
                       "pieces_in_flight": buffers // self._per_piece, "pieces_held": len(self._held),
                       "pieces": pieces}
        log.info("infinity: offload_optimizer pipeline: %d buffers of %.1f MB (pieces of up to %d elements; %d of "
                 "the %d pieces stay in the pool, the others stream) for buffer_count %d x sub_group_size %d "
                 "([Note: the pool is a budget])", buffers, largest * 4 / 1e6, largest, len(self._held), pieces,
                 offload.buffer_count, sub_group_size)
        # At least a buffer for each kind of: the piece being read, being updated, being written.
        self.pool = BufferPool(buffers, largest * 4, name="offload_optimizer", pin=(device.pin() or None) if offload.pin_memory else False,
                               on_release=device.scribble)
        # A second handle for writes, so that reads never queue behind them.
        self.swapper = Swapper(self.store, self.pool, None, self.handle, make_handle(aio))
        self._fresh: dict[int, torch.Tensor] = {}  # unit -> its gradient, no accumulator: used by its update
        self._sq: dict[int, torch.Tensor] = {}  # unit -> squared norm of its final gradient
        self._ready: list[int] = []  # units in the order their gradients became final, not yet updated
        self._order: list[int] = []  # this step's order of final gradients
        # The previous step's order (before the first, the expected one): what `_read_ahead` follows.
        self._expected = [index for index in update_order if index in self._updatable]
        self._final: set[int] = set()  # units whose gradient is final this step
        self._updated: set[int] = set()
        self._reading_ahead = False
        self._pending_order: list[int] = []  # units whose update waits for their next use, in that order
        # The last pending order: the next step's, too ([Note: reading ahead in the expected order]).
        self._last_pending_order = list(self._expected) if at_next_use else []
        self._resume: dict[int, int] = {}  # unit -> pieces of its unfinished update done ([Note: resuming an update])
        self._damaged: dict[int, str] = {}  # unit -> why its state is not of any step, until a load replaces it
        self._at_next_use = at_next_use
        self._tally = IOTally(self.swapper)

    def _kinds(self, index: int) -> tuple[str, ...]:
        return KINDS + (GRAD,) if index in self._spilled else KINDS

    # ---- gradients ------------------------------------------------------------------------

    def add(self, unit: TierUnit, master: torch.Tensor) -> None:
        zeros = torch.zeros(max(n for _, n in self._pieces[unit.index]), dtype=torch.float32)
        for k, (start, n) in enumerate(self._pieces[unit.index]):
            self.swapper.write("master", (unit.index, k), master[start:start + n].contiguous())
            self.swapper.write("exp_avg", (unit.index, k), zeros[:n])
            self.swapper.write("exp_avg_sq", (unit.index, k), zeros[:n])
            if unit.index in self._spilled:
                self.swapper.write(GRAD, (unit.index, k), zeros[:n])
        self.swapper.flush()  # the sources are views of `master` and `zeros`: alive until here

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
            self._drop_early(keep=self._pending_order)

    def accumulate(self, unit: TierUnit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> InFlight:
        # [Note: gradients to the host] in optim_shards.py: consumed one unit later, or at the update.
        return self._landing.land(grad_shard, lambda g: self._consume(unit.index, g, first, last))

    def _consume(self, index: int, g: torch.Tensor, first: bool, last: bool) -> bool:
        """Adds a landed gradient (host, compute dtype) in; True when it keeps `g`'s buffer."""
        keep = False
        with TIMELINE.span("grad_accumulate", unit=index):
            # Any float dtype: copy_/add_ and the Adam kernel convert it in their pass.
            if index in self._grads:
                acc = self._grads[index]
                acc.copy_(g) if first else acc.add_(g)
                if last:
                    self._sq[index] = row_norms_sq(acc).sum()
            elif index in self._spilled:
                self._spill(index, g, first, last)
            else:
                # Kept for the update that follows at once, which gives the buffer back.
                assert first and last, "gradients without an accumulator must be used by the update they feed"
                self._fresh[index] = g
                self._sq[index] = row_norms_sq(g).sum()
                keep = True
        if last and index in self._updatable:
            self._final.add(index)
            self._ready.append(index)
            self._order.append(index)
            if not self._last_pending_order:  # pending updates run in forward order: `_read_ahead` follows it
                for k in range(len(self._pieces[index])):
                    if not self._read_early(index, k):
                        break  # the pool is as full as the step's own pipeline allows
            self._read_ahead()
        return keep

    def _spill(self, index: int, g: torch.Tensor, first: bool, last: bool) -> None:
        rows = []
        for k, (start, n) in enumerate(self._pieces[index]):
            if first:
                acc = self.swapper.acquire(n * 4).view(torch.float32)
                acc.copy_(g[start:start + n])
            else:
                acc = self.swapper.wait(self.swapper.fetch(GRAD, (index, k))).view(torch.float32)[:n]
                acc.add_(g[start:start + n])
            if last:
                rows.append(row_norms_sq(acc))
            if first:
                self.swapper.evict(GRAD, (index, k), self.pool.base(acc)[:n * 4])
            else:
                self.swapper.release(GRAD, (index, k), dirty=True)
        if last:
            self._sq[index] = torch.cat(rows).sum()

    def grad_sq(self, unit: TierUnit) -> torch.Tensor:
        """Squared norm of the unit's final gradient, taken when it became final."""
        self._landing.consume_landed()
        return self._sq.get(unit.index, torch.zeros((), dtype=torch.float32))

    def step_order(self, units: list[TierUnit]) -> list[TierUnit]:
        """Units not yet updated, those whose state reads started in backward first, in that order."""
        rank = {index: pos for pos, index in enumerate(self._ready)}
        rest = [u for u in units if u.index not in self._updated]
        return sorted(rest, key=lambda u: rank.get(u.index, len(rank) + u.index))

    # ---- the update -----------------------------------------------------------------------

    def _fetch(self, index: int, k: int) -> list:
        """The fetch handles of one piece, in `_kinds` order: those issued early, and the rest now.
        If one cannot be issued (a shard whose last write failed), the others are given back."""
        early = self._early.pop((index, k), {})
        handles = []
        try:
            for kind in self._kinds(index):
                handles.append(early.pop(kind, None) or self.swapper.fetch(kind, (index, k)))
        except BaseException:
            for handle in [*handles, *early.values()]:
                self.swapper.let_go(handle)
            raise
        return handles

    def _release_piece(self, index: int, k: int, spilled: bool) -> None:
        """Ends an updated piece: its state is written (each kind, even if another kind's write
        cannot start: [Note: failed transfers give their buffers back]); a spilled gradient is
        only dropped. The first error is raised once all are released."""
        error = None
        for kind in (*KINDS, GRAD) if spilled else KINDS:
            try:
                self.swapper.release(kind, (index, k), dirty=kind != GRAD)  # the write starts now
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def _wait_piece(self, index: int, k: int, handles: list, n: int) -> list[torch.Tensor]:
        """The piece's fp32 tensors, in `_kinds` order. If a read failed (its fetch then holds
        nothing), the piece's other buffers go back and the first error is raised."""
        tensors, error = [], None
        for handle in handles:
            try:
                tensors.append(self.swapper.wait(handle).view(torch.float32)[:n])
            except OSError as e:
                error = error or e
                tensors.append(None)
        if error is not None:
            for kind, t in zip(self._kinds(index), tensors):
                if t is not None:
                    self.swapper.release(kind, (index, k))
            raise error
        return tensors

    def _hold_spread(self, order: list[int]) -> None:
        """The pieces the pool holds ([Note: the pool is a budget]): all but one in every few in
        `order` (the expected one, then each step's as it was), so that each streamed piece
        has the updates and compute of the held ones before it to be read in."""
        pieces = [(index, k) for index in order for k in range(len(self._pieces[index]))]
        streamed = len(pieces) - self._held_count
        held = set(pieces) - {pieces[(j + 1) * len(pieces) // streamed - 1] for j in range(streamed)}
        # Pieces held no longer let go of their buffers now, before the new ones take theirs: the
        # pool holds no more pieces than it can while the others stream.
        for key in [key for key in self._early if key in self._held and key not in held]:
            self._give_back(list(self._early.pop(key).values()))
        self._held = held

    def _keep(self, index: int, k: int, handles: list) -> None:
        """Keeps an updated held piece in its buffers for the next step's update, unwritten
        ([Note: the pool is a budget]): its newest bytes are in memory only, written back when
        the pool lets go of it (`_give_back`). A spilled gradient is only dropped."""
        self._early[(index, k)] = dict(zip(KINDS, handles))
        self._unwritten.add((index, k))
        if index in self._spilled:
            self.swapper.release(GRAD, (index, k))

    def _give_back(self, handles) -> None:
        """Ends fetches issued ahead or kept: a held piece whose newest bytes are only in its
        buffers is written back first; the first error is raised once all are released."""
        error = None
        for handle in handles:
            try:
                if handle.key in self._unwritten and handle.kind != GRAD:
                    self.swapper.release(handle.kind, handle.key, dirty=True)  # the write starts now
                else:
                    self.swapper.let_go(handle)
            except OSError as e:
                error = error or e
        self._unwritten.difference_update({handle.key for handle in handles})
        if error is not None:
            raise error

    def _read_early(self, index: int, k: int, in_order: bool = False) -> bool:
        """Issues the reads of one piece before its update, if the pool can spare its buffers while
        keeping room for the update's pipeline (a piece updating, one reading, one writing). A
        spilled gradient is read only once it is final. `in_order`: the reads are issued in the
        order the updates will take them, so the pipeline of the next update never needs more
        than the two pieces' buffers kept back then (one updating, the next; an update run out
        of that order, for GatheredParameters, takes the same two), and streamed pieces fill the
        pool while the held ones update ([Note: the pool is a budget])."""
        early = self._early.setdefault((index, k), {})
        kinds = [kind for kind in self._kinds(index) if kind not in early
                 and (kind != GRAD or index in self._final or index in self._pending_order)]
        if not kinds:
            return True
        if not self.swapper.can_spare((2 if in_order else 3) * self._per_piece + len(kinds)):
            if not early:
                del self._early[(index, k)]
            return False
        for kind in kinds:
            try:
                early[kind] = self.swapper.fetch(kind, (index, k))
            except OSError:
                return False  # a shard whose last write failed: its update meets the error itself
        return True

    def abort_pass(self) -> None:
        """A backward failed: gradients in flight are dropped, and so is whatever this step had
        read ahead or kept ([Note: failed transfers give their buffers back])."""
        self._landing.discard()
        self.finish_step()

    def _read_ahead(self) -> None:
        """Reads the pieces of the units expected to become final next ([Note: reading ahead in
        the expected order]), as far as the pool allows; first those of pending updates, in the
        order they will run."""
        for index in self._pending_order:
            for k in range(self._resume.get(index, 0), len(self._pieces[index])):
                if not self._read_early(index, k, in_order=True):
                    return
        if not self._reading_ahead:
            return
        # Updates that wait for the next forward take the pending ones first (all read by now),
        # then these in this order; updates in backward or in the step take them in the order
        # gradients become final, which the expected one only predicts.
        in_order = self._at_next_use
        for index in self._expected:
            if index in self._updated or index not in self._pieces:
                continue
            for k in range(len(self._pieces[index])):
                if not self._read_early(index, k, in_order):
                    return

    def update(self, unit: TierUnit, hypers: list[AdamHyper], step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        self._landing.consume_landed()
        index = unit.index
        pieces = self._pieces[index]
        grad = self._grads.get(index)
        fresh = self._fresh.pop(index, None)
        if grad is None:
            grad = fresh
        if grad is None and index not in self._spilled:
            grad = torch.zeros(unit.train_shard_numel, dtype=torch.float32)  # no gradient reached this unit
        half = None if out.dtype == torch.float32 else out  # the kernel rounds into it in its pass
        first = self._resume.get(index, 0)  # [Note: resuming an update]
        pending: list | None = None  # the next piece: fetched, not waited for
        upcoming: list | None = None  # the piece about to be updated: fetched, not waited for
        current: list | None = None  # the piece being updated: waited for, not yet released
        k = first
        try:
            pending = self._fetch(index, first)
            for k in range(first, len(pieces)):
                start, n = pieces[k]
                upcoming, pending = pending, None
                if k + 1 < len(pieces):
                    pending = self._fetch(index, k + 1)  # read ahead while this piece updates
                handles, upcoming = upcoming, None
                current = self._wait_piece(index, k, handles, n)  # the swapper times the waits
                master, m, v, *spilled = current
                g = spilled[0] if spilled else grad[start:start + n]
                with TIMELINE.span("adam", unit=index, piece=k):
                    for seg in unit.segments:
                        lo, hi = max(seg.start, start), min(seg.start + seg.count, start + n)
                        if lo >= hi:
                            continue
                        piece = slice(lo - start, hi - start)
                        adam_step(master[piece], g[piece], m[piece], v[piece], hypers[seg.group], step=step,
                                  grad_scale=grad_scale, half_out=None if half is None else half[lo:hi])
                    if half is None:
                        out[start:start + n].copy_(master)
                current = None
                self._resume[index] = k + 1  # before its writes start: never updated twice
                if (index, k) in self._held:
                    self._keep(index, k, handles)
                else:
                    self._release_piece(index, k, spilled=bool(spilled))
        except BaseException as e:
            # [Note: failed transfers give their buffers back]: what this update holds goes back
            # unchanged; the pieces not done are read again when it resumes.
            for kind in self._kinds(index) if current is not None else ():
                self.swapper.release(kind, (index, k), dirty=(index, k) in self._unwritten and kind != GRAD)
            if current is not None:
                self._unwritten.discard((index, k))
            for handle in [*(upcoming or ()), *(pending or ())]:
                if handle.key in self._unwritten and handle.kind != GRAD:  # held: kept for the resumed update
                    self._early.setdefault(handle.key, {})[handle.kind] = handle
                else:
                    self.swapper.let_go(handle)
            self._drop_early(only=index)
            if not isinstance(e, OSError) or self._lost(index):  # [Note: resuming an update]
                self.mark_damaged(unit, f"the update of unit {index} failed at piece {k} of {len(pieces)} "
                                        f"({type(e).__name__}: {e}) and cannot be resumed")
            raise
        finally:
            if fresh is not None:
                self._landing.release(fresh)
        self._resume.pop(index, None)
        if index in self._pending_order:  # the last step's, not this one's
            self._pending_order.remove(index)
            self._final.discard(index)
        else:
            if index in self._ready:
                self._ready.remove(index)
            self._updated.add(index)
        self._read_ahead()

    def set_pending(self, order: list[int]) -> None:
        """These units' updates run later, in this order ([Note: updates after the norm] in
        step_policy.py): their reads issued so far are kept for them, and more start now."""
        self._pending_order = list(order)
        self._last_pending_order = list(order)
        self._reading_ahead = False  # the next step's reads start with its forward
        self._read_ahead()
        for index in self._pending_order:  # a shard whose last write failed fails the step now, not one later
            for k in range(len(self._pieces[index])):
                for kind in KINDS:
                    if self.swapper.state(kind, (index, k)) is ShardState.INVALID:
                        self.swapper.fetch(kind, (index, k))  # raises the error naming the shard

    def _drop_early(self, keep: list[int] = (), only: int | None = None, held: bool = False) -> None:
        """Lets go of the reads issued ahead, but those of the units in `keep` (`only`: of that unit
        only) and of the pieces the pool holds (`held`: those too)."""
        for key in [key for key in self._early if key[0] not in keep and only in (None, key[0])
                    and (held or key not in self._held)]:
            self._give_back(list(self._early.pop(key).values()))

    # ---- failed updates ([Note: resuming an update]) ---------------------------------------

    def _lost(self, index: int) -> bool:
        """Whether a shard of the unit (any kind, its gradient too) lost its bytes to a failed write."""
        return any(self.swapper.state(kind, (index, k)) is ShardState.INVALID
                   for kind in self._kinds(index) for k in range(len(self._pieces[index])))

    def mark_damaged(self, unit: TierUnit, why: str) -> None:
        """The unit's state is not that of any step (an update failed part way and cannot resume,
        or was applied in a step that was abandoned): `damage()` says why until `load_state`
        replaces all of it."""
        self._damaged.setdefault(unit.index, why)
        self._resume.pop(unit.index, None)

    def damage(self) -> str | None:
        """Why the state is not that of any step, or None: a damaged unit, or a write of master or
        moments that failed (its bytes are lost until written again)."""
        if self._damaged:
            return next(iter(self._damaged.values()))
        lost = self.swapper.lost(KINDS)
        return None if lost is None else f"a write of optimizer state failed ({lost.strerror})"

    def drop_pending(self) -> None:
        """The pending updates will not run (the state is damaged): their reads ahead go back."""
        self._pending_order = []
        self._final.clear()
        self._resume.clear()
        self._drop_early(held=True)

    def finish_step(self) -> None:
        if self._order:
            self._expected, self._order = self._last_pending_order or self._order, []
            self._hold_spread(self._expected)
        self._drop_early(keep=self._pending_order)  # reads for an update that did not come (a skipped step)
        self._ready.clear()
        self._final = {index for index in self._final if index in self._pending_order}
        for g in self._fresh.values():  # a skipped step: never used
            self._landing.release(g)
        self._fresh.clear()
        self._sq.clear()
        self._updated.clear()
        self._reading_ahead = False

    def flush(self) -> None:
        """Waits for the writes in flight; a failed one raises here, naming the shard.

        The engine calls it at the start of the next step, so the last pieces' writes drain
        while the next forward and backward compute; a read of a shard still being written
        waits for that write (the swapper's ordering), never reading old bytes."""
        self._landing.consume_landed()
        self.swapper.flush()

    # ---- checkpoints and GatheredParameters -------------------------------------------------

    def _read_all(self, index: int, kind: str) -> torch.Tensor:
        out = torch.empty(sum(n for _, n in self._pieces[index]), dtype=torch.float32)
        for k, (start, n) in enumerate(self._pieces[index]):
            data = self.swapper.wait(self.swapper.fetch(kind, (index, k)))  # a failed read holds nothing
            try:
                out[start:start + n].copy_(data.view(torch.float32)[:n])
            finally:
                self.swapper.release(kind, (index, k))
        return out

    def master(self, unit: TierUnit) -> torch.Tensor:
        return self._read_all(unit.index, "master")

    def read(self, unit: TierUnit, kind: str) -> torch.Tensor:
        return self._read_all(unit.index, kind)

    def set_master(self, unit: TierUnit, values: torch.Tensor) -> None:
        self._drop_early(only=unit.index, held=True)  # a shard being written is held by nobody
        for k, (start, n) in enumerate(self._pieces[unit.index]):
            self.swapper.write("master", (unit.index, k), values[start:start + n].contiguous())
            self.swapper.flush()

    def state(self, unit: TierUnit) -> dict[str, torch.Tensor]:
        return {kind: self._read_all(unit.index, kind) for kind in KINDS}

    def grad(self, unit: TierUnit) -> torch.Tensor | None:
        """A host copy of the unit's accumulated gradient, or None where none is kept (one
        that fed its update at once)."""
        self._landing.consume_landed()
        index = unit.index
        if index in self._grads:
            return self._grads[index].clone()
        if index in self._spilled:
            return self._read_all(index, GRAD)
        return None

    def load_state(self, unit: TierUnit, state: dict[str, torch.Tensor]) -> None:
        self._drop_early(only=unit.index, held=True)  # a shard being written is held by nobody
        for kind in KINDS:
            if kind in state:
                for k, (start, n) in enumerate(self._pieces[unit.index]):
                    self.swapper.write(kind, (unit.index, k), state[kind][start:start + n].contiguous())
        self.swapper.flush()  # the sources are views of `state`: alive until here
        if all(kind in state for kind in KINDS):  # all of it replaced: no longer damaged
            self._damaged.pop(unit.index, None)
            self._resume.pop(unit.index, None)

    def io_stats(self) -> dict[str, float]:
        return self._tally.take()

    def close(self) -> None:
        self._landing.consume_landed()
        self._unwritten.clear()  # the store goes with the tier: nothing to write back
        self._drop_early(held=True)
        try:
            self.swapper.close()  # raises a failed write nobody has met yet
        finally:
            self.store.close()  # its files go all the same
