"""The engine-side surfaces that Hugging Face's Trainer, accelerate and TRL use through the
`deepspeed` alias, each checked against the real thing: the config values accelerate and the
seed configs write, the process group of one process, `engine.config.get`, the 16-bit state
dict against the module's own values, DeepSpeed's parameter attributes against the unit's
state, and `GatheredParameters(modifier_rank=0)` on parameters built under `Init` (Hugging
Face's ZeRO-3 `from_pretrained`) against plain PyTorch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import infinity
from infinity.config import load_config
from infinity.deepspeed.runtime.zero import partition_parameters
from infinity.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


@pytest.fixture(autouse=True)
def _no_group_left():
    """initialize creates the process group (of one) as DeepSpeed's does: it goes with the test."""
    had = dist.is_initialized()
    yield
    if dist.is_initialized() and not had:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, buffer: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        if buffer:  # (a buffer built under Init has nothing to initialise it)
            self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.norm(x)
        return self.head(x * self.scale if hasattr(self, "scale") else x)


def _config(stage=3, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "cpu"}, **zero}}


# ---- config values the frameworks write -------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [(float("inf"), None), (1e5, 100000), (2000, 2000), (None, None)])
def test_steps_per_print_as_accelerate_and_the_seed_configs_write_it(value, expected):
    # accelerate sets float("inf"); Hugging Face's example configs have 1e5 (a float in JSON)
    assert load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": value}).steps_per_print == expected


@pytest.mark.parametrize("value", [0, 1.5, float("-inf"), float("nan"), "1e5", True])
def test_steps_per_print_refuses_what_is_not_a_step_count(value):
    with pytest.raises((TypeError, ValueError), match="steps_per_print: expected an integer"):
        load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": value})


def test_config_answers_get_as_deepspeeds_dict():
    config = load_config(_config(stage=3))
    assert config.get("zero_optimization", {}).get("stage") == 3  # what the Trainer's save_model asks
    assert config.get("zero_optimization")["offload_optimizer"]["device"] == "cpu"
    assert config.get("train_batch_size") == 2 and config.get("gradient_clipping") == 1.0
    assert config.get("tensor_parallel", {}).get("autotp_size", 1) == 1  # what the Trainer asks for TP
    assert config.get("scheduler", "none") == "none" and config.get("optimizer")["type"] == "AdamW"


def test_auto_left_in_the_config_is_named():
    with pytest.raises(ValueError, match=r'zero_optimization.stage3_prefetch_bucket_size: "auto" must be resolved'):
        load_config({"train_micro_batch_size_per_gpu": 1,
                     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}})


# ---- the process group ----------------------------------------------------------------------------------------


def test_initialize_creates_a_group_of_one_process_as_deepspeed(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    engine, *_ = infinity.initialize(model=Net(), config=_config())
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    assert dist.get_backend() == "gloo"
    t = torch.arange(3.0)
    dist.broadcast(t, 0)  # what transformers does with the buffers under ZeRO-3
    dist.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0]
    engine.close()


# ---- 16-bit state dict -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_16bit_state_dict_is_the_modules_values(stage):
    torch.manual_seed(0)
    model = Net()
    model.head.bias.requires_grad_(False)  # frozen: kept unless excluded
    reference = copy.deepcopy(model)
    engine, *_ = infinity.initialize(model=model, config=_config(stage, stage3_gather_16bit_weights_on_model_save=True))
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    state = engine._zero3_consolidated_16bit_state_dict()
    expected = reference.state_dict()
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    no_frozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert set(state) - set(no_frozen) == {"head.bias"}
    engine.close()


def test_16bit_state_dict_keeps_tied_weights_under_both_names_and_the_trained_values():
    torch.manual_seed(0)
    model = Net()
    model.blocks[1][2].weight = model.blocks[0][2].weight  # tied
    reference = copy.deepcopy(model)
    engine, *_ = infinity.initialize(model=model, config=_config())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for i in range(2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    state = engine._zero3_consolidated_16bit_state_dict()
    assert state["blocks.0.2.weight"] is state["blocks.1.2.weight"]
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)
    assert engine.zero_gather_16bit_weights_on_model_save() is False  # DeepSpeed's default
    engine.close()


# ---- DeepSpeed's parameter attributes ------------------------------------------------------------------------------


