"""Lightning on infinity (infinity.integrations.lightning.strategy), each against plain Lightning on the same module
(strategy="auto", torch's checkpoint, CPU, fp32): the seed page's module trained with parameters
and optimizer state on NVMe, activation checkpointing on the host, accumulation and clipping;
Lightning checkpoints in infinity's format (`test(ckpt_path=)` in the same process, `fit(ckpt_path=)`
resuming, the single-file conversion); the registered names; precisions; `configure_model` under
`infinity.Init`; and Fabric."""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import infinity  # noqa: E402
from infinity import checkpointing
from infinity.offload import activations  # noqa: E402
from infinity.integrations.lightning.strategy import (InfinityFabricStrategy, InfinityPrecision, InfinityStrategy,  # noqa: E402
                                convert_zero_checkpoint_to_fp32_state_dict)

pytestmark = [
    # Lightning 2.6.6 on torch 2.13 (its own pytree helper), not ours
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Lightning's DDP set-up writes the launcher's variables into os.environ and leaves a gloo
    group behind; checkpointing's settings are process-wide: each test gets them back as they were."""
    env = dict(os.environ)
    level = logging.getLogger("infinity").level  # a strategy sets it (logging_level), as DeepSpeed's does
    monkeypatch.setattr(activations, "STATE", activations.ActivationState())
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("infinity").setLevel(level)


class SeedModel(pl.LightningModule):
    """Lightning's DeepSpeed page's example, its `deepspeed.checkpointing.checkpoint` being
    infinity's (or torch's, for plain Lightning)."""

    def __init__(self, ours: bool = True, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.block_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.block_2 = nn.Linear(32, 2)
        self.losses: list[float] = []

    def forward(self, x):
        if self.hparams.ours:
            x = checkpointing.checkpoint(self.block_1, x)
        else:
            x = torch_checkpoint.checkpoint(self.block_1, x, use_reentrant=False)
        return self.block_2(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 32, generator=g), torch.randint(0, 2, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(strategy, **kwargs) -> pl.Trainer:
    settings = dict(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=1.0,
                    use_distributed_sampler=False, enable_checkpointing=False, logger=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def _on_nvme(path, **kwargs) -> InfinityStrategy:
    os.makedirs(path, exist_ok=True)
    return InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True, remote_device="nvme",
                            offload_params_device="nvme", offload_optimizer_device="nvme", nvme_path=str(path),
                            optimizer_buffer_count=9, partition_activations=True, cpu_checkpointing=True, **kwargs)


def _fit(strategy, ours: bool, **kwargs) -> tuple[SeedModel, pl.Trainer]:
    torch.manual_seed(0)
    model = SeedModel(ours=ours)
    trainer = _trainer(strategy, **kwargs)
    trainer.fit(model, _data())
    return model, trainer


def _close(a, b, atol=1e-5) -> bool:
    return len(a) == len(b) and np.allclose(a, b, rtol=0, atol=atol)


# ---- training -----------------------------------------------------------------------------------


def test_seed_module_on_nvme_trains_as_plain_lightning(tmp_path):
    plain, plain_trainer = _fit("auto", ours=False)
    model, trainer = _fit(_on_nvme(tmp_path / "nvme"), ours=True)
    assert len(plain.losses) == 8 and _close(model.losses, plain.losses), (model.losses, plain.losses)
    assert trainer.global_step == plain_trainer.global_step == 4
    engine = trainer.strategy.engine
    assert engine.zero_optimization_stage() == 3 and engine.gradient_accumulation_steps() == 2
    assert engine.gradient_clipping() == 1.0
    store = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "nvme") for f in fs if f.endswith(".bin")]
    assert store and all(os.path.getsize(f) > 0 for f in store)  # the parameters and Adam state are there
    assert activations.STATE.config.cpu_checkpointing and activations.STATE.config.partition_activations
    got = engine.consolidated_state_dict()
    assert all((got[k] - v).abs().max() < 1e-4 for k, v in plain.state_dict().items())
    # the scheduler is Lightning's and reaches the engine's update: lr after 4 steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.8 ** 4)


class SGDModel(SeedModel):
    """The seed module with torch's SGD (momentum, Nesterov) in `configure_optimizers`."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("offload", [False, True])
def test_sgd_in_configure_optimizers_trains_as_plain_lightning(offload):
    """It was `TypeError: ... runs Adam or AdamW ..., got SGD` under every strategy; now SGD's own
    step runs over the shards, with its state in memory (on the device, or offloaded to the CPU)."""
    def fit(strategy, ours):
        torch.manual_seed(0)
        model = SGDModel(ours=ours)
        _trainer(strategy).fit(model, _data())
        return model

    plain = fit("auto", ours=False)
    model = fit(InfinityStrategy(stage=3, offload_optimizer=offload), ours=True)
    assert len(plain.losses) == 8 and _close(model.losses, plain.losses), (model.losses, plain.losses)
    got = model.trainer.strategy.engine.consolidated_state_dict()
    assert all((got[k] - v).abs().max() < 1e-5 for k, v in plain.state_dict().items())


@pytest.mark.parametrize(("name", "stage", "params", "optimizer"), [
    ("infinity", 2, "none", "none"),
    ("infinity_stage_2_offload", 2, "none", "cpu"),
    ("infinity_stage_3_offload", 3, "cpu", "cpu"),
])
def test_a_registered_name_trains(name, stage, params, optimizer):
    assert {"infinity", "infinity_stage_1", "infinity_stage_2", "infinity_stage_2_offload", "infinity_stage_3",
            "infinity_stage_3_offload", "infinity_stage_3_offload_nvme"} <= set(
        pl.strategies.StrategyRegistry.available_strategies())
    plain, _ = _fit("auto", ours=False)
    model, trainer = _fit(name, ours=True)
    assert isinstance(trainer.strategy, InfinityStrategy)
    zero = trainer.strategy.engine.config.zero
    assert (zero.stage, zero.offload_param.device, zero.offload_optimizer.device) == (stage, params, optimizer)
    assert _close(model.losses, plain.losses), (model.losses, plain.losses)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", pytest.param("16-mixed", marks=pytest.mark.filterwarnings(
    # the first steps overflow at 2^16 and are skipped (below), and Lightning steps the scheduler all the same, as
    # it does for DeepSpeed and for torch's GradScaler
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`:UserWarning"))])
def test_a_precision_is_the_engine_with_that_config(precision):
    """Trainer(precision=...) is the engine with the bf16/fp16 section Lightning's DeepSpeed writes:
    the same losses as infinity.initialize with that config, driven by hand."""
    plugin = {"precision_plugin": InfinityPrecision(precision)} if precision == "16-mixed" else {}
    flag = {} if plugin else {"precision": precision}
    model, trainer = _fit(InfinityStrategy(stage=3, **plugin), ours=True, gradient_clip_val=0.0, **flag)
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}[precision.split("-")[0]]
    assert trainer.strategy.engine.dtype == dtype
    torch.manual_seed(0)
    reference = SeedModel(ours=True)
    if precision.endswith("-true"):
        reference = reference.to(dtype)
    section = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                        "hysteresis": 2, "min_loss_scale": 1}} if dtype == torch.float16 else {"bf16": {"enabled": True}}
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    engine, *_ = infinity.initialize(model=reference, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3}, **section})
    losses = []
    for i, (x, y) in enumerate(_data()):
        loss = nn.functional.cross_entropy(engine(x.to(dtype)), y)
        losses.append(loss.item())
        # as Lightning does: its loop divides the loss by accumulate_grad_batches, the engine not again. In
        # fp16 the gradient 2^16 of that loss is inf, so the first two steps are skipped (hysteresis 2).
        engine.backward(loss / 2, scale_wrt_gas=False)
        engine.step()
        if i % 2 == 1:
            scheduler.step()
    assert model.losses == losses


def test_configure_model_builds_under_init_and_trains(tmp_path):
    built = {}

    class Deferred(SeedModel):
        def __init__(self):
            super().__init__()
            self.block_1 = self.block_2 = None

        def configure_model(self):
            if self.block_1 is not None:
                return
            self.block_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
            self.block_2 = nn.Linear(32, 2)
            built["meta"] = all(p.is_meta for p in self.parameters())

    torch.manual_seed(0)
    model = Deferred()
    trainer = _trainer(_on_nvme(tmp_path / "nvme"))
    trainer.fit(model, _data())
    assert built["meta"]  # infinity.Init: nothing allocated until the engine builds each unit
    assert len(model.losses) == 8 and all(np.isfinite(model.losses))
    values = trainer.strategy.engine.consolidated_state_dict()
    assert all(torch.isfinite(v).all() for v in values.values())


def test_a_config_file_is_the_engines_and_its_checkpointing_section_is_infinity_checkpointings(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                                "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                             "number_checkpoints": 2}}))
    plain, _ = _fit("auto", ours=False)
    model, trainer = _fit(InfinityStrategy(config=str(path)), ours=True)
    assert _close(model.losses, plain.losses)
    assert trainer.strategy.engine.config.zero.offload_param.device == "cpu"
    config = activations.STATE.config
    assert (config.partition_activations, config.cpu_checkpointing, config.number_checkpoints) == (True, True, 2)


def test_checkpointed_inputs_spilled_to_nvme_train_as_plain_lightning(tmp_path):
    """infinity's own activation_checkpointing.nvme_path: each checkpoint's input goes to a file and
    comes back for its recompute, and the losses and weights are plain Lightning's."""
    os.makedirs(tmp_path / "nvme")
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                          "buffer_count": 9}},
              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                           "nvme_path": str(tmp_path / "nvme"), "nvme_min_bytes": 0}}
    plain, _ = _fit("auto", ours=False)
    model, trainer = _fit(InfinityStrategy(config=config), ours=True)
    assert _close(model.losses, plain.losses), (model.losses, plain.losses)
    spilled = glob.glob(str(tmp_path / "nvme" / "infinity-*-activations" / "rank0" / "inputs*.bin"))
    assert spilled and all(os.path.getsize(f) >= 8 * 32 * 4 for f in spilled)  # a batch's 8 x 32 fp32 input
    got = trainer.strategy.engine.consolidated_state_dict()
    assert all((got[k] - v).abs().max() < 1e-4 for k, v in plain.state_dict().items())


