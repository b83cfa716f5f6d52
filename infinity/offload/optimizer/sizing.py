"""How the NVMe optimizer tier cuts the state into pieces and sizes its pool of buffers, from the
budget the config gives (`offload_optimizer.buffer_count` x `sub_group_size`, capped by the host's
free memory): the one place these are decided. The tier (nvme.py) holds and streams the pieces
as chosen here; `infinity estimate` and the host budget read the same functions.

[Note: cutting pieces]
Every pool buffer is as large as the largest piece, and a piece takes one buffer per kind
whatever its size. Cut at sub_group_size with the remainder left over, a transformer block of
50.3M elements at 2.5e7 gave two full pieces and a sliver of 0.3M, whose three buffers held
1% of their bytes: a third of the pool's pieces held almost nothing, and at 1.07B parameters
the state that fit in the pool before the next forward was two thirds of what its bytes
allowed. So a shard of n elements is cut into round(n / sub_group_size) pieces (at least one)
of equal size, rounded up to PIECE_ALIGN: a piece is at most 1.5x sub_group_size (DeepSpeed's
sub-groups, cut at parameter boundaries, also exceed it), and `infinity estimate`'s pool
follows the same cut (`cut_pieces`).

[Note: the pool is a budget]
`offload_optimizer.buffer_count` buffers of a `sub_group_size` sub-group (what DeepSpeed allocates
for them, a sub-group being no larger than the state) bound the host memory of the pipeline,
also capped at a quarter of the host's free memory; they do not fix its shape. The tier takes
the bytes those knobs allow (at least the 3 pieces a pipeline needs: reading, updating, writing)
and chooses how to cut the state into pieces and how many buffers of the largest piece to make
of them, for the most state the pool holds from one step to the next:

  * Held pieces stay in their buffers from one update to the next, neither read nor written
    (HELD_DIRTY: [Note: a piece's place] in pieces.py): their newest bytes are in memory only,
    where every reader of the state (the update, checkpoints, `state`) finds them, and are
    written back the moment the pool lets go
    of the piece (`Pieces.let_go`: the held set changes, a load replaces the state, the state is
    damaged), never dropped unwritten; at `close` the store goes with them. The NVMe copy is
    swap space, not a checkpoint, so nothing is lost that a write each step would have kept.
    The pieces that stream instead are spread evenly over the order the step
    updates them (expected, then as each step went: `held_spread`), so each is read while the
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
    are read while the unit before computes), of two units when the updates run in backward
    (`units_streaming`): there the unit updating keeps its buffers until its writes drain
    behind the next unit's backward, while the next one's pieces are read. With room for one,
    the unclipped 3B preset at 12 layers (637 pieces of 10 MB, 38 a layer, 324 buffers) held 66
    pieces and waited on reads in every layer's backward with the disk idle half of it, 66.8 s a
    step (median of five runs, 62.6-77.5); with room for two it held 25, moved 1.2 GB more each
    way, and took 61.9 s (60.1-64.6), and the full 3B's step came to 1.02x its floors
    (bench/results/finetune_3b.md). Updates that wait for the next forward keep room for one:
    that forward is disk-bound (the clipped 3B's disk was busy 86-90% of it), so there a held
    piece is worth more than depth. The rest hold pieces. A
    state many times the pool then holds little and keeps the depth: at 1.07B (48 x 2.5e7
    against 3.2G elements) holding a quarter of the state in all but 6 pieces' buffers cut
    the reads by as much but hid less of them (0.38 of the optimizer's I/O behind compute
    against 0.59), and the step was no faster.
  * Buffers are as large as the largest piece (its fp32 master's; its moments', where their
    format is smaller, in buffers of that size: [Note: two sizes of buffer] in
    infinity/offload/pool.py, so a bf16 piece of Adam's costs two fp32 buffers' bytes, not three,
    and the budget holds half as many pieces again), so pieces of unequal sizes (a 33.5M tile beside
    7.1M layers) waste the difference, and the spare buffers cost a piece each: smaller pieces
    hold more of the same bytes. The cuts tried are halvings of the piece that would leave
    `PIPELINE_DEPTH` pieces in flight, and the sizes that cut the largest shards into equal
    pieces; a whole state may be cut down to `MIN_CACHED_PIECE`. Of the cuts that hold within 2%
    of the most, the one with the largest pieces (fewest transfers: each costs the step's thread
    a little work) wins, among pieces of at least `COARSE_PIECE`, unless the state mostly streams
    through a pool of fewer than `STREAM_DEPTH` pieces: then the largest cut that gives that
    many, since a pool of three or four pieces reads one piece ahead and the update waits for
    each. That cut stops at the least request the disk was measured to keep its pace with
    (`streamed_floor`: [Note: the disk tunes itself] in infinity/io/autotune.py; a master's
    piece no smaller than it; the placement plan and `infinity estimate` count the same), or
    at `MIN_STREAMED_PIECE` (1 MiB, an aio block) where nothing was measured (an `aio` section
    given). The depth itself is not taken from the disk: on both hosts measured, 8 and 16
    pieces in flight ran alike, and a disk that keeps its pace from 1 MiB requests at queue
    depth 32 has 16 pieces' reads (3 kinds each) to fill the queue. The 134M GPT's 1.6 GB of
    state through 96 MB (12 x 2e6 elements) waited 0.70 s a step on reads with 2M-element pieces, 0.48 s with
    0.5M (clipping 1.0). Unclipped, 0.5M-element pieces once ran the disk at half speed inside the
    step, and 1M ones (8 in flight) looked better there; the cause was the pool's buffers, whose
    pages were then mostly not huge ([Note: one mapping a class] in infinity/offload/pool.py), and
    with that fixed, side by side (`bench/bench_stream_depth.py`, bench/results/streaming.md),
    depth 16 is as fast as 8 at 96 MB unclipped (3.33 against 3.25 s, within the spread), faster
    at 400 MB unclipped (2.25 against 2.50 s) and clipped (1.45x against 1.48x its floors): one
    depth for both update modes.
  * The pool never takes more buffers than every piece and `PIPELINE_DEPTH` more of each kind:
    DeepSpeed's `buffer_count` sub-groups of a small model (a LoRA's adapters) would be several
    times its whole state.

DeepSpeed's 4 buffers of 1e8 (or 1e9) elements, taken as they read, gave the pipeline 3 pieces
in flight and a step 1.4-1.6x its floor, where 48 buffers reached it. The choice is logged and
kept in `chosen` (`pieces_held` of `pieces`); the numbers of a step do not depend on it (Adam is
element-wise, and a held piece's bytes are those a read would bring).
"""

