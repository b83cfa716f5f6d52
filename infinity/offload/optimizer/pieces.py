"""The pieces of the NVMe optimizer tier's state: one record per piece (`Piece`), whose
`PieceState` says where its bytes are and what memory it holds, changed only through the
transitions below, each of which first asserts the states it may leave ([Note: a piece's place]).

[Note: a piece's place]
A unit's trainable shard is cut into pieces (sizing.py); each piece has one buffer per kind of
state (fp32 master, exp_avg, exp_avg_sq, and a spilled gradient's) whenever it is in memory:

    ON_DISK ──read_ahead──▶ READ_AHEAD ──take──▶ UPDATING ──keep──▶ HELD_DIRTY
       ▲  ▲                     │                 │  │                  │ │
       │  └──── let_go ─────────┘                 │  └── take ──────────┼─┘ (the next update)
       └──────── write_back / let_go (written) ───┴─────────────────────┘

  ON_DISK     its bytes are on NVMe (a write of them may still be in flight: the swapper makes a
              later read wait for it); it holds no buffer.
  READ_AHEAD  reads of some or all of its kinds were issued before its update (`handles`); the
              buffers are the swapper's until the piece is taken or let go. Its bytes are the disk's.
  UPDATING    an update took its handles and holds its buffers until it keeps, writes or gives it back.
  HELD_DIRTY  kept in its buffers after its update without being written ([Note: the pool is a
              budget] in sizing.py): its newest bytes are in memory only, where every reader finds
              them; written the moment the pool lets go of it, never dropped (but with the store).

Whether the pool holds a piece from one step to the next (`held`) is a choice of the tier, not a
place: a held piece is kept after its update, the others are written back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infinity.offload import FetchHandle, Swapper
from infinity.offload.optimizer.accumulators import GRAD


class PieceState(enum.Enum):
    """Where one piece's bytes are ([Note: a piece's place])."""

    ON_DISK = "on NVMe; no buffer"
    READ_AHEAD = "reads issued before its update; the disk's bytes"
    UPDATING = "taken by an update"
    HELD_DIRTY = "in its buffers after its update, unwritten"


@dataclass(slots=True, eq=False)
class Piece:
    """One piece of a unit's state: elements [start, start + numel) of its trainable shard."""

    unit: int
    index: int  # its position among the unit's pieces
    start: int
    numel: int
    held: bool = False  # the pool keeps it from step to step ([Note: the pool is a budget] in sizing.py)
    state: PieceState = PieceState.ON_DISK
    handles: dict[str, FetchHandle] = field(default_factory=dict)  # kind -> fetch: READ_AHEAD, HELD_DIRTY
    unwritten: bool = False  # its newest bytes are in its buffers only: HELD_DIRTY, and UPDATING from there

    @property
    def key(self) -> tuple[int, int]:
        return self.unit, self.index

    def _leave(self, *states: PieceState) -> None:
        assert self.state in states, f"piece {self.key}: {self.state.name}, expected one of {[s.name for s in states]}"