def test_clipping_by_value_and_a_config_beside_its_arguments_are_refused():
    model = SeedModel()
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        _trainer(InfinityStrategy(stage=3), gradient_clip_algorithm="value").fit(model, _data())
    with pytest.raises(ValueError, match="offload_optimizer: given with config="):
        InfinityStrategy(config={"zero_optimization": {"stage": 3}}, offload_optimizer=True)
    with pytest.raises(TypeError, match="offload_optimiser: not an argument"):
        InfinityStrategy(offload_optimiser=True)


def test_a_device_mismatch_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cuda")
    with pytest.raises(ValueError, match="device: the CPU was asked for, but INFINITY_DEVICE=cuda; unset"):
        _trainer(InfinityStrategy(stage=3)).fit(SeedModel(), _data())


def test_the_engine_computes_on_the_device_lightning_chose(monkeypatch):
    """accelerator="cpu" on a machine with a GPU: the engine takes Lightning's root device rather
    than CUDA's presence (no INFINITY_DEVICE needed)."""
    monkeypatch.delenv("INFINITY_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, trainer = _fit(InfinityStrategy(stage=3), ours=True)
    assert trainer.strategy.engine.accelerator.name == "cpu" and trainer.strategy.root_device.type == "cpu"
    assert activations.STATE.device is trainer.strategy.engine.accelerator
    assert len(model.losses) == 8


def test_without_lightning_the_import_names_the_extra(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['lightning'] = None; import infinity.integrations.lightning.strategy"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # not the checkout: see below
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: infinity.integrations.lightning.strategy needs Lightning: pip install \"infinity[lightning]\"")


# ---- checkpoints --------------------------------------------------------------------------------


def _fit_two_epochs_saving_each(strategy, ours: bool, dirpath) -> tuple[SeedModel, pl.Trainer, pl.Callback]:
    torch.manual_seed(0)
    model = SeedModel(ours=ours)
    saver = pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(strategy, max_epochs=2, enable_checkpointing=True, callbacks=[saver])
    trainer.fit(model, _data())
    return model, trainer, saver


def test_model_checkpoint_then_test_with_ckpt_path_in_the_same_process(tmp_path):
    first = "epoch=0-step=4.ckpt"
    _, plain_trainer, _ = _fit_two_epochs_saving_each("auto", False, tmp_path / "plain")
    plain_result = plain_trainer.test(ckpt_path=str(tmp_path / "plain" / first), dataloaders=_data(), verbose=False)
    plain_predictions = plain_trainer.predict(ckpt_path=str(tmp_path / "plain" / first), dataloaders=_data(16))
    model, trainer, _ = _fit_two_epochs_saving_each(_on_nvme(tmp_path / "nvme"), True, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == [first, "epoch=1-step=8.ckpt"]
    assert sorted(os.listdir(tmp_path / "ours" / first)) == ["checkpoint", "latest"]  # infinity's layout
    result = trainer.test(ckpt_path=str(tmp_path / "ours" / first), dataloaders=_data(), verbose=False)
    assert result[0]["test_loss"] == pytest.approx(plain_result[0]["test_loss"], abs=1e-5)
    predictions = trainer.predict(model, dataloaders=_data(16))  # the engine of fit, with the epoch-0 weights
    assert torch.allclose(torch.cat(predictions), torch.cat(plain_predictions), atol=1e-5)


def test_test_with_ckpt_path_on_a_new_model_beside_the_fitted_one(tmp_path):
    """A second engine of the process on the same nvme_path ([Note: stores of one process] in
    infinity/offload/store.py), while the fitted model's engine still holds its files there."""
    _, plain_trainer, plain_saver = _fit_two_epochs_saving_each("auto", False, tmp_path / "plain")
    expected = plain_trainer.test(SeedModel(ours=False), ckpt_path=plain_saver.best_model_path, dataloaders=_data(),
                                  verbose=False)
    model, trainer, saver = _fit_two_epochs_saving_each(_on_nvme(tmp_path / "nvme"), True, tmp_path / "ours")
    fitted = trainer.strategy.engine
    before = fitted.consolidated_state_dict()
    result = trainer.test(SeedModel(), ckpt_path=saver.best_model_path, dataloaders=_data(), verbose=False)
    assert trainer.strategy.engine is not fitted and trainer.strategy.engine.inference
    assert result[0]["test_loss"] == pytest.approx(expected[0]["test_loss"], abs=1e-5)
    params = [os.path.basename(d) for d in glob.glob(str(tmp_path / "nvme" / "infinity-*-param" / "rank0*"))
              if os.path.isdir(d)]
    assert sorted(params) == ["rank0", "rank0.1"]  # each engine's parameters in its own directory
    after = fitted.consolidated_state_dict()  # the fitted engine's bytes are intact beside the second
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert len(model.losses) == 16


def test_test_with_ckpt_path_on_a_new_model_builds_an_engine_without_optimizer(tmp_path):
    model, trainer = _fit(_on_nvme(tmp_path / "nvme1"), ours=True)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    expected = trainer.test(model, dataloaders=_data(), verbose=False)
    tester = _trainer(_on_nvme(tmp_path / "nvme2"))
    result = tester.test(SeedModel(), ckpt_path=str(tmp_path / "run.ckpt"), dataloaders=_data(), verbose=False)
    assert tester.strategy.engine.inference
    assert result[0]["test_loss"] == expected[0]["test_loss"]


def test_a_precision_beside_another_config_section_is_refused():
    strategy = InfinityStrategy(config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    with pytest.raises(RuntimeError, match="precision '32-true': the model's engine computes in torch.bfloat16"):
        _trainer(strategy).fit(SeedModel(), _data())


def test_fit_with_ckpt_path_resumes_as_plain_lightning(tmp_path):
    plain, plain_trainer = _fit("auto", ours=False)
    plain_trainer.save_checkpoint(tmp_path / "plain.ckpt")
    model, trainer = _fit(_on_nvme(tmp_path / "nvme1"), ours=True)
    trainer.save_checkpoint(tmp_path / "ours.ckpt")
    torch.manual_seed(0)
    plain_resumed = SeedModel(ours=False)
    plain_trainer = _trainer("auto", max_epochs=2)
    plain_trainer.fit(plain_resumed, _data(), ckpt_path=str(tmp_path / "plain.ckpt"))
    torch.manual_seed(0)
    resumed = SeedModel(ours=True)
    trainer = _trainer(_on_nvme(tmp_path / "nvme2"), max_epochs=2)
    trainer.fit(resumed, _data(), ckpt_path=str(tmp_path / "ours.ckpt"))
    assert len(plain_resumed.losses) == 8 and _close(resumed.losses, plain_resumed.losses), (resumed.losses,
                                                                                               plain_resumed.losses)
    assert trainer.global_step == plain_trainer.global_step == 8
    assert trainer.current_epoch == plain_trainer.current_epoch == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        plain_trainer.optimizers[0].param_groups[0]["lr"])


def test_a_second_fit_resumes_from_ckpt_path_on_the_same_engine_and_is_refused_without(tmp_path):
    def twice(strategy, ours):
        torch.manual_seed(0)
        model = SeedModel(ours=ours)
        trainer = _trainer(strategy)
        trainer.fit(model, _data())
        trainer.save_checkpoint(tmp_path / f"{ours}.ckpt")
        trainer.fit_loop.max_epochs = 2
        trainer.fit(model, _data(), ckpt_path=str(tmp_path / f"{ours}.ckpt"))
        return model, trainer

    plain, _ = twice("auto", False)
    model, trainer = twice(_on_nvme(tmp_path / "nvme"), True)
    assert len(plain.losses) == 16 and _close(model.losses, plain.losses), (model.losses, plain.losses)
    trainer.fit_loop.max_epochs = 3
    with pytest.raises(RuntimeError, match="without ckpt_path: Lightning starts each fit with a fresh optimizer"):
        trainer.fit(model, _data())


def test_fit_on_a_model_that_test_set_up_is_refused():
    model = SeedModel()
    trainer = _trainer(InfinityStrategy(stage=3))
    trainer.test(model, dataloaders=_data(), verbose=False)
    with pytest.raises(RuntimeError, match="held by an engine this strategy did not build for training"):
        trainer.fit(model, _data())


def test_converted_single_file_loads_with_load_from_checkpoint_and_a_plain_trainer(tmp_path):
    model, trainer = _fit(_on_nvme(tmp_path / "nvme"), ours=True)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    trained = trainer.strategy.engine.consolidated_state_dict()
    extra = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "run.ckpt", tmp_path / "single.ckpt")
    assert {"epoch", "global_step", "loops", "hyper_parameters", "pytorch-lightning_version"} <= set(extra)
    loaded = SeedModel.load_from_checkpoint(tmp_path / "single.ckpt")
    assert loaded.hparams.ours is True
    assert set(loaded.state_dict()) == set(trained)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())  # the fp32 masters
    ours = trainer.test(model, dataloaders=_data(), verbose=False)
    torch.distributed.destroy_process_group()  # plain Lightning as in a process of its own
    plain = _trainer("auto").test(SeedModel(ours=False), ckpt_path=str(tmp_path / "single.ckpt"),
                                  dataloaders=_data(), verbose=False)
    assert plain[0]["test_loss"] == pytest.approx(ours[0]["test_loss"], abs=1e-6)


