"""Automatic tiling ([Note: memory-centric tiling] in infinity/zero/tiling.py): a large Linear /
Embedding weight is stored, moved and computed as row tiles, trains as plain PyTorch does, keeps
its names, and host memory no longer grows with the vocabulary."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from gpt import TinyGPT, batches, config, engine_run, reference_run
from infinity.zero.tiling import EmbeddingTile, TiledEmbedding, TiledLinear, merge_tiles, tile_model

TILE = 1100  # elements: the 64 x 32 embedding becomes 2 tiles, each block's fc1 and fc2 (128 x 32) 4 each


def _untied(model: TinyGPT) -> TinyGPT:
    model = copy.deepcopy(model)
    model.head.weight = nn.Parameter(model.emb.weight.detach() * 0.5)
    return model


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    tied = TinyGPT()
    return {"tied": tied, "untied": _untied(tied)}


# ---- the modules on their own (plain PyTorch, no engine) ---------------------------------------


class TwoEnds(nn.Module):
    def __init__(self, vocab=50, dim=8, tied=True, bias=False, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=bias)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@pytest.mark.parametrize("tied,bias,padding_idx", [(True, False, None), (False, True, 7), (True, True, 3)])
def test_tiled_modules_compute_what_the_originals_compute(tied, bias, padding_idx):
    torch.manual_seed(0)
    ref = TwoEnds(tied=tied, bias=bias, padding_idx=padding_idx)
    tiled = copy.deepcopy(ref)
    done = tile_model(tiled, 64)  # 50 x 8 = 400 elements: 6 tiles of 8 rows and one of 2 (mid untouched)
    assert isinstance(tiled.emb, TiledEmbedding) and isinstance(tiled.head, TiledLinear)
    assert len(done) == (1 if tied else 2) and type(tiled.mid) is nn.Linear
    assert (tiled.emb.tiles is tiled.head.tiles) == tied
    ids = torch.tensor([[0, 7, 49, 3, 3], [12, 7, 48, 1, 25]])
    y_ref, y = ref(ids), tiled(ids)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    # A tile whose rows no lookup used has no gradient, as a unit the engine reduces as zeros.
    ours = merge_tiles(tiled, {n: torch.zeros_like(p) if p.grad is None else p.grad
                               for n, p in tiled.named_parameters()})
    assert sorted(ours) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-5, msg=name)  # the input-gradient sum reordered
    # The user's names and shapes, both ways.
    state = tiled.state_dict()
    assert list(state) == list(ref.state_dict()) or sorted(state) == sorted(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k
    fresh = copy.deepcopy(tiled)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), tiled.state_dict().values()))
    assert tiled.emb.weight.shape == ref.emb.weight.shape and torch.equal(tiled.head.weight, ref.head.weight)


def test_out_of_range_ids_are_refused_as_embedding_refuses_them():
    model = TwoEnds(tied=False)
    tile_model(model, 64)
    with pytest.raises(IndexError, match="out of range"):
        model.emb(torch.tensor([50]))


def test_a_lookup_calls_only_the_tiles_whose_rows_it_needs():
    model = TwoEnds(tied=False)
    tile_model(model, 64)
    called = []
    for i, t in enumerate(model.emb.tiles):
        t.register_forward_pre_hook(lambda m, args, i=i: called.append(i))
    model.emb(torch.tensor([[1, 2], [17, 49]]))  # rows of tiles 0, 2 and 6 (of 8 rows each)
    assert called == [0, 2, 6]


# ---- in the engine ---------------------------------------------------------------------------


def _config(tmp_path, placement: str, tile_size: int) -> dict:
    cfg = config(3, "cpu", "cpu", tile_size=tile_size)
    if placement == "nvme":
        tmp_path.mkdir()
        z = cfg["zero_optimization"]
        z["offload_param"].update(device="nvme", nvme_path=str(tmp_path), max_in_cpu=0)
        z["offload_optimizer"].update(device="nvme", nvme_path=str(tmp_path), buffer_count=9)
        z["sub_group_size"] = 4096
    return cfg


@pytest.mark.parametrize("tie,placement", [("tied", "cpu"), ("untied", "cpu"), ("tied", "nvme"),
                                           pytest.param("untied", "nvme", marks=pytest.mark.slow)])
def test_tiled_training_matches_plain_pytorch_and_the_untiled_engine(tmp_path, models, tie, placement):
    """A few AdamW steps with clipping: the tiled engine's losses and weights (under their
    original names) match plain PyTorch's as the untiled engine's do. The gradients differ by
    fp32 rounding (a tile's product is a smaller matmul); AdamW divides by the root of the
    second moment, so where a gradient is near zero that rounding becomes a step of up to
    1e-4 here: the weights are compared at 1e-4 tiled, 1e-5 untiled."""
    model = models[tie]
    data = batches(3, 4)
    ref_losses, ref = reference_run(model, data, gas=1)
    runs = {}
    for tile_size in (TILE, 0):
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(tmp_path / str(tile_size), placement,
                                                                                tile_size))
        tiles = [u for u in engine.units if u.name.endswith(tuple(f"tiles.{i}" for i in range(20)))]
        assert bool(tiles) == (tile_size > 0)
        assert all(u.numel <= TILE for u in tiles)  # every tile a unit of at most the tile size
        losses = engine_run(engine, data, gas=1)
        runs[tile_size] = losses, engine.consolidated_state_dict()  # the tiles under their weight's name
        assert sorted(engine.module.state_dict()) == sorted(model.state_dict())  # the user's names
        engine.close()
    for tile_size, (losses, state) in runs.items():
        for x, y in zip(losses, ref_losses, strict=True):
            assert abs(x - y) <= 1e-5 * abs(y), tile_size
        assert sorted(state) == sorted(ref.state_dict())
        tol = 1e-4 if tile_size else 1e-5
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value.detach(), atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_tied_weight_is_cut_so_that_a_tile_holds_half_the_optimizer_pool(tmp_path, models, monkeypatch, clip):
    """[Note: a tied weight's tiles]: with the optimizer state on NVMe through a pool of 4 x 512
    fp32 elements, smaller than the tied 64 x 32 weight's Adam state, the tied weight is cut into
    tiles of at most a third of that budget (half the pool's bytes, three kinds of state), though
    it is under `tile_size`; a weight that is not tied (each block's fc1 and fc2) keeps
    `tile_size`; the engine says what it chose; and the run is plain PyTorch's."""
    from infinity.offload.optimizer import sizing
    monkeypatch.setattr(sizing, "MIN_TIED_TILE", 64)
    model = models["tied"]
    data = batches(3, 4)
    ref_losses, ref = reference_run(model, data, gas=1, clip=clip)
    cfg = config(3, "cpu", "nvme", clip=clip, tile_size=3000, sub_group_size=512)
    cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=4)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    assert engine.chosen["tied_tile_size"] == 4 * 512 // 6
    tied_rows = [u.numel // 32 for u in engine.units if u.name.startswith("emb.tiles.")]
    assert tied_rows == [10] * 6 + [4], tied_rows  # 341 elements a tile at most: 10 rows of 32
    linear = [u.numel for u in engine.units if ".fc1.tiles." in u.name or ".fc2.tiles." in u.name]
    assert linear and set(linear) == {2048}, linear  # each 4096-element weight in two tiles: tile_size's cut
    losses = engine_run(engine, data, gas=1)
    state = engine.consolidated_state_dict()
    engine.close()
    for x, y in zip(losses, ref_losses, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value.detach(), atol=1e-4, rtol=1e-4, msg=name)


def test_a_tied_tiles_weight_gradient_product_runs_in_row_blocks_with_the_same_values(monkeypatch):
    """The tied head's weight-gradient part (`_Stash._product`) calls the hooks' `between` after
    each block of rows ([Note: between a unit's ops] in infinity/zero/hooks.py) and gives the
    product of one matmul, bit for bit, in fp32 and bf16."""
    from infinity.zero import tiling
    monkeypatch.setattr(tiling, "_PRODUCT_BLOCK", 256 * 64)  # 256 rows of 64 columns a block
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(96, 3000, dtype=dtype)[:, 500:]  # tokens x the tile's rows, a column slice as the head's
        x = torch.randn(96, 64, dtype=dtype)
        stash = tiling._Stash(1)
        assert torch.equal(stash._product(g, x), g.t() @ x)  # no `between`: one matmul
        calls = []
        stash.between = lambda: calls.append(1)
        out = stash._product(g, x)
        assert torch.equal(out, g.t() @ x) and out.dtype == dtype
        assert len(calls) == -(-2500 // 256), len(calls)


@pytest.mark.parametrize("saved,loaded", [(1100, 500), (500, 1100)])
def test_a_checkpoint_loads_into_an_engine_that_tiles_otherwise(tmp_path, models, saved, loaded):
    """[Note: a weight tiled otherwise] in infinity/checkpoint/load.py: a checkpoint saved with
    one cut of the tiled weights (the tied embedding, each block's fc1 and fc2) loads into an
    engine that cuts them otherwise (another tile_size here; for a tied weight, another optimizer
    pool too), masters and moments: its next steps are those of the engine that saved it."""
    model = models["tied"]
    data = batches(4, 4)
    a, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu", tile_size=saved))
    engine_run(a, data[:2], gas=1)
    a.save_checkpoint(str(tmp_path))
    ref_losses = engine_run(a, data[2:], gas=1)
    ref = a.consolidated_state_dict()
    cut = sorted(u.name for u in a.units)
    a.close()
    b, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu", tile_size=loaded))
    assert sorted(u.name for u in b.units) != cut
    b.load_checkpoint(str(tmp_path))
    losses = engine_run(b, data[2:], gas=1)
    state = b.consolidated_state_dict()
    b.close()
    for x, y in zip(losses, ref_losses, strict=True):  # moments lost would move these by far more
        assert abs(x - y) <= 1e-5 * abs(y)
    assert sorted(state) == sorted(ref)
    for name, value in ref.items():  # the tiles' products round otherwise: 1e-4, as above
        torch.testing.assert_close(state[name], value, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_exports_of_a_tiled_model_name_and_hold_the_users_weights(tmp_path, models, tie):
    """save_16bit_model, consolidate (from the checkpoint alone) and the 16-bit state dict that
    Hugging Face's Trainer saves: the same names as the untiled engine's export (a tied weight
    once), loadable into the plain model, with the values plain PyTorch trained."""
    from safetensors.torch import load_file

    from infinity.checkpoint.export import consolidate
    model = models[tie]
    data = batches(2, 4)
    _, ref = reference_run(model, data, gas=1)
    exports = {}
    for tile_size in (TILE, 0):
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu", tile_size=tile_size))
        engine_run(engine, data, gas=1)
        out = tmp_path / str(tile_size)
        engine.save_16bit_model(str(out / "live"))
        engine.save_checkpoint(str(out / "ckpt"))
        consolidate(str(out / "ckpt"), str(out / "offline"))
        exports[tile_size] = {"live": load_file(str(out / "live" / "model.safetensors")),
                              "offline": load_file(str(out / "offline" / "model.safetensors")),
                              "state_dict": engine._zero3_consolidated_16bit_state_dict()}
        engine.close()
    for kind, tensors in exports[TILE].items():
        assert sorted(tensors) == sorted(exports[0][kind]), kind
        plain = copy.deepcopy(model)
        missing, unexpected = plain.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= ({"head.weight"} if tie == "tied" else set()), (kind, missing)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[name], value, atol=1e-4, rtol=1e-4, msg=f"{kind} {name}")


def test_a_weight_streamed_in_row_blocks_is_written_whole_and_a_wrong_block_is_refused(tmp_path):
    from safetensors.torch import load_file

    from infinity.checkpoint.safetensors_io import StreamWriter
    w, b = torch.randn(10, 3), torch.randn(4)
    writer = StreamWriter(str(tmp_path / "a.safetensors"), [("w", torch.float32, [10, 3]), ("b", torch.float32, [4])])
    assert [writer.add("w", w[:4]), writer.add("w", w[4:9]), writer.add("w", w[9:]), writer.add("b", b)] == \
        [False, False, True, True]
    writer.close()
    back = load_file(str(tmp_path / "a.safetensors"))
    assert torch.equal(back["w"], w) and torch.equal(back["b"], b)
    writer = StreamWriter(str(tmp_path / "b.safetensors"), [("w", torch.float32, [10, 3]), ("b", torch.float32, [4])])
    writer.add("w", w[:6])
    for name, part in (("w", w[:5]), ("b", b), ("w", torch.randn(4, 2))):  # past the end, too early, wrong width
        with pytest.raises(ValueError, match="expected w .* from row 6"):
            writer.add(name, part)
    writer.abort()


def test_tile_size_is_checked_by_name():
    with pytest.raises(ValueError, match="zero_optimization.tile_size"):
        infinity.initialize(TinyGPT(), config=config(3, tile_size=-1))


def test_the_tied_embedding_is_tiled_once_and_its_tiles_shared(models):
    engine, *_ = infinity.initialize(copy.deepcopy(models["tied"]), config=config(3, tile_size=TILE))
    m = engine.module
    assert m.emb.tiles is m.head.tiles and all(isinstance(t, EmbeddingTile) for t in m.emb.tiles)
    names = [s.name for u in engine.units for s in u.slots]
    assert len(names) == len(set(names)) and "emb.tiles.0.weight" in names
    engine.close()


# ---- memory ------------------------------------------------------------------------------------

_CHILD = r"""
import json, sys, torch, torch.nn.functional as F
from torch import nn
import infinity

vocab, dim, tile = (int(a) for a in sys.argv[1:4])
path = sys.argv[4]
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())
with infinity.Init():  # built unit by unit: no whole copy of the model at any time
    model = M()
nvme = {"device": "nvme", "nvme_path": path}
budget = 2 * max(tile, 4 * dim * dim)  # two units live, two read ahead
cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "aio": {"block_size": 1048576},
       "zero_optimization": {"stage": 3, "tile_size": tile, "stage3_param_persistence_threshold": 0,
                             "stage3_prefetch_bucket_size": budget, "stage3_max_live_parameters": budget,
                             "stage3_max_reuse_distance": 0, "sub_group_size": tile or 10**9,
                             "offload_param": dict(nvme, max_in_cpu=0, buffer_count=4, buffer_size=tile or 10**8),
                             "offload_optimizer": dict(nvme, max_grad_in_cpu=0, buffer_count=9)}}
engine, *_ = infinity.initialize(model, config=cfg)
ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
for _ in range(2):  # the second step runs the first one's updates before each unit's use
    loss = engine(ids)
    engine.backward(loss)
    engine.step()
engine.close()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so after other tests made the
# pytest process large every child reported its peak (the same number for every case).
with open("/proc/self/status") as f:
    print(json.dumps({"peak_rss": next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))}))
"""


def _peak_rss(tmp_path, vocab: int, dim: int, tile: int) -> int:
    nvme = tmp_path / f"nvme-{vocab}-{tile}"
    nvme.mkdir()
    # Real tiles (tens of MiB) are above glibc's largest dynamic mmap threshold (32 MiB), so each is
    # its own mapping, returned to the system when freed. The small tiles of this test are not; a
    # fixed threshold makes them behave as the real ones instead of measuring the heap's leftovers.
    # The CPU device, which users without a GPU run: the async test device keeps its late copies
    # and scribbled buffers alive on its own thread (60 MB more at 34 units than at 6, measured),
    # which is the test device's memory, not the engine's.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore", "INFINITY_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(vocab), str(dim), str(tile), str(nvme)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]


def _activation_bound(tokens: int, extra_vocab: int) -> int:
    # What still grows with the vocabulary: the logits and their gradient (fp32), the softmax
    # inside cross_entropy and the tiles' outputs before they are concatenated; 6 copies of
    # tokens x vocabulary, plus 8 MiB for what the allocator rounds.
    return 6 * tokens * extra_vocab * 4 + (8 << 20)


@pytest.mark.slow  # two engines in subprocesses: over a minute on this 2-core machine
def test_peak_rss_does_not_grow_with_the_vocabulary(tmp_path):
    """A tied 64k-token embedding and a 8k one, tiles of 128k elements, params and optimizer on
    NVMe: the peak RSS of two steps differs by the activations' growth only, while the embedding
    alone grew by 14 MiB in fp32 (untiled it would add several copies of that)."""
    small, big = (_peak_rss(tmp_path, v, 64, 1 << 17) for v in (8192, 65536))
    assert big - small <= _activation_bound(16, 65536 - 8192), (small, big)


@pytest.mark.slow
def test_peak_rss_with_a_256k_vocabulary_against_untiled(tmp_path):
    """128k vs 16k tokens of 128 dimensions: tiled, the difference is the activations'; untiled
    (tile_size 0), the pools and buffers sized by the embedding add more than a GiB."""
    tiled = [_peak_rss(tmp_path, v, 128, 1 << 19) for v in (16384, 131072)]
    untiled = [_peak_rss(tmp_path, v, 128, 0) for v in (16384, 131072)]
    assert tiled[1] - tiled[0] <= _activation_bound(16, 131072 - 16384), tiled
    assert untiled[1] - untiled[0] > 8 * (131072 - 16384) * 128 * 4 // 2, untiled  # half of 8 fp32 copies


class _BiasedMLP(nn.Module):
    """fc1 (64 x 32 with a bias) is tiled at tile_size 1000; `hf` gives it Hugging Face's
    `_init_weights(module)`, which knows nn.Linear and nothing of tiles."""

    def __init__(self, hf: bool):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)
        if hf:
            self._init_weights = self._hf_init

    def _hf_init(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.constant_(module.bias, 0.25)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).square().mean()


@pytest.mark.parametrize("hf", [True, False])
def test_the_bias_of_a_linear_tiled_under_init_is_initialised(hf):
    """A Linear with a bias, built under infinity.Init and tiled: its bias sits on the tiled
    module, which neither `_init_weights` (isinstance nn.Linear) nor `reset_parameters` knew, so
    `initialize` refused it as uninitialised (bench_gpu.py's GPT at dim 4096 hit it on a GPU)."""
    torch.manual_seed(0)
    with infinity.Init():
        model = _BiasedMLP(hf)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "tile_size": 1000}}
    engine, *_ = infinity.initialize(model, config=cfg)
    assert isinstance(engine.module.fc1, TiledLinear)
    state = engine.consolidated_state_dict()
    engine.close()
    bias = state["fc1.bias"]
    if hf:
        assert torch.equal(bias, torch.full((64,), 0.25))
    else:  # nn.Linear.reset_parameters: uniform in +-1/sqrt(fan_in)
        assert bias.abs().max() <= 32 ** -0.5 and bias.std() > 0.05
    assert state["fc1.weight"].isfinite().all() and state["fc1.weight"].std() > 0
