"""The NVMe optimizer tier treats buffer_count x sub_group_size as a memory budget and cuts it
into the pieces that keep its pipeline deep ([Note: the pool is a budget] in
infinity/offload/optimizer/sizing.py): DeepSpeed's knobs get a deep pipeline in the same bytes, bench/'s
tuned knobs are left as they are, and the numbers of a step do not depend on the cut."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from torch import nn

import infinity
from gpt import TinyGPT, batches, config, engine_run
from infinity.offload.optimizer import nvme, sizing
from infinity.offload.optimizer.sizing import PIPELINE_DEPTH, choose_pieces, cut_pieces

M = 1_000_000


def _largest(shards, target):
    return max(n for numel in shards for _, n in cut_pieces(numel, target))


# The 134M GPT of bench/: twelve 7.1M-element layers, the 64000 x 768 embedding as two tiles.
GPT_134M = [7_087_872] * 12 + [33_553_920, 15_598_080, 1_536]


@pytest.mark.parametrize("sub_group_size,buffer_count", [(1e8, 4), (1e9, 4), (1e9, 5)],
                         ids=["ds-style", "ds-defaults", "ds-defaults-5"])
def test_deepspeeds_knobs_get_a_deep_pipeline_in_deepspeeds_bytes(sub_group_size, buffer_count):
    per_piece = 3  # master, exp_avg, exp_avg_sq; no spilled gradient
    total = sum(GPT_134M)
    deepspeeds = buffer_count * min(int(sub_group_size), total) * 4  # its buffers: a sub-group each (>= a tile here)
    target, buffers = choose_pieces(GPT_134M, int(sub_group_size), buffer_count, per_piece)
    piece = _largest(GPT_134M, target)
    assert buffers * piece * 4 <= deepspeeds  # within what DeepSpeed takes for these knobs
    assert buffers // per_piece >= 10  # 3 pieces in flight before
    pieces = sum(len(cut_pieces(n, target)) for n in GPT_134M)
    if deepspeeds >= per_piece * total * 4:  # the bytes hold the whole state: cut so that they do
        assert buffers >= per_piece * pieces and piece >= sizing.MIN_CACHED_PIECE
    else:  # 0.75% short of the state: most of it held, the rest streamed at the disk's speed
        assert piece >= sizing.MIN_STREAMED_PIECE
        held = sizing.held_pieces(pieces, buffers, per_piece)
        assert held * piece >= 0.8 * total


def test_the_host_share_and_the_least_pipeline_bound_the_pool():
    per_piece = 3
    asked = _largest(GPT_134M, 25_000_000)
    # A host with little free memory: the least pool, 3 pieces (reading, updating, writing) a kind.
    target, buffers = choose_pieces(GPT_134M, 25_000_000, 48, per_piece, host_elements=1)
    assert buffers * _largest(GPT_134M, target) <= 3 * per_piece * asked
    assert buffers >= 3 * per_piece
    # bench/'s 48 buffers of 2.5e7 (33.5M, the largest piece): bytes that hold the whole state,
    # in buffers of a smaller piece, within the same bytes.
    target, buffers = choose_pieces(GPT_134M, 25_000_000, 48, per_piece)
    pieces = sum(len(cut_pieces(n, target)) for n in GPT_134M)
    assert buffers >= per_piece * pieces and buffers * _largest(GPT_134M, target) <= 48 * asked
    # ... unless the host cannot spare them.
    target, buffers = choose_pieces(GPT_134M, 25_000_000, 48, per_piece, host_elements=24 * asked)
    assert buffers * _largest(GPT_134M, target) <= 24 * asked and buffers > 24


def test_a_small_state_gets_no_more_buffers_than_it_has_pieces():
    """LoRA over a 23.6B base: 40 units of 1.15M trainable elements. DeepSpeed's budget (12
    sub-groups of 2.5e7) would be 259 buffers, 2.3x the whole state; the pool holds every piece
    and the pipeline's few more of each kind, no more."""
    per_piece = 3
    shards = [1_150_000] * 40
    target, buffers = choose_pieces(shards, 25_000_000, 12, per_piece)
    pieces = sum(len(cut_pieces(n, target)) for n in shards)
    assert buffers == per_piece * (pieces + sizing.CACHED_SPARE) < 259
    assert buffers * _largest(shards, target) >= per_piece * sum(shards)  # the whole state still fits