def test_save_full_weights_writes_one_file_and_load_full_weights_reads_it(tmp_path):
    model, trainer = _fit(_on_nvme(tmp_path / "nvme1", save_full_weights=True), ours=True)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    assert os.path.isfile(tmp_path / "full.ckpt")
    trained = trainer.strategy.engine.consolidated_state_dict()
    loaded = SeedModel.load_from_checkpoint(tmp_path / "full.ckpt")
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    fresh = SeedModel()
    tester = _trainer(_on_nvme(tmp_path / "nvme2", load_full_weights=True))
    result = tester.test(fresh, ckpt_path=str(tmp_path / "full.ckpt"), dataloaders=_data(), verbose=False)
    expected = trainer.test(model, dataloaders=_data(), verbose=False)
    assert result[0]["test_loss"] == pytest.approx(expected[0]["test_loss"], abs=1e-6)


def test_a_single_file_without_load_full_weights_says_how_to_load_it(tmp_path):
    _, trainer = _fit(InfinityStrategy(stage=3, save_full_weights=True), ours=True)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    with pytest.raises(FileNotFoundError, match="load_full_weights=True"):
        trainer.test(ckpt_path=str(tmp_path / "full.ckpt"), dataloaders=_data(), verbose=False)


# ---- Fabric -------------------------------------------------------------------------------------


