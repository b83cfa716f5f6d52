"""infinity.checkpoint through its protocol alone ([Note: the checkpoint protocol] in
infinity/checkpoint/protocol.py): a fake engine of plain tensors saves, loads, exports and
consolidates, and the package imports nothing of the engine."""

from __future__ import annotations

import ast
import contextlib
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from infinity.checkpoint.export import consolidate, save_16bit_model
from infinity.checkpoint.load import load_checkpoint
from infinity.checkpoint.protocol import Checkpointable, TrainingState
from infinity.checkpoint.save import save_checkpoint
from infinity.config import load_config
from infinity.zero.unit import Unit

KINDS = ("master", "exp_avg", "exp_avg_sq")
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "infinity" / "checkpoint"


class FakeEngine:
    """`Checkpointable` with one rank and its shards in dicts; what it was told is in `events`."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.bfloat16):
        gen = torch.Generator().manual_seed(seed)
        self.module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        self.module[2].bias.requires_grad_(False)  # a frozen parameter: values, no optimizer state
        self.module.register_buffer("scale", torch.rand(3, generator=gen))
        self.config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                   "bf16": {"enabled": dtype == torch.bfloat16},
                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                   "zero_optimization": {"stage": 3}})
        self.rank, self.world_size = 0, 1
        self.model_parallel = None
        self.units = [Unit(i, name, [(f"{name}.{n}", p, 0 if p.requires_grad else -1)
                                     for n, p in m.named_parameters()], dtype, torch.device("cpu"), 0, 1)
                      for i, (name, m) in enumerate(self.module.named_children())]
        # Random values where parameters are, zeros in the padding ([Note: flat layout] in zero/unit.py).
        self.optim = {(u.index, k): _padded(u, gen, train=True) for u in self.units for k in KINDS}
        self.shards = {u.index: _padded(u, gen, train=False).to(dtype) for u in self.units}
        self.state = TrainingState(7, 1, 42, 22, {"step_count": 6, "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]},
                                   {"last_epoch": 6}, None, None)
        self.events: list[str] = []

    def check_step_boundary(self, what: str, replaces_all: bool = False) -> None:
        self.events.append(f"check {what}")

    def mark_broken(self, why: str, *, until_load: bool = False) -> None:
        self.events.append("broken")

    def after_load(self) -> None:
        self.events.append("loaded")

    def training_state(self) -> TrainingState:
        return self.state

    def load_training_state(self, state: TrainingState) -> None:
        self.state = TrainingState(*(ours if theirs is None else theirs for ours, theirs in zip(self.state, state)))

    def flush_shards(self) -> None:
        self.events.append("flush")

    def optimizer_kinds(self) -> tuple[str, ...]:
        return KINDS

    def read_optimizer_shard(self, unit: Unit, kind: str) -> torch.Tensor:
        return self.optim[unit.index, kind]

    def read_param_shard(self, unit: Unit) -> torch.Tensor:
        return self.shards[unit.index].clone()

    def write_optimizer_shards(self, unit: Unit, values: dict[str, torch.Tensor]) -> None:
        for kind, v in values.items():
            self.optim[unit.index, kind] = v.clone()

    def write_param_shard(self, unit: Unit, shard: torch.Tensor) -> None:
        self.shards[unit.index] = shard.clone()

    @contextlib.contextmanager
    def replacing_shards(self):
        self.events.append("replacing")
        yield
        self.events.append("replaced")

    # One rank: a unit's full flat buffer is its shard ([Note: flat layout] in zero/unit.py).
    def full_compute_values(self, unit: Unit) -> torch.Tensor:
        return self.read_param_shard(unit)

    def full_fp32_values(self, unit: Unit) -> torch.Tensor:
        full = self.shards[unit.index].float()
        unit.split(full).train.copy_(self.optim[unit.index, "master"])
        return full

    def set_fp32_values(self, unit: Unit, full: torch.Tensor) -> None:
        self.optim[unit.index, "master"] = unit.split(full).train.clone()
        self.shards[unit.index] = full.to(unit.dtype)


def _padded(unit: Unit, gen: torch.Generator, train: bool) -> torch.Tensor:
    """Random values for a unit's slots, zeros in its padding: the trainable region's (`train`)
    or the whole shard's, with one rank."""
    out = torch.zeros(unit.train_shard_numel if train else unit.shard_numel)
    for s in unit.slots:
        if train and s.group < 0:
            continue
        out[s.offset:s.offset + s.numel] = torch.randn(s.numel, generator=gen)
    return out