def test_ds_attributes_follow_the_unit():
    model = Net()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine, *_ = infinity.initialize(model=model, config=_config())
    partition_parameters.mark_partitioned(engine.module)  # what deepspeed.initialize does
    weight = model.blocks[0][0].weight
    assert isinstance(weight, partition_parameters.PartitionedParameter) and isinstance(weight, nn.Parameter)
    assert weight.numel() == 0  # released: the values live in the unit's shard
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert weight.ds_numel == 8 * 16 and weight.ds_shape == torch.Size([16, 8])
    assert {name: p.ds_shape for name, p in model.named_parameters()} == shapes
    assert len({p.ds_id for p in model.parameters()}) == len(shapes)
    with infinity.GatheredParameters([weight]):
        assert weight.ds_status is ZeroParamStatus.AVAILABLE and weight.shape == (16, 8)
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    engine.close()


# ---- GatheredParameters(modifier_rank=0) on parameters built under Init -------------------------------------------


def test_values_written_under_init_are_what_initialize_builds():
    """Hugging Face's ZeRO-3 from_pretrained: each module's parameters gathered with
    modifier_rank=0, the checkpoint's values written inside, before initialize."""
    torch.manual_seed(0)
    reference = Net(buffer=False)
    with infinity.Init():
        model = Net(buffer=False)
    checkpoint = reference.state_dict()
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with infinity.GatheredParameters(params, modifier_rank=0):
            assert all(not p.is_meta for p in params)
            # one module at a time: the others stay on meta, holding no memory
            assert sum(not p.is_meta for p in model.parameters()) == len(params)
            prefix = f"{name}." if name else ""
            with torch.no_grad():
                for pname, p in module.named_parameters(recurse=False):
                    p.copy_(checkpoint[prefix + pname])
        assert all(p.is_meta for p in params)
    with infinity.GatheredParameters([model.head.weight]):  # no modifier: a change is not kept
        with torch.no_grad():
            model.head.weight.zero_()
    engine, *_ = infinity.initialize(model=model, config=_config())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    engine.close()


def test_init_runs_only_for_what_was_not_written():
    torch.manual_seed(0)
    with infinity.Init():
        model = Net(buffer=False)
    marker = torch.full((3, 8), 0.25)
    with infinity.GatheredParameters([model.head.weight], modifier_rank=0):
        with torch.no_grad():
            model.head.weight.copy_(marker)
        model.head.weight.flagged = True  # transformers marks `_is_hf_initialized` so
    assert model.head.weight.flagged  # a parameter keeps its attributes through the block
    engine, *_ = infinity.initialize(model=model, config=_config())
    with infinity.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.head.weight, marker)
        bias = model.head.bias.detach().clone()
        first = model.blocks[0][0].weight.detach().clone()
    assert torch.isfinite(bias).all() and 0 < bias.abs().max() <= 1 / math.sqrt(8)  # nn.Linear's own init
    assert first.abs().max() <= 1 / math.sqrt(8) and first.std() > 0
    engine.close()


def test_accelerate_unwraps_the_engine_as_deepspeeds_module():
    other = pytest.importorskip("accelerate.utils.other")
    model = Net()
    engine, *_ = infinity.initialize(model=model, config=_config())
    assert other.has_compiled_regions(engine) is False  # it reads the engine's _modules, as a Module's
    assert engine._modules == {"module": model} and list(engine.modules()) == list(model.modules())
    engine.close()


def test_the_engine_answers_as_the_module_deepspeeds_engine_is():
    """DeepSpeed's engine is an nn.Module: its tests and frameworks call named_parameters(),
    buffers(), named_modules() on it; `empty_partition_cache()` gives back gathered units."""
    import infinity
    from infinity.zero.unit import UnitState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = infinity.initialize(model=model, config=config)
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in engine.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert list(engine.buffers()) == list(model.buffers())
    assert [n for n, _ in engine.named_modules()] == [n for n, _ in model.named_modules()]
    assert list(engine.children()) == [model] and dict(engine.named_children()) == {"module": model}
    with infinity.GatheredParameters(list(model.parameters())):
        pass
    unit = next(u for u in engine.units if not u.persistent)
    engine.fetcher.acquire(unit)  # in use: stays
    engine.empty_partition_cache()
    assert unit.state is UnitState.GATHERED
    engine.fetcher.in_use.pop(unit.index)  # as one kept for its reuse or read ahead
    engine.empty_partition_cache()
    assert all(u.state is UnitState.RELEASED for u in engine.units if not u.persistent)
    assert all(p.numel() == 0 for p in model.parameters())
    engine.close()