def _fabric_batches():
    return [(x, y) for x, y in _data()][:6]


def test_fabric_trains_as_pytorch_and_resumes_from_its_checkpoint(tmp_path):
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    plain = SeedModel(ours=False)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    expected = []
    for x, y in _fabric_batches():
        loss = nn.functional.cross_entropy(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())

    os.makedirs(tmp_path / "nvme")
    strategy = InfinityFabricStrategy(config={
        "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                    "buffer_count": 9}},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}})
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = SeedModel(ours=True)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    got = []
    for i, (x, y) in enumerate(_fabric_batches()):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()  # the engine's step
        optimizer.zero_grad()
        got.append(loss.item())
        if i == 2:
            fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": i})
    assert _close(got, expected), (got, expected)
    state = {"model": model, "optimizer": optimizer, "step": None}
    fabric.load(tmp_path / "fabric.ckpt", state)
    assert state["step"] == 2
    again = []
    for x, y in _fabric_batches()[3:]:
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        again.append(loss.item())
    assert again == got[3:]  # exact resume


def test_fabric_knows_the_names():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert "infinity_stage_3_offload_nvme" in STRATEGY_REGISTRY.available_strategies()
    fabric = Fabric(accelerator="cpu", devices=1, strategy="infinity_stage_2")
    assert isinstance(fabric.strategy, InfinityFabricStrategy) and fabric.strategy.config["zero_optimization"]["stage"] == 2


def _fabric_on_nvme(tmp_path, **extra):
    from lightning.fabric import Fabric

    os.makedirs(tmp_path / "nvme", exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    strategy = InfinityFabricStrategy(config={"train_micro_batch_size_per_gpu": 8, **extra, "zero_optimization": {
        "stage": 3, "offload_param": off, "offload_optimizer": {**off, "buffer_count": 9}}})
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    return fabric


def test_fabric_loads_a_raw_state_dict_and_a_plain_checkpoint_into_the_engine(tmp_path):
    """`fabric.load_raw(path, model)` with a plain `torch.save(model.state_dict())`, and
    `fabric.load(path, {"model": model, "step": ...})` with a checkpoint plain Fabric saved: the
    engine's model then computes what the plain model does, and `step` comes back."""
    from lightning.fabric import Fabric

    torch.manual_seed(1)
    trained = SeedModel(ours=False)
    torch.save(trained.state_dict(), tmp_path / "raw.pt")
    plain = Fabric(accelerator="cpu", devices=1)
    plain.save(tmp_path / "plain.ckpt", {"model": trained, "optimizer": torch.optim.AdamW(trained.parameters()),
                                         "step": 7})
    x = _fabric_batches()[0][0]
    expected = trained(x)
    for how in ("raw", "plain"):
        fabric = _fabric_on_nvme(tmp_path / how)
        torch.manual_seed(0)
        model = SeedModel(ours=True)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        assert not torch.allclose(model(x), expected)
        if how == "raw":
            fabric.load_raw(tmp_path / "raw.pt", model)
        else:
            state = {"model": model, "step": None}
            fabric.load(tmp_path / "plain.ckpt", state)
            assert state["step"] == 7
            with pytest.raises(NotImplementedError, match="optimizer's state from a file"):
                fabric.load(tmp_path / "plain.ckpt", {"model": model, "optimizer": optimizer})
        torch.testing.assert_close(model(x), expected, atol=1e-6, rtol=0)
        fabric.strategy.engine.close()


def test_fabric_no_backward_sync_warns_and_colliding_keys_are_named(tmp_path):
    """As with DeepSpeedStrategy: `fabric.no_backward_sync(model)` warns that the strategy cannot
    skip the synchronisation and does nothing (accumulation is the config's), and saving a state
    whose keys DeepSpeed uses for its own warns naming them."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    fabric = _fabric_on_nvme(tmp_path)
    torch.manual_seed(0)
    model = SeedModel(ours=True)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    x, y = _fabric_batches()[0]
    with pytest.warns(PossibleUserWarning, match="does not support skipping the gradient synchronization"):
        with fabric.no_backward_sync(model):
            fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    with pytest.warns(UserWarning, match="collide with DeepSpeed's internal engine state: global_steps"):
        fabric.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "global_steps": 1})
    fabric.strategy.engine.close()


def test_pl_deepspeed_config_path_is_the_strategys_config(tmp_path, monkeypatch):
    """PL_DEEPSPEED_CONFIG_PATH names the config when none is given, as DeepSpeedStrategy reads it."""
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5, "zero_optimization": {"stage": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(tmp_path / "ds.json"))
    assert InfinityStrategy().config == config and InfinityFabricStrategy().config == config
    with pytest.raises(ValueError, match="stage: given with PL_DEEPSPEED_CONFIG_PATH="):
        InfinityStrategy(stage=2)
    model, trainer = _fit("infinity", ours=True, gradient_clip_val=None)  # the registered name, through Trainer
    assert trainer.strategy.config["gradient_clipping"] == 0.5 and trainer.strategy.engine.gradient_clipping() == 0.5
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="PL_DEEPSPEED_CONFIG_PATH: You passed in a path to a DeepSpeed config but the path does not exist"):
        InfinityStrategy()


# ---- two ranks ---------------------------------------------------------------------------------

_DDP_JOB = """
import json, os, sys
import torch
import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import torch.utils.checkpoint as torch_checkpoint
from infinity import checkpointing
from infinity.integrations.lightning.strategy import InfinityStrategy

class Model(pl.LightningModule):
    def __init__(self, ours):
        super().__init__()
        self.ours, self.losses = ours, []
        self.block_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.block_2 = nn.Linear(32, 2)
    def forward(self, x):
        if self.ours:
            return self.block_2(checkpointing.checkpoint(self.block_1, x))
        return self.block_2(torch_checkpoint.checkpoint(self.block_1, x, use_reentrant=False))
    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

ours, out, nvme = sys.argv[1] == "ours", sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 2, (64,), generator=g)), batch_size=8)
strategy = InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True, offload_params_device="nvme",
                            offload_optimizer_device="nvme", nvme_path=nvme, optimizer_buffer_count=9,
                            cpu_checkpointing=True) if ours else "ddp"