from __future__ import annotations

from collections import Counter

import psutil

from infinity.io import PAGE_SIZE
from infinity.offload.optimizer.accumulators import NORM_ROW
from infinity.offload.pool import round_up

STATE_KINDS = 3  # fp32 master, exp_avg, exp_avg_sq: the buffers one piece of Adam's state takes
PIECE_ALIGN = 1024  # elements: 4 KiB of fp32, so every piece's extent is O_DIRECT-aligned
PIPELINE_DEPTH = 16  # pieces the pool should hold at once ([Note: the pool is a budget])
STREAM_DEPTH = 16  # pieces in flight a pool that mostly streams is cut for, at the least ([Note: the pool is a budget])
MIN_PIECE = 1 << 22  # elements: 16 MiB of fp32, two 8 MiB aio blocks per kind
MIN_STREAMED_PIECE = 1 << 18  # elements: 1 MiB of fp32 (an aio block), the least piece a state that streams is cut into
COARSE_PIECE = 1 << 21  # elements: 8 MiB of fp32, the least piece unless a streaming pool needs more pieces
MIN_CACHED_PIECE = 1 << 18  # elements: 1 MiB of fp32, the smallest piece of a state the pool holds whole
CACHED_SPARE = 2  # pieces' buffers beyond a whole state held: the first step's reads, spilled gradients
STREAM_PIECES = 6  # pieces' buffers left to those streamed beside the held ones: updating, reading, writing, 3 read ahead
HOST_SHARE = 4  # the pool takes at most a quarter of the host memory free when it is built
assert PIECE_ALIGN % NORM_ROW == 0  # pieces start on norm rows ([Note: gradient norm by rows] in accumulators.py)


MIN_TIED_TILE = 1 << 22  # elements: the least tile a tied weight is cut into for the pool ([Note: a tied weight's tiles])