class Pieces:
    """Every piece of the tier's state and the swapper calls that move them between places."""

    def __init__(self, swapper: Swapper, cuts: dict[int, list[tuple[int, int]]]):
        self.swapper = swapper
        self.of: dict[int, list[Piece]] = {unit: [Piece(unit, k, start, n) for k, (start, n) in enumerate(ps)]
                                           for unit, ps in cuts.items()}

    def __getitem__(self, key: tuple[int, int]) -> Piece:
        return self.of[key[0]][key[1]]

    def in_memory(self) -> list[Piece]:
        """The pieces holding buffers outside an update (read ahead or held)."""
        return [p for ps in self.of.values() for p in ps if p.state in (PieceState.READ_AHEAD, PieceState.HELD_DIRTY)]

    def read_ahead(self, piece: Piece, kinds: list[str]) -> None:
        """Issues the reads of `kinds` before the piece's update (a held piece's spilled gradient
        joins its kept state). Raises OSError for a shard whose last write failed: the kinds
        issued before it stay with the piece."""
        piece._leave(PieceState.ON_DISK, PieceState.READ_AHEAD, PieceState.HELD_DIRTY)
        for kind in kinds:
            piece.handles[kind] = self.swapper.fetch(kind, piece.key)
            if piece.state is PieceState.ON_DISK:
                piece.state = PieceState.READ_AHEAD

    def take(self, piece: Piece, kinds: tuple[str, ...]) -> list[FetchHandle]:
        """The fetch handles of the piece's `kinds` for its update: those issued ahead, and the
        rest now. If one cannot be issued (a shard whose last write failed), the others are given
        back and the piece is on disk (or held, with what it held)."""
        piece._leave(PieceState.ON_DISK, PieceState.READ_AHEAD, PieceState.HELD_DIRTY)
        early, piece.handles = piece.handles, {}
        handles = []
        try:
            for kind in kinds:
                handles.append(early.pop(kind, None) or self.swapper.fetch(kind, piece.key))
        except BaseException:
            for handle in [*handles, *early.values()]:
                self._end(piece, handle)
            piece.state, piece.unwritten = PieceState.ON_DISK, False
            raise
        piece.state = PieceState.UPDATING
        return handles

    def keep(self, piece: Piece, handles: dict[str, FetchHandle]) -> None:
        """An updated held piece stays in its buffers, unwritten; a spilled gradient is dropped."""
        piece._leave(PieceState.UPDATING)
        if GRAD in handles:
            self.swapper.release(GRAD, piece.key)
        piece.handles = {kind: h for kind, h in handles.items() if kind != GRAD}
        piece.state, piece.unwritten = PieceState.HELD_DIRTY, True

    def write_back(self, piece: Piece, kinds: tuple[str, ...]) -> None:
        """An updated piece's state is written (each kind, even if another kind's write cannot
        start: [Note: failed transfers give their buffers back] in nvme.py); a spilled gradient is
        only dropped. The first error is raised once all are released."""
        piece._leave(PieceState.UPDATING)
        piece.state, piece.unwritten = PieceState.ON_DISK, False
        error = None
        for kind in kinds:
            try:
                self.swapper.release(kind, piece.key, dirty=kind != GRAD)  # the write starts now
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def untake(self, piece: Piece, waited: tuple[str, ...], pending: list[FetchHandle]) -> None:
        """An update that took the piece failed: the buffers of `waited` kinds go back (written
        if the piece held bytes newer than the disk's); of the fetches not yet waited for
        (`pending`), a held piece's stay with it for the resumed update, the others are let go."""
        piece._leave(PieceState.UPDATING)
        for kind in waited:
            self.swapper.release(kind, piece.key, dirty=piece.unwritten and kind != GRAD)
        if waited:
            piece.unwritten = False
        for handle in pending:
            if piece.unwritten and handle.kind != GRAD:
                piece.handles[handle.kind] = handle
            else:
                self.swapper.let_go(handle)
        piece.state = PieceState.HELD_DIRTY if piece.handles else PieceState.ON_DISK

    def let_go(self, piece: Piece) -> None:
        """The pool lets go of a piece read ahead or held: its reads are ended, a held piece's
        newest bytes written first. The first error is raised once all are released."""
        piece._leave(PieceState.READ_AHEAD, PieceState.HELD_DIRTY)
        handles, piece.handles = piece.handles, {}
        error = None
        for handle in handles.values():
            try:
                self._end(piece, handle)
            except OSError as e:
                error = error or e
        piece.state, piece.unwritten = PieceState.ON_DISK, False
        if error is not None:
            raise error

    def _end(self, piece: Piece, handle: FetchHandle) -> None:
        if piece.unwritten and handle.kind != GRAD:
            self.swapper.release(handle.kind, handle.key, dirty=True)  # the write starts now
        else:
            self.swapper.let_go(handle)

    def forget_unwritten(self) -> None:
        """The store goes with the tier: nothing held needs writing any more."""
        for ps in self.of.values():
            for p in ps:
                p.unwritten = False