def _values(engine: FakeEngine, full_of) -> dict[str, torch.Tensor]:
    return {s.name: u.param_values(full_of(u), s) for u in engine.units for s in u.slots}


def test_a_fake_engine_saves_and_loads_through_the_protocol(tmp_path):
    saver, loader = FakeEngine(seed=0), FakeEngine(seed=1)
    engine: Checkpointable = saver  # what the package is typed against
    saved = save_checkpoint(engine, tmp_path / "ckpt", client_state={"epoch": 3})
    assert saved["path"] == str(tmp_path / "ckpt" / "global_step7") and saved["bytes"] > 0
    assert saver.events == ["check save_checkpoint", "flush"]

    path, client = load_checkpoint(loader, tmp_path / "ckpt")
    assert path == saved["path"] and client == {"epoch": 3}
    assert loader.events == ["check load_checkpoint", "replacing", "flush", "replaced", "loaded"]
    for key, values in saver.optim.items():  # the real bytes, every kind of every unit
        assert torch.equal(loader.optim[key], values), key
    for u in saver.units:
        # The trainable part of the compute-dtype shard is the masters rounded, as an update
        # writes it; the frozen part is the saved shard's.
        expected = saver.shards[u.index].clone()
        u.split(expected).train.copy_(saver.optim[u.index, "master"])
        assert torch.equal(loader.shards[u.index], expected), u
    # The micro-step count restarts the accumulation under way (22 = 7 * 3 + 1).
    assert loader.state == saver.state._replace(micro_steps=21)
    assert torch.equal(loader.module.scale, saver.module.scale)


def test_a_load_without_optimizer_states_keeps_the_engines(tmp_path):
    saver, loader = FakeEngine(seed=0), FakeEngine(seed=1)
    save_checkpoint(saver, tmp_path / "ckpt")
    ours = loader.state
    moments = {k: v.clone() for k, v in loader.optim.items() if k[1] != "master"}
    load_checkpoint(loader, tmp_path / "ckpt", load_optimizer_states=False, load_lr_scheduler_states=False)
    assert loader.state.optimizer is ours.optimizer and loader.state.lr_scheduler is ours.lr_scheduler
    assert loader.state.global_steps == saver.state.global_steps
    for key, values in moments.items():
        assert torch.equal(loader.optim[key], values), key
    for u in saver.units:
        assert torch.equal(loader.optim[u.index, "master"], saver.optim[u.index, "master"])


def test_exports_of_a_fake_engine_hold_its_values(tmp_path):
    engine = FakeEngine(seed=2)
    save_checkpoint(engine, tmp_path / "ckpt")
    consolidate(tmp_path / "ckpt", tmp_path / "fp32")
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    for name, values in _values(engine, engine.full_fp32_values).items():
        assert torch.equal(fp32[name], values), name
    assert torch.equal(fp32["scale"], engine.module.scale)

    save_16bit_model(engine, tmp_path / "bf16")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    for name, values in _values(engine, engine.full_compute_values).items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], values), name


def test_the_engine_has_every_member_of_the_protocol():
    import infinity
    from gpt import TinyGPT, config

    members = [n for n in vars(Checkpointable) if not n.startswith("_")] + list(Checkpointable.__annotations__)
    engine, *_ = infinity.initialize(TinyGPT(layers=1), config=config(3, "none", "none"))
    try:
        assert [n for n in members if not hasattr(engine, n)] == []
        assert isinstance(engine.training_state(), TrainingState)
    finally:
        engine.close()


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_the_checkpoint_package_imports_nothing_of_the_engine(path):
    """Not even for type hints: it sees the engine through its protocol."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        assert not [n for n in names if f"{n}.".startswith("infinity.engine.")], node.lineno