def test_a_state_within_deepspeeds_bytes_is_held_whole_across_pieces_of_unequal_sizes():
    """DeepSpeed's defaults (4 sub-groups of at most the whole state) on the 7.4M GPT of bench/:
    the bytes hold the state, but in buffers of the largest piece they would hold 28 of its 30
    pieces and re-read the rest every step; cut smaller, a buffer for each piece and the
    pipeline's more of each kind fit in the same bytes."""
    per_piece = 3
    shards = [720_896] * 8 + [1_048_576, 569_344]  # its units' trainable shards: 8 blocks, a tile, the root
    total = sum(shards)
    target, buffers = choose_pieces(shards, 1_000_000_000, 4, per_piece)
    pieces = sum(len(cut_pieces(n, target)) for n in shards)
    assert buffers >= per_piece * pieces  # every piece of every kind has a buffer
    assert buffers * _largest(shards, target) <= 4 * total  # within DeepSpeed's bytes


def test_a_streamed_cut_stops_at_the_least_request_the_disk_keeps_its_pace_with():
    """The 134M GPT through 96 MB (12 x 2e6), as bench_streaming.py's stream-96m: the state
    mostly streams, so it is cut for STREAM_DEPTH pieces in flight, but never into pieces whose
    master is smaller than the disk's least request at its pace (`aio.min_request`), nor larger
    than the sub-group allows."""
    per_piece = 3
    free = choose_pieces(GPT_134M, 2_000_000, 12, per_piece)[0]  # nothing measured: down to 1 MiB
    assert sizing.streamed_floor(None) == sizing.MIN_STREAMED_PIECE <= _largest(GPT_134M, free) < 1 * M
    whole = _largest(GPT_134M, 2_000_000)  # the sub-group's cut: the largest piece the knobs allow
    for request in (4 << 20, 8 << 20):  # a disk slow below 4 or 8 MiB requests
        floor = sizing.streamed_floor(request)
        assert floor == request // 4
        target, buffers = choose_pieces(GPT_134M, 2_000_000, 12, per_piece, min_streamed=floor)
        assert _largest(GPT_134M, target) >= min(floor, whole) > _largest(GPT_134M, free)
        assert buffers * _largest(GPT_134M, target) <= 12 * whole  # the same bytes
    assert sizing.streamed_floor(1000) == sizing.PIECE_ALIGN  # whole aligned pieces, however small


def _nvme_config(path, **zero) -> dict:
    cfg = config(3, "nvme", "nvme", clip=1.0, lr=3e-3, **zero)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=str(path), buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=str(path), buffer_count=4)
    return cfg