def tied_tile_size(tile_size: int, sub_group_size: int, buffer_count: int) -> int:
    """[Note: a tied weight's tiles]
    A tied embedding's gradient is final last in backward (the lookup's part comes after every
    block's), so its tiles' updates are the tail of an unclipped step: each tile's update follows
    its weight-gradient product and has nothing but the next tile's product to run beside. A tile
    whose state is larger than the pool streams at the disk's pace with nothing computing: at
    `tile_size`'s default the 134M GPT's tied 64000 x 768 weight is two tiles of 295 MB of Adam
    state, and through a 96 MB pool (`sub_group_size` 2e6 x 12) the step waited 0.45-0.53 s on
    their reads. So where the optimizer state is on NVMe a tied weight's tiles hold at most half
    the pool's budget (`buffer_count` x `sub_group_size` fp32 elements) of fp32 Adam state (the
    largest format), at least `MIN_TIED_TILE` elements: one tile's state is read while the tile
    before it computes its product (the unit hooks' `between` runs between its row blocks:
    [Note: between a unit's ops] in infinity/zero/hooks.py) and its writes drain behind the next.
    Twelve tiles of 4M elements there waited 0.13 s (bench/results/streaming.md). Budgets that
    hold such a weight's state twice over (DeepSpeed's defaults, the built-in configs) keep
    `tile_size`; other weights keep it too (their gradients are final before the blocks')."""
    if tile_size <= 0:
        return tile_size
    return min(tile_size, max(MIN_TIED_TILE, int(buffer_count * sub_group_size) // (2 * STATE_KINDS)))


def piece_buffers(moments: int = STATE_KINDS - 1, moment_bytes: float = 4.0, spilled: bool = False) -> tuple[float, float]:
    """(buffers a piece takes in the pool, of them those it keeps while held), counted in buffers
    of the piece's fp32 size: its master, its `moments` at `moment_bytes` a value (4 fp32, 2 bf16,
    about 1 for 8 bits), and a spilled gradient's. Moments smaller than fp32 take buffers of
    their own size ([Note: two sizes of buffer] in infinity/offload/pool.py), so a bf16 piece of
    Adam's counts 2, not 3; with a spilled gradient the pool keeps one size (the gradient's
    buffer is fp32-sized, and shared with the others as before). The one count of a piece's
    buffers: the tier, the placement plan and `infinity estimate` all take it from here."""
    kept = 1 + moments if spilled or moment_bytes >= 4 else 1 + moments * moment_bytes / 4
    return kept + (1 if spilled else 0), kept


def pool_classes(buffers: float, largest: int, moments: int,
                 moment_nbytes: int | None) -> tuple[int, tuple[int, int] | None, float | None]:
    """(buffers of the largest piece's fp32 size, (count, bytes) of smaller ones for the moments or
    None, a piece's buffers as made, in fp32 ones, or None) of a pool of `buffers` fp32 buffers'
    bytes ([Note: two sizes of buffer] in infinity/offload/pool.py): one size when `moment_nbytes`
    (a moment's bytes in the largest piece) is None, else a master's and `moments` moments' buffers
    for each piece in flight, each buffer whole pages, at least the 3 pieces of a pipeline."""
    if moment_nbytes is None:
        return int(buffers), None, None
    whole, part = round_up(4 * largest, PAGE_SIZE), round_up(moment_nbytes, PAGE_SIZE)
    count = max(3, int(buffers * whole) // (whole + moments * part))
    return count, (count * moments, moment_nbytes), 1 + moments * part / whole


def streamed_floor(min_request: int | None) -> int:
    """The least piece, in elements, a state that streams is cut into: its fp32 master's bytes the
    least request the measured disk keeps its pace with (`aio.min_request`: [Note: the disk tunes
    itself] in infinity/io/autotune.py), or `MIN_STREAMED_PIECE` where nothing was measured (an
    `aio` section given, a file system refusing O_DIRECT)."""
    if min_request is None:
        return MIN_STREAMED_PIECE
    return max(PIECE_ALIGN, round_up(min_request // 4, PIECE_ALIGN))


def choose_pieces(shards: list[int], sub_group_size: int, buffer_count: int, per_piece: float,
                  host_elements: int | None = None, kinds: float = STATE_KINDS,
                  planned: int | None = None, min_streamed: int | None = None,
                  streaming: int = 1) -> tuple[int, float]:
    """(piece target in elements, buffers) for shards of these sizes ([Note: the pool is a budget]).
    `per_piece`, `kinds`: buffers a piece takes and keeps while held (`piece_buffers`; buffers
    are counted in the largest piece's fp32 size);
    `host_elements`: the most fp32 elements the pool may take of the host's free memory;
    `planned`: fp32 elements the placement plan gives the pool (max_in_cpu "auto"), taken beside
    the knobs' budget and not capped by the host's share, which the plan has counted already;
    `min_streamed`: the least piece a state that streams is cut into (`streamed_floor`; None:
    `MIN_STREAMED_PIECE`); `streaming`: the units whose streamed pieces are in the pool at once
    (`units_streaming`)."""
    asked = max((n for numel in shards for _, n in cut_pieces(numel, sub_group_size)), default=1)
    total = sum(shards)
    # DeepSpeed's buffers: buffer_count sub-groups (a sub-group never larger than the state), and
    # at least the 3 pieces of a pipeline; never more than the host's share.
    budget = max(buffer_count * max(asked, min(int(sub_group_size), total)), 3 * per_piece * asked)
    budget = int(max(min(budget, host_elements or budget), 3 * per_piece * asked, planned or 0))
    target = min(int(sub_group_size), max(MIN_PIECE, int(budget // (PIPELINE_DEPTH * per_piece))))
    sizes = Counter(shards)
    options = []  # (elements of state held from one step to the next, piece target, buffers)
    for cut in _cuts(sizes, target):
        count, largest, most = 0, 1, 1
        for numel, times in sizes.items():
            ps = cut_pieces(numel, cut)
            count, largest, most = count + times * len(ps), max(largest, ps[0][1]), max(most, len(ps))
        held = held_pieces(count, budget // largest, per_piece, most, kinds, streaming)
        if held == count:  # the whole state stays: no buffer more than it and the spare pieces
            buffers = kinds * count + per_piece * CACHED_SPARE
        elif cut < min(target, MIN_STREAMED_PIECE if min_streamed is None else min_streamed):
            continue  # a piece that streams must stream at the disk's speed
        else:  # never more than the whole state and a pipeline's pieces besides: a buffer past that is never used
            buffers = max(3 * per_piece, min(budget // largest, per_piece * (count + PIPELINE_DEPTH)))
        options.append((total if held == count else held * total // count, cut, buffers))

    def best(among: list) -> tuple:  # the largest pieces (fewest transfers) of those that hold within 2% of the most
        most = max(kept for kept, _, _ in among)
        return max((o for o in among if o[0] >= most * 0.98), key=lambda o: o[1])

    # Pieces of at least COARSE_PIECE where the cut allows (each costs the step's thread a little
    # work), but a state that mostly streams through a pool of few pieces is cut finer, for
    # STREAM_DEPTH pieces in flight ([Note: the pool is a budget]).
    kept, cut, buffers = best([o for o in options if o[0] == total or o[1] >= COARSE_PIECE] or options)
    if 2 * kept < total and buffers < per_piece * STREAM_DEPTH:
        deep = [o for o in options if o[2] >= per_piece * STREAM_DEPTH]
        if deep:  # the largest pieces that keep the pipeline that deep
            kept, cut, buffers = max(deep, key=lambda o: o[1])
    return cut, buffers


def held_pieces(pieces: int, buffers: float, per_piece: float, unit_pieces: int = 1, kinds: float = STATE_KINDS,
                streaming: int = 1) -> int:
    """How many of the state's pieces a pool of `buffers` holds from one step to the next
    ([Note: the pool is a budget]): all of them if their kinds and `CACHED_SPARE` pieces more
    fit; else as many as leave the streamed ones `STREAM_PIECES` pieces' buffers and room for
    the streamed pieces of `streaming` units (`units_streaming`; `unit_pieces`: the most pieces
    a unit has), read while the unit before computes."""
    if kinds * pieces + per_piece * CACHED_SPARE <= buffers:
        return pieces
    most = (buffers - per_piece * STREAM_PIECES) // kinds
    unit_pieces *= streaming
    # buffers - 3 h >= per_piece * (STREAM_PIECES + unit_pieces * (pieces - h) / pieces)
    spare = buffers - per_piece * (STREAM_PIECES + unit_pieces)
    slope = kinds * pieces - per_piece * unit_pieces
    if slope > 0:
        most = min(most, spare * pieces // slope)
    elif spare < 0:
        most = 0
    return int(max(0, min(pieces, most)))


def units_streaming(in_backward: bool) -> int:
    """The units whose streamed pieces the pool makes room for at once ([Note: the pool is a
    budget]): two when the updates run in backward (`in_backward`: the unit updating, whose
    writes drain behind the next unit's backward, and the next one, read ahead meanwhile), one
    when they wait for the next forward."""
    return 2 if in_backward else 1


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


def max_piece(sub_group_size: int) -> int:
    """The largest piece a cut at `sub_group_size` can make ([Note: cutting pieces]): what a
    budget made before the shards are known (the built-in config's) must leave room for."""
    return int(1.5 * sub_group_size)


def cut_pieces(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """(start, count) of each piece of a shard of `numel` elements ([Note: cutting pieces])."""
    target = max(PIECE_ALIGN, int(sub_group_size))
    count = max(1, (numel + target // 2) // target)
    size = -(-numel // count)
    size = -(-size // PIECE_ALIGN) * PIECE_ALIGN
    return [(s, min(size, numel - s)) for s in range(0, numel, size)]


def host_elements(available: int | None = None) -> int:
    """The most fp32 elements the pool takes of the host's free memory (`available` bytes, else
    what the host has free now): a `HOST_SHARE`-th of it."""
    available = psutil.virtual_memory().available if available is None else available
    return available // HOST_SHARE // 4


def pool_size(shards: list[int], sub_group_size: int, buffer_count: int, piece: tuple[float, float],
              host: int | None = None, planned: int | None = None, min_streamed: int | None = None,
              streaming: int = 1) -> tuple[float, int]:
    """(buffers, elements a buffer) of the pool of a tier over `shards`, as the tier sizes it
    (`piece`: `piece_buffers`; buffers counted in fp32 ones of the largest piece): what the
    placement plan and `infinity estimate` count, never a formula of their own."""
    target, buffers = choose_pieces(shards, sub_group_size, buffer_count, piece[0], host, piece[1], planned, min_streamed,
                                    streaming)
    return buffers, max((n for numel in shards for _, n in cut_pieces(numel, target)), default=1)


def pool_bytes(shards: list[int], sub_group_size: int, buffer_count: int, piece: tuple[float, float],
               host: int | None = None, planned: int | None = None, min_streamed: int | None = None,
               streaming: int = 1) -> int:
    """The host memory of that pool (`pool_size`), in bytes."""
    buffers, elements = pool_size(shards, sub_group_size, buffer_count, piece, host, planned, min_streamed, streaming)
    return int(buffers * elements * 4)


def streamed_elements(shards: list[int], sub_group_size: int, buffer_count: int, piece: tuple[float, float],
                      host: int | None = None, planned: int | None = None, min_streamed: int | None = None,
                      streaming: int = 1) -> int:
    """Elements of a tier's state over `shards` that its pool does not hold from one step to the
    next, so that each step reads and writes them: what the placement plan compares."""
    if not shards:
        return 0
    target, buffers = choose_pieces(shards, sub_group_size, buffer_count, piece[0], host, piece[1], planned, min_streamed,
                                    streaming)
    cuts = [cut_pieces(numel, target) for numel in shards]
    held = held_pieces(sum(map(len, cuts)), buffers, piece[0], max(map(len, cuts)), piece[1], streaming)
    return sum(shards) * (sum(map(len, cuts)) - held) // sum(map(len, cuts))


def held_spread(pieces: list[tuple[int, int]], held: int) -> set[tuple[int, int]]:
    """Which of `pieces` (in the order the step updates them) the pool holds, `held` of them: all
    but one in every few, so that each streamed piece has the updates and compute of the held ones
    before it to be read in ([Note: the pool is a budget])."""
    streamed = len(pieces) - held
    return set(pieces) - {pieces[(j + 1) * len(pieces) // streamed - 1] for j in range(streamed)}