torch.manual_seed(0)
model = Model(ours)
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2,
                     gradient_clip_val=1.0, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, data)
with open(f"{out}.rank{trainer.global_rank}", "w") as f:
    json.dump(model.losses, f)
"""


@pytest.mark.slow
def test_two_gloo_ranks_train_as_plain_lightning_ddp(tmp_path):
    """Lightning's own launcher starts the second rank (DDPStrategy's): the engine shards over
    the two processes, and each rank's losses are those of plain Lightning DDP."""
    job = tmp_path / "job.py"
    job.write_text(_DDP_JOB)
    os.makedirs(tmp_path / "nvme")
    losses = {}
    for kind in ("plain", "ours"):
        proc = subprocess.run([sys.executable, str(job), kind, str(tmp_path / kind), str(tmp_path / "nvme")],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses[kind] = [json.loads((tmp_path / f"{kind}.rank{r}").read_text()) for r in (0, 1)]
    assert losses["plain"][0] != losses["plain"][1]  # each rank its own samples
    for rank in (0, 1):
        assert len(losses["plain"][rank]) == 4 and _close(losses["ours"][rank], losses["plain"][rank]), losses


# ---- the single file, one unit in memory at a time ------------------------------------------------


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_conversion_holds_one_unit_in_memory_at_a_time(tmp_path):
    """8 units of 8 MiB of fp32 masters: the converting process's anonymous memory, sampled from
    outside (the GIL cannot hide a peak), grows by far less than the model."""
    units, width = 8, 1448  # 1448 x 1448 x 4 bytes: 8 MiB a unit
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(units)))
    engine, *_ = infinity.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}}, units=[nn.Linear])
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3, "global_step": 7})
    expected = engine.consolidated_state_dict()
    engine.close()
    script = (
        "import sys\n"
        "from infinity.integrations.lightning.single_file import convert_checkpoint\n"
        "base = [int(x.split()[1]) * 1024 for x in open('/proc/self/status') if x.startswith('RssAnon:')][0]\n"
        "convert_checkpoint(sys.argv[1], sys.argv[2])\n"
        "print(base)\n")
    # Started outside the checkout, whose source tree (no compiled extensions) would shadow the installed package.
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "ckpt"), str(tmp_path / "one.ckpt")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, _rss_anon(child.pid))
        except (FileNotFoundError, ProcessLookupError, RuntimeError):
            break
        time.sleep(0.001)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    base = int(out.strip().splitlines()[-1])
    model_bytes = units * width * width * 4
    assert peak - base < model_bytes / 3, (peak - base, model_bytes)
    saved = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (3, 7)
    assert set(saved["state_dict"]) == set(expected)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in expected.items())