def test_the_engine_cuts_the_budget_and_computes_the_same_numbers(tmp_path, monkeypatch):
    """A small model with pieces allowed down to 1024 elements: DeepSpeed-style knobs (4
    buffers, sub_group_size 1e8) give a pool of many small pieces within DeepSpeed's bytes,
    and the masters and moments after three steps are those of the engine with one piece a unit,
    bit for bit."""
    torch.manual_seed(0)
    model = TinyGPT(layers=2, d=64)
    data = batches(3, 4)
    results = {}
    for depth in (1, PIPELINE_DEPTH):
        monkeypatch.setattr(sizing, "MIN_PIECE", 1024)
        monkeypatch.setattr(sizing, "PIPELINE_DEPTH", depth)
        path = tmp_path / f"depth{depth}"
        path.mkdir()
        engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=_nvme_config(path, sub_group_size=1e8))
        tier = engine.optim_state
        chosen = engine.chosen["offload_optimizer"]
        trains = [u.train_shard_numel for u in engine.units if u.trainable]
        assert tier.pool.buffer_count == chosen["buffers"]
        least = 9 * -(-max(trains) // 1024) * 1024  # 3 pieces of each of 3 kinds: here more than the state
        assert tier.pool.buffer_count * tier.pool.buffer_size <= max(4 * min(int(1e8), sum(trains)), least) * 4
        results[depth] = (engine_run(engine, data, gas=1), tier.pool.buffer_count,
                          {u.index: {k: tier.read(u, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")} for u in engine.units if u.trainable})
        engine.close()
    (loss_a, buffers_a, state_a), (loss_b, buffers_b, state_b) = results[1], results[PIPELINE_DEPTH]
    assert buffers_b > 3 * buffers_a  # many more pieces in flight
    assert loss_a == loss_b
    for index, kinds in state_a.items():
        for kind, value in kinds.items():
            assert torch.equal(value, state_b[index][kind]), (index, kind)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
@pytest.mark.parametrize("clip", [1.0, 0.0])  # updates in the next forward, and inside backward
def test_a_pool_short_of_the_state_holds_most_of_it_and_reads_only_the_rest(tmp_path, monkeypatch, clip):
    """DeepSpeed-style knobs whose bytes are a little short of the optimizer state (the issue's
    134M GPT: 4 x 1e8 against 403M elements) read all of it every step when the pool keeps the
    pieces it wrote last: each read takes the buffer of the piece needed soonest. Held pieces
    stay, and a step reads from the disk (psync: /proc/self/io counts it) only those streamed;
    the numbers are those of a pool that holds everything, bit for bit."""
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):
        monkeypatch.setattr(sizing, name, 1024)
    torch.manual_seed(0)
    model = TinyGPT(layers=4, d=64)
    data = batches(4, 4)
    runs = {}
    for case, count in (("short", None), ("roomy", 10_000)):
        path = tmp_path / case
        path.mkdir()
        cfg = config(3, "cpu", "nvme", clip=clip, lr=3e-3)
        cfg["zero_optimization"].update(sub_group_size=8192)
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(path), buffer_count=count or 4)
        cfg["aio"] = {"engine": "psync"}
        if count is None:  # buffers for 85% of the state
            probe, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
            trains = [u.train_shard_numel for u in probe.units if u.trainable]
            probe.close()
            state, asked = 3 * sum(trains), _largest(trains, 8192)  # DeepSpeed's buffers: of a sub-group each
            cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = int(0.85 * state) // asked
        engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
        engine_run(engine, data[:2], gas=1)  # the first step reads everything and records the order
        before = _read_bytes()
        losses = engine_run(engine, data[2:], gas=1)
        engine.optim_state.flush()
        read = (_read_bytes() - before) / 2
        chosen = engine.chosen["offload_optimizer"]
        tier = engine.optim_state
        runs[case] = (losses, read, chosen, {u.index: {k: tier.read(u, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}
                                             for u in engine.units if u.trainable})
        engine.close()
    (losses, read, chosen, state_short), (roomy_losses, roomy_read, roomy_chosen, state_roomy) = runs["short"], runs["roomy"]
    state_bytes = 4 * state
    assert chosen["pool_bytes"] <= 0.86 * state_bytes
    assert roomy_chosen["pieces_held"] == roomy_chosen["pieces"] and roomy_read == 0
    assert chosen["pieces_held"] >= 0.6 * chosen["pieces"]
    # Read a step: the streamed pieces, no more; before, the whole state.
    assert 0 < read <= 0.45 * state_bytes
    assert losses == roomy_losses
    for index, kinds in state_roomy.items():
        for kind, value in kinds.items():
            assert torch.equal(value, state_short[index][kind]), (index, kind)


def test_held_pieces_are_written_back_before_the_pool_lets_go_of_them(tmp_path):
    """A pool that holds the whole state keeps each piece's newest bytes in memory only
    ([Note: the pool is a budget]); replacing the fp32 weights (safe_set_full_fp32_param, as
    DeepSpeed's) writes the master and must keep the moments the steps made, which then exist
    nowhere but in the pool. After more steps the numbers are those of a pool that writes every
    piece each step."""
    from infinity.deepspeed.utils.full_values import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

    torch.manual_seed(0)
    model = TinyGPT(layers=2, d=64)
    data = batches(4, 4)
    results = {}
    for case, count in (("held", 10_000), ("streamed", 4)):
        path = tmp_path / case
        path.mkdir()
        cfg = _nvme_config(path)
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = count
        engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
        chosen = engine.chosen["offload_optimizer"]
        assert (chosen["pieces_held"] == chosen["pieces"]) == (case == "held")
        engine_run(engine, data[:2], gas=1)
        weight = engine.module.blocks[1].fc1.weight
        moments = {kind: safe_get_full_optimizer_state(weight, kind).clone() for kind in ("exp_avg", "exp_avg_sq")}
        assert moments["exp_avg"].abs().sum() > 0
        safe_set_full_fp32_param(weight, safe_get_full_fp32_param(weight) * 0.5)
        for kind, value in moments.items():
            assert torch.equal(safe_get_full_optimizer_state(weight, kind), value), (case, kind)
        losses = engine_run(engine, data[2:], gas=1)
        results[case] = (losses, engine.consolidated_state_dict())
        engine.close()
    (held_losses, held_state), (losses, state) = results["held"], results["streamed"]
    assert held_losses == losses
    for name, value in state.items():
        assert torch.equal(held_state[name], value), name


def test_reads_issued_out_of_update_order_never_starve_an_update(tmp_path, monkeypatch):
    """[Note: reads in update order]: the first step reads state ahead in the order construction
    guesses (the tied embedding's tiles, last in module order, last), while its updates at the next
    forward take the tiles first (the forward's order). The pool, of many small pieces, some held,
    then filled with the blocks' reads and the tiles' update waited for a buffer that no update
    before it would give back: a TimeoutError at the first step's updates. Now the reads out of
    order go back, an update keeps a held piece only with room beside it, and the numbers are
    those of the roomy pool's."""
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):
        monkeypatch.setattr(sizing, name, 1024)
    torch.manual_seed(0)
    model = TinyGPT(layers=4, d=64, vocab=4096)
    data = batches(3, 4)
    states = {}
    for case, count in (("tight", 90), ("roomy", 10_000)):
        path = tmp_path / case
        path.mkdir()
        cfg = config(3, "cpu", "nvme", clip=1.0, tile_size=131072, sub_group_size=4096)
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8}  # given, so no measured floor overrides the ones above
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(path), buffer_count=count)
        engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
        tier = engine.optim_state
        tier.swapper.timeout = 5.0  # a starved update fails fast
        assert any(u.name.startswith("emb.tiles") for u in engine.units)
        losses = engine_run(engine, data, gas=1)
        states[case] = (losses, {u.index: {k: tier.read(u, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}
                                 for u in engine.units if u.trainable})
        if case == "tight":
            assert 0 < engine.chosen["offload_optimizer"]["pieces_held"] < engine.chosen["offload_optimizer"]["pieces"]
        engine.close()
    assert states["tight"][0] == states["roomy"][0]
    for index, kinds in states["roomy"][1].items():
        for kind, value in kinds.items():
            assert torch.equal(value, states["tight"][1][index][kind]), (index, kind)


def test_updates_in_backward_keep_room_for_two_units_streamed_pieces():
    """[Note: the pool is a budget]: a unit's update in backward keeps its buffers until its writes
    drain behind the next unit's backward, while that unit's pieces are read ahead; the pool
    leaves room for both units' streamed pieces, and holds fewer. The 3B preset's cut at 12
    layers: 637 pieces, 38 a layer, 324 buffers of 3 kinds."""
    pieces, buffers, per_piece, unit = 637, 324, 3, 38
    one = sizing.held_pieces(pieces, buffers, per_piece, unit, streaming=sizing.units_streaming(in_backward=False))
    two = sizing.held_pieces(pieces, buffers, per_piece, unit, streaming=sizing.units_streaming(in_backward=True))
    assert one == 68 and 0 < two < one
    for held, units in ((one, 1), (two, 2)):  # the buffers the held pieces leave cover the streaming units
        room = buffers - 3 * held
        assert room >= per_piece * (sizing.STREAM_PIECES + units * unit * (pieces - held) / pieces)
        assert room - 3 < per_piece * (sizing.STREAM_PIECES + units * unit * (pieces - held - 1) / pieces)
    # A pool that holds the whole state holds it in either mode.
    assert sizing.held_pieces(40, 3 * 40 + 3 * sizing.CACHED_SPARE, per_piece, 4, streaming=2) == 40


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_the_engine_streams_more_of_the_state_when_updates_run_in_backward(tmp_path, monkeypatch):
    """The same model and budget, clipped (updates wait for the next forward) and unclipped
    (updates in backward): unclipped, the tier holds fewer pieces and a step reads more from the
    disk (psync: /proc/self/io counts it): what the room for a second unit costs."""
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):
        monkeypatch.setattr(sizing, name, 8192)
    torch.manual_seed(0)
    model = TinyGPT(layers=4, d=64)  # 25 pieces of 9216 elements, 6 a layer
    data = batches(4, 4)
    runs = {}
    for clip in (1.0, 0.0):
        path = tmp_path / f"clip{clip}"
        path.mkdir()
        cfg = config(3, "cpu", "nvme", clip=clip, lr=3e-3)
        cfg["zero_optimization"].update(sub_group_size=8192)
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(path), buffer_count=64)
        cfg["aio"] = {"engine": "psync"}
        engine, *_ = infinity.initialize(model=copy.deepcopy(model), config=cfg)
        engine_run(engine, data[:2], gas=1)
        before = _read_bytes()
        engine_run(engine, data[2:], gas=1)
        engine.optim_state.flush()
        state = 3 * 4 * sum(u.train_shard_numel for u in engine.units if u.trainable)
        runs[clip] = (engine.chosen["offload_optimizer"], (_read_bytes() - before) / 2 / state)
        engine.close()
    (clipped, clipped_read), (unclipped, unclipped_read) = runs[1.0], runs[0.0]
    assert clipped["pieces"] == unclipped["pieces"] and clipped["buffers"] == unclipped["buffers"]
    assert 0 < unclipped["pieces_held"] < clipped["pieces_held"] < clipped["pieces"]
    assert unclipped_read > clipped_read
    for chosen, read in ((clipped, clipped_read), (unclipped, unclipped_read)):  # the streamed share, read
        assert abs(read - (chosen["pieces"] - chosen["pieces_held"]) / chosen["pieces"]) < 0.1, (chosen, read)


