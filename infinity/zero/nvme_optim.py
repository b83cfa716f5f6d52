"""`offload_optimizer.device: nvme`: fp32 master, exp_avg and exp_avg_sq of every shard live in
the NVMe store, cut into pieces of at most `sub_group_size` elements.

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

The fp32 gradient accumulators stay in host memory (4 bytes per parameter of the shard).
"""

from __future__ import annotations

import torch

from infinity.optim.functional import adam_update
from infinity.tiers import BufferPool, NvmeStore, Swapper
from infinity.tiers.store import default_job_id
from infinity.zero.nvme_params import IOTally, _plan_count, make_handle
from infinity.zero.optim_shards import AdamHyper
from infinity.zero.unit import Unit

KINDS = ("master", "exp_avg", "exp_avg_sq")
PIECE_ALIGN = 1024  # elements: 4 KiB of fp32, so every piece's extent is O_DIRECT-aligned


class NvmeOptimizerState:
    """The NVMe optimizer tier (same methods as `ResidentOptimizerState`)."""

    def __init__(self, offload, aio, sub_group_size: int, *, rank: int, units: list[Unit]):
        piece = max(PIECE_ALIGN, sub_group_size // PIECE_ALIGN * PIECE_ALIGN)
        self._pieces: dict[int, list[tuple[int, int]]] = {
            u.index: [(s, min(piece, u.shard_numel - s)) for s in range(0, u.shard_numel, piece)] for u in units}
        layout = {kind: {(i, k): n * 4 for i, ps in self._pieces.items() for k, (_, n) in enumerate(ps)}
                  for kind in KINDS}
        self.handle = make_handle(aio)
        self.store = NvmeStore(offload.nvme_path, layout, job_id=f"{default_job_id()}-optimizer", rank=rank,
                               handle=self.handle, name="offload_optimizer")
        largest = max((n for ps in self._pieces.values() for _, n in ps), default=PIECE_ALIGN)
        # Three kinds for each of: the piece being read, the piece being updated, the piece being written.
        self.pool = BufferPool(_plan_count(offload.buffer_count, 3 * len(KINDS), "offload_optimizer"), largest * 4,
                               name="offload_optimizer")
        self.swapper = Swapper(self.store, self.pool, None, self.handle)
        self._grads = {u.index: torch.zeros(u.shard_numel, dtype=torch.float32) for u in units}
        self._early: dict[tuple[int, int], list] = {}  # (unit, piece) -> fetch handles issued in backward
        self._ready: list[int] = []  # units in the order their gradients became final
        self._tally = IOTally(self.swapper)

    # ---- gradients ------------------------------------------------------------------------

    def add(self, unit: Unit, master: torch.Tensor) -> None:
        zeros = torch.zeros(max(n for _, n in self._pieces[unit.index]), dtype=torch.float32)
        for k, (start, n) in enumerate(self._pieces[unit.index]):
            self.swapper.write("master", (unit.index, k), master[start:start + n].contiguous())
            self.swapper.write("exp_avg", (unit.index, k), zeros[:n])
            self.swapper.write("exp_avg_sq", (unit.index, k), zeros[:n])
        self.swapper.flush()  # the sources are views of `master` and `zeros`: alive until here

    def accumulate(self, unit: Unit, grad_shard: torch.Tensor, first: bool, last: bool = False) -> None:
        acc = self._grads[unit.index]
        with torch.profiler.record_function("infinity::grad_accumulate"):
            g = grad_shard.to("cpu", non_blocking=False)
            acc.copy_(g) if first else acc.add_(g)
        if last:
            self._ready.append(unit.index)
            for k in range(len(self._pieces[unit.index])):
                if not self._read_early(unit.index, k):
                    break  # the pool is as full as the step's own pipeline allows

    def grad_stats(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        acc = self._grads[unit.index]
        return acc.square().sum(dtype=torch.float32), ~torch.isfinite(acc).all()

    def step_order(self, units: list[Unit]) -> list[Unit]:
        """Units whose state reads started in backward first, in that order."""
        rank = {index: pos for pos, index in enumerate(self._ready)}
        return sorted(units, key=lambda u: rank.get(u.index, len(rank) + u.index))

    # ---- the update -----------------------------------------------------------------------

    def _fetch(self, index: int, k: int) -> list:
        return self._early.pop((index, k), None) or [self.swapper.fetch(kind, (index, k)) for kind in KINDS]

    def _read_early(self, index: int, k: int) -> bool:
        """Issues the reads of one piece during backward, if the pool can spare its buffers while
        keeping room for the step's pipeline (a piece updating, one reading, one writing)."""
        if (index, k) in self._early:
            return True
        if self.pool.num_free < 3 * len(KINDS) + len(KINDS):
            return False
        self._early[(index, k)] = [self.swapper.fetch(kind, (index, k)) for kind in KINDS]
        return True

    def update(self, unit: Unit, hypers: list[AdamHyper], step: int, grad_scale: float,
               out: torch.Tensor) -> None:
        pieces = self._pieces[unit.index]
        grad = self._grads[unit.index]
        half = out if out.dtype in (torch.bfloat16, torch.float16) else None
        pending = self._fetch(unit.index, 0)
        for k, (start, n) in enumerate(pieces):
            current = pending
            if k + 1 < len(pieces):
                pending = self._fetch(unit.index, k + 1)  # read ahead while this piece updates
            with torch.profiler.record_function("infinity::nvme_wait"):
                master, m, v = (self.swapper.wait(h).view(torch.float32)[:n] for h in current)
            with torch.profiler.record_function("infinity::adam"):
                for seg in unit.segments:
                    lo, hi = max(seg.start, start), min(seg.start + seg.count, start + n)
                    if lo >= hi:
                        continue
                    h = hypers[seg.group]
                    adam_update(master[lo - start:hi - start], grad[lo:hi], m[lo - start:hi - start],
                                v[lo - start:hi - start], step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                                eps=h.eps, weight_decay=h.weight_decay, adamw_mode=h.adamw_mode,
                                bias_correction=h.bias_correction, grad_scale=grad_scale,
                                half_out=None if half is None else half[lo:hi])
                if half is None:
                    out[start:start + n].copy_(master)
            for kind in KINDS:
                self.swapper.release(kind, (unit.index, k), dirty=True)  # the write starts now
        if unit.index in self._ready:
            self._ready.remove(unit.index)

    def finish_step(self) -> None:
        self._ready.clear()

    def flush(self) -> None:
        """Waits for the writes in flight; a failed one raises here, naming the shard.

        The engine calls it at the start of the next step, so the last pieces' writes drain
        while the next forward and backward compute; a read of a shard still being written
        waits for that write (the swapper's ordering), never reading old bytes."""
        self.swapper.flush()

    # ---- checkpoints and GatheredParameters -------------------------------------------------

    def _read_all(self, index: int, kind: str) -> torch.Tensor:
        out = torch.empty(sum(n for _, n in self._pieces[index]), dtype=torch.float32)
        for k, (start, n) in enumerate(self._pieces[index]):
            h = self.swapper.fetch(kind, (index, k))
            try:
                out[start:start + n].copy_(self.swapper.wait(h).view(torch.float32)[:n])
            finally:
                self.swapper.release(kind, (index, k))
        return out

    def master(self, unit: Unit) -> torch.Tensor:
        return self._read_all(unit.index, "master")

    def set_master(self, unit: Unit, values: torch.Tensor) -> None:
        for k, (start, n) in enumerate(self._pieces[unit.index]):
            self.swapper.write("master", (unit.index, k), values[start:start + n].contiguous())
            self.swapper.flush()

    def state(self, unit: Unit) -> dict[str, torch.Tensor]:
        return {kind: self._read_all(unit.index, kind) for kind in KINDS}

    def load_state(self, unit: Unit, state: dict[str, torch.Tensor]) -> None:
        for kind in KINDS:
            for k, (start, n) in enumerate(self._pieces[unit.index]):
                self.swapper.write(kind, (unit.index, k), state[kind][start:start + n].contiguous())
                self.swapper.flush()

    def io_stats(self) -> dict[str, float]:
        return self._tally.take()

    def close(self) -> None:
        for (index, k), handles in list(self._early.items()):
            for kind in KINDS:
                self.swapper.release(kind, (index, k))
        self._early.clear()
        self.swapper.close()
        self.store.close()