def _compute(seconds: float) -> None:
    """A unit's op: `seconds`, and then as long as the disk still works on what it was given (at
    most 5 s more), so that a busy host's slow disk does not end the op before its transfers."""
    time.sleep(seconds)
    deadline = time.monotonic() + 5.0
    while not all(handle.settled() for handle in _SlowWrites.made) and time.monotonic() < deadline:
        time.sleep(0.002)


class _Pause(torch.autograd.Function):
    """Identity that takes `seconds` in forward and in backward: a unit's compute, long enough
    for the disk to finish what it was given."""

    @staticmethod
    def forward(ctx, x, seconds):
        _compute(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _compute(ctx.seconds)
        return g, None


class _PausedBlock(nn.Module):
    def __init__(self, d: int, seconds: float):
        super().__init__()
        self.a, self.b, self.seconds = nn.Linear(d, d), nn.Linear(d, d), seconds

    def forward(self, x):
        x = _Pause.apply(self.a(x), self.seconds)
        return _Pause.apply(self.b(torch.relu(x)), self.seconds)


class _PausedNet(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, seconds: float = 0.04):
        super().__init__()
        self.blocks = nn.ModuleList(_PausedBlock(d, seconds) for _ in range(layers))
        self.out = nn.Linear(d, d)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((self.out(x) - y) ** 2).mean()


class _SlowWrites:
    """A real I/O handle whose writes finish `seconds` after they are issued, not sooner: a disk
    slower than one unit's update, as the state's disk is for a model's units."""

    made: list = []  # every handle made (a test resets it): `_compute` waits for their requests

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self._issued, self._times = inner, seconds, {}, []
        self._outstanding: set[int] = set()  # submitted, not waited for
        _SlowWrites.made.append(self)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit_read(self, buffer, path, offset=0):
        rid = self.inner.submit_read(buffer, path, offset)
        self._outstanding.add(rid)
        return rid

    def submit_write(self, buffer, path, offset=0):
        rid = self.inner.submit_write(buffer, path, offset)
        self._issued[rid] = now = time.monotonic()
        self._times.append(now)
        self._outstanding.add(rid)
        return rid

    def settled(self) -> bool:
        """Whether every request submitted has finished (a write: its `seconds` passed too)."""
        return all(self.done(request) for request in list(self._outstanding))

    def finished_count(self):
        """Moves whenever `done` may have turned True (the swapper's reap asks this first): a
        write's `seconds` passing, or the inner handle finishing a request."""
        now = time.monotonic()
        return self.inner.finished_count() + sum(t + self.seconds <= now for t in self._times)

    def _left(self, request) -> float:
        return self._issued.get(request, -1e9) + self.seconds - time.monotonic()

    def done(self, request):
        return self._left(request) <= 0 and self.inner.done(request)

    def wait(self, request=None):
        if request is not None:
            time.sleep(max(0.0, self._left(request)))
            self._issued.pop(request, None)
            self._outstanding.discard(request)
        else:
            self._outstanding.clear()
        return self.inner.wait(request)


def _update_events(engine, monkeypatch, data, *, at_next_use: bool) -> list[tuple[str, int, int]]:
    """Steps `engine` over `data`; returns the last step's ("ready", unit, bytes read so far) and
    ("updated", unit, bytes read so far), in order. A unit is ready when its update may start:
    when it is about to run (`at_next_use`: updates in the next forward, of the step before) or
    when its gradient is final (updates in backward)."""
    events = []
    tier, hooks = engine.optim_state, engine.hooks
    update, handed_on = tier.update, hooks.on_unit_grads

    def spy_update(unit, *args):
        if at_next_use:
            events.append(("ready", unit.index, _read_bytes()))
        update(unit, *args)
        events.append(("updated", unit.index, _read_bytes()))

    def spy_handed_on(unit):
        if not at_next_use:
            events.append(("ready", unit.index, _read_bytes()))
        handed_on(unit)

    monkeypatch.setattr(tier, "update", spy_update)
    monkeypatch.setattr(hooks, "on_unit_grads", spy_handed_on)
    for x, y in data:
        events.clear()
        engine.backward(engine(x, y))
        engine.step()
    return list(events)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
@pytest.mark.parametrize("clip", [1.0, 0.0])  # updates in the next forward, and inside backward
def test_a_units_state_is_read_while_the_unit_before_it_computes(tmp_path, monkeypatch, clip):
    """A pool of about one unit's pieces and writes slower than an update: the writes of one
    unit's update hold the buffers the next unit's reads need, and finish while the unit after
    it computes. Those reads are issued there ([Note: between a unit's ops] in
    infinity/zero/hooks.py), not when that unit's update comes: by then the disk has read most
    of its state (psync: /proc/self/io counts the bytes)."""
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):
        monkeypatch.setattr(sizing, name, 8192)
    make_handle = nvme.make_handle
    monkeypatch.setattr(nvme, "make_handle", lambda aio: _SlowWrites(make_handle(aio), 0.03))
    monkeypatch.setattr(_SlowWrites, "made", [])
    torch.manual_seed(0)
    d = 256
    model = _PausedNet(d, seconds=0.06)
    data = [(torch.randn(4, d), torch.randn(4, d)) for _ in range(3)]
    cfg = config(3, "cpu", "nvme", clip=clip, lr=3e-3)
    cfg["zero_optimization"].update(sub_group_size=8192)
    cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=60)
    cfg["aio"] = {"engine": "psync"}
    engine, *_ = infinity.initialize(model=model, config=cfg)
    assert engine.chosen["offload_optimizer"]["pieces_held"] == 0  # every piece streams
    blocks = {u.index: u for u in engine.units if u.trainable and u.name.startswith("blocks.")}
    last = _update_events(engine, monkeypatch, data, at_next_use=bool(clip))
    engine.close()
    # The state each block's update needs, read between the update before it and its own start.
    early = []
    for (what, _, before), (then, index, at) in zip(last, last[1:]):
        if what == "updated" and then == "ready" and index in blocks:
            early.append((index, (at - before) / (12 * blocks[index].train_shard_numel)))
    assert len(early) >= len(blocks) - 1, last
    # The first block's update may come right after the one before it (updates at the next use run
    # as the fetcher prefetches, a unit ahead): no compute between them, nothing read.
    assert sum(share > 0.5 for _, share in early) >= len(blocks) - 2, early


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_a_tied_tiles_state_is_read_while_the_tile_before_it_computes_its_product(tmp_path, monkeypatch):
    """The tail of an unclipped step: each tile of a tied embedding updates after its weight-gradient
    product. With tiles of half the pool ([Note: a tied weight's tiles] in sizing.py) and writes
    slower than an update, a tile's state is read inside the product of the tile before it (the
    hooks' `between` runs between its row blocks, each slowed to a matmul's length here), not
    when its own update comes (psync: /proc/self/io counts the bytes)."""
    from gpt import TinyGPT
    from infinity.zero import tiling
    for name in ("MIN_PIECE", "MIN_STREAMED_PIECE", "MIN_CACHED_PIECE"):
        monkeypatch.setattr(sizing, name, 1024)
    monkeypatch.setattr(sizing, "MIN_TIED_TILE", 1024)
    monkeypatch.setattr(tiling, "_PRODUCT_BLOCK", 32 * 64)  # 32 rows of the 64-wide tile a block
    make_handle = nvme.make_handle
    monkeypatch.setattr(nvme, "make_handle", lambda aio: _SlowWrites(make_handle(aio), 0.03))
    monkeypatch.setattr(_SlowWrites, "made", [])
    torch.manual_seed(0)
    vocab, d = 1024, 64
    model = TinyGPT(layers=1, d=d, vocab=vocab)
    g = torch.Generator().manual_seed(1)
    data = [(idx, (idx * 7 + 3) % vocab) for idx in (torch.randint(0, vocab, (4, 8), generator=g) for _ in range(3))]
    cfg = config(3, "cpu", "nvme", clip=0.0, lr=3e-3)
    cfg["zero_optimization"].update(sub_group_size=2048)
    cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=24)
    cfg["aio"] = {"engine": "psync"}
    engine, *_ = infinity.initialize(model=model, config=cfg)
    assert engine.chosen["tied_tile_size"] == 24 * 2048 // 6
    tiles = {u.index: u for u in engine.units if u.trainable and u.name.startswith("emb.tiles.")}
    assert len(tiles) == 8
    for stash in tiling.tied_stashes([engine.module]):  # each row block of a product takes a matmul's time
        if stash.between is not None:
            stash.between = lambda poll=stash.between: (_compute(0.01), poll())
    last = _update_events(engine, monkeypatch, data, at_next_use=False)
    engine.close()
    early = [(index, (at - before) / (12 * tiles[index].train_shard_numel))
             for (what, prev, before), (then, index, at) in zip(last, last[1:])
             if what == "updated" and prev in tiles and then == "ready" and index in tiles]
    assert len(early) == len(tiles) - 1, last
    assert sum(share > 0.5 for _, share in early) >= len(tiles) - 2, early
