"""`InfinityStrategy`: Lightning's Trainer on the engine, with `DeepSpeedStrategy`'s arguments
and protocol.

[Note: the engine behind a Trainer]
The strategy translates Lightning's protocol into engine calls and owns nothing else: the
training step's forward is `engine(...)` (Lightning's forward redirection, as for DeepSpeed), its
backward `engine.backward(loss)`, and every optimizer step Lightning takes, one per micro-batch
since the engine counts the accumulation (`accumulate_grad_batches` becomes
`gradient_accumulation_steps`, `gradient_clip_val` becomes `gradient_clipping`), is
`engine.step()`. The engine computes on Lightning's root device (`infinity.initialize(device=...)`,
which refuses an INFINITY_DEVICE that says otherwise), and the config's `activation_checkpointing`
section configures `infinity.checkpointing` when the engine is built.
`configure_optimizers`' optimizer goes to `infinity.initialize` as a client
optimizer; its scheduler stays Lightning's, which steps it at accumulation boundaries (the engine
reads the learning rates from the optimizer's own param groups). A model's parameters live in
the engine that partitioned them, and only there: the engine outlives `fit` (the model stays
usable, and its NVMe files stay until the model is garbage, or until `strategy.engine.close()`,
after which the model is gone), and `validate` / `test` / `predict` on a model an engine holds run
on that engine (`trainer.test(ckpt_path=...)` after `fit` loads the checkpoint into it, without the
optimizer states, as DeepSpeed's strategy does). On a model no engine holds they build an engine
without an optimizer, beside any other engine of the process, on the same nvme_path too ([Note:
stores of one process] in infinity/offload/store.py). A second `fit` of the same Trainer on the same model runs on its engine too,
but Lightning starts every fit with a fresh optimizer, which an engine cannot take: it must come
with `ckpt_path=` (the engine loads the optimizer state from it, as plain Lightning does), else
it is an error at the start of training. A model held by an engine without an optimizer, or by
the engine of another Trainer, cannot be fitted: infinity cannot hand an engine's partitions to
a new one (the error says so; DeepSpeed re-wraps its partitioned parameters there).

[Note: Lightning checkpoints in infinity's format]
`trainer.save_checkpoint(path)` and `ModelCheckpoint` write `engine.save_checkpoint(path,
tag="checkpoint", client_state=...)`: `path/latest` and `path/checkpoint/` in infinity's layout,
with Lightning's own keys (loops, callbacks, LR schedulers, hyper-parameters) as the client
state, which must load with `torch.load(weights_only=True)` (so hyper-parameters are tensors,
numbers, strings and containers of them). `state_dict` and `optimizer_states` are not gathered
(the engine streams both). `fit(ckpt_path=path)` loads weights, optimizer state, the engine's
counters and RNG states through the engine and the rest through Lightning; `validate`, `test`
and `predict` load the weights only. `save_full_weights=True` writes one `.ckpt` file instead
(weights and Lightning's keys, no optimizer state: [Note: a torch.save file one unit at a time] in
infinity/integrations/lightning/single_file.py), which `load_full_weights=True` reads back, as does
`LightningModule.load_from_checkpoint`; so does the output of
`convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file)`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

import infinity
from infinity.offload import activations
from infinity.engine import Engine
from infinity.integrations.lightning.checkpoints import _TAG, _checkpoint_location, _not_a_checkpoint
from infinity.integrations.lightning.config import (_add_precision, _check_device_indices, _config_dtype, _register,
                                                    _split_options, _user_config, _zero_stage)
from infinity.integrations.lightning.precision import InfinityPrecision, _precision_name
from infinity.integrations.lightning.single_file import load_full_weights, save_full_weights
from infinity.zero.registry import owner_of

log = logging.getLogger("infinity")


def _engine_of(module: nn.Module) -> Engine | None:
    """The engine that holds the module's parameters ([Note: the engine behind a Trainer])."""
    for p in module.parameters():
        found = owner_of(p)
        if found is not None:
            return found[0]
    return None


class InfinityStrategy(DDPStrategy):
    """`DeepSpeedStrategy`'s arguments and protocol on infinity ([Note: the engine behind a
    Trainer], [Note: Lightning checkpoints in infinity's format]).

    Args:
        config: a DeepSpeed config dict or JSON path; without it the keyword arguments write one
            as DeepSpeedStrategy does (`OPTIONS`: stage, offload_optimizer, offload_parameters,
            offload_params_device, offload_optimizer_device, nvme_path, params_buffer_count/size,
            max_in_cpu, pin_memory, bucket sizes, logging_batch_size_per_gpu,
            partition_activations, cpu_checkpointing, contiguous_memory_optimization,
            synchronize_checkpoint_boundary, ...); with it, they are an error. The fp16 loss-scale
            arguments (`FP16_OPTIONS`) write the fp16 section when the config has none.
        remote_device: where `configure_model` builds the model under `infinity.Init` at stage 3
            (None, "cpu" or "nvme"; infinity builds on the meta device in every case).
        load_full_weights: `ckpt_path` is a single `.ckpt` file (weights only).
        save_full_weights: `save_checkpoint` writes a single `.ckpt` file (weights only).
        exclude_frozen_parameters: checkpoints leave out frozen parameters' values.
        logging_level: the level of infinity's logger ("infinity").
        accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
        timeout: as for DDPStrategy.
    """

    strategy_name = "infinity"

    def __init__(self, accelerator: Any = None, config: Any = None, *, remote_device: str | None = None,
                 load_full_weights: bool = False, save_full_weights: bool = False,
                 exclude_frozen_parameters: bool = False, logging_level: int = logging.WARN,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        options, self._fp16 = _split_options(options)
        self.config = _user_config(config, options)
        if remote_device not in (None, "cpu", "nvme"):
            raise ValueError(f"remote_device: expected None, 'cpu' or 'nvme', got {remote_device!r}")
        self.remote_device = remote_device
        self.load_full_weights = load_full_weights
        self.save_full_weights = save_full_weights
        self.exclude_frozen_parameters = exclude_frozen_parameters
        log.setLevel(logging_level)
        self._engine: Engine | None = None
        self._fit_state: tuple[list, list] | None = None  # optimizers and schedulers of the fit that built it
        self._refit_without_state = False  # a second fit on the engine, until a checkpoint loads its optimizer

    # ---- what Lightning sets and reads --------------------------------------------------------

    @property
    def precision_plugin(self) -> InfinityPrecision:
        return self._precision_plugin if self._precision_plugin is not None else InfinityPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, InfinityPrecision):
            plugin = InfinityPrecision(_precision_name(plugin))
        self._precision_plugin = plugin

    @property
    def engine(self) -> Engine:
        """The engine the model runs on (after `setup`)."""
        if self._engine is None:
            raise RuntimeError("InfinityStrategy.engine: no engine yet; it is built when fit/validate/test/predict "
                               "sets up the model")
        return self._engine

    @property
    def zero_stage_3(self) -> bool:
        return _zero_stage(self.config) == 3

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        if self.load_full_weights and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            rank_zero_warn("load_full_weights: a single checkpoint file holds no optimizer states; training resumes "
                           "with fresh ones (resume from the checkpoint directory to restore them)")
        return False  # the engine restores them

    # ---- set-up -------------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        _check_device_indices(self.parallel_devices)
        super().setup_distributed()

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        config = self._stage_config(trainer, fitting)
        held = _engine_of(self.lightning_module)
        building = held is None or held.closed  # a closed one: initialize() says what happened
        dtype = _config_dtype(config) if building else held.dtype
        if dtype != self.precision_plugin.dtype:
            raise RuntimeError(f"precision {self.precision_plugin.precision!r}: the model's engine computes in "
                               f"{dtype} (its config's bf16/fp16 section, or the precision it was set up with); "
                               "give the precision that matches it")
        if building:
            self._engine = self._build_engine(config, fitting)
        else:
            self._take_over(held, fitting)
        self.model = self._engine
        self.barrier()

    def _stage_config(self, trainer: Any, fitting: bool) -> dict:
        """The engine's config for this trainer (its activation_checkpointing section configures
        infinity.checkpointing when `initialize` builds the engine)."""
        config = copy.deepcopy(self.config)
        if "gradient_accumulation_steps" in config:
            raise ValueError("gradient_accumulation_steps: set by Trainer(accumulate_grad_batches=...); leave it out "
                             "of the config")
        config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
            config["train_micro_batch_size_per_gpu"] = _loader_batch_size(trainer) if fitting else 1
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError("gradient_clip_algorithm='value': the engine clips by the global norm only; use 'norm'")
        clip = trainer.gradient_clip_val
        if "gradient_clipping" not in config:
            config["gradient_clipping"] = float(clip or 0.0)
        elif clip is not None and float(clip) != float(config["gradient_clipping"]):
            raise ValueError(f"gradient_clip_val={clip} and the config's gradient_clipping="
                             f"{config['gradient_clipping']}: give the clipping once")
        _add_precision(config, self.precision_plugin.precision, self._fp16)
        if not fitting:
            config.pop("optimizer", None)
            config.pop("scheduler", None)
        return config

    def _build_engine(self, config: dict, fitting: bool) -> Engine:
        module = self.precision_plugin.convert_module(self.lightning_module)
        if not fitting:
            engine, *_ = infinity.initialize(model=module, config=config, dist_init_required=False,
                                             device=self.root_device)
            return engine
        optimizer, schedulers = None, []
        if "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(f"configure_optimizers: infinity runs one optimizer and at most one scheduler, got "
                                 f"{len(optimizers)} and {len(schedulers)}")
            optimizer = optimizers[0]
        params = None if optimizer is not None else [p for p in module.parameters() if p.requires_grad]
        engine, zero_optimizer, _, engine_scheduler = infinity.initialize(
            model=module, optimizer=optimizer, model_parameters=params, config=config, dist_init_required=False,
            device=self.root_device)
        if engine_scheduler is not None:  # the config's: Lightning steps it, as for DeepSpeed
            engine.lr_scheduler = None
            schedulers = [LRSchedulerConfig(engine_scheduler, interval="step")]
        self.optimizers = [zero_optimizer]
        self.lr_scheduler_configs = schedulers
        self._fit_state = (self.optimizers, self.lr_scheduler_configs)
        return engine

    def _take_over(self, engine: Engine, fitting: bool) -> None:
        """The model is held by a live engine: it is the one that runs it (with its device and
        activation checkpointing settings, as when it was built)."""
        if fitting and (engine is not self._engine or self._fit_state is None):
            raise RuntimeError("trainer.fit: the model's parameters are held by an engine this strategy did not build "
                               "for training (the one validate/test/predict built, or another Trainer's), and "
                               "infinity cannot hand them to a new engine; fit first, or build the model again (and "
                               "resume with ckpt_path=...)")
        if fitting:  # on_train_start checks that a checkpoint gave the optimizer its state
            self.optimizers, self.lr_scheduler_configs = self._fit_state
            self._refit_without_state = True
        activations.attach(engine.accelerator, engine.config.activation_checkpointing)
        self._engine = engine

    def on_train_start(self) -> None:
        if self._refit_without_state:
            self._refit_without_state = False
            raise RuntimeError("trainer.fit again on a model this strategy fitted, without ckpt_path: Lightning starts "
                               "each fit with a fresh optimizer from configure_optimizers, and the engine cannot drop "
                               "the optimizer state it holds; resume with trainer.fit(model, ckpt_path=...), whose "
                               "optimizer state the engine loads, or build the model again")
        super().on_train_start()

    def setup_optimizers(self, trainer: Any) -> None:
        """The optimizer is built with the engine (`setup`)."""

    def model_to_device(self) -> None:
        """The engine places the parameters it partitions."""

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if self.zero_stage_3:
            if empty_init is False:
                raise NotImplementedError("empty_init=False: at ZeRO stage 3 the model is built on the meta device "
                                          "(infinity.Init) and initialised by the engine")
            yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with infinity.Init(enabled=self.zero_stage_3, remote_device=self.remote_device,
                           config_dict_or_path=self.config):
            yield

    def teardown(self) -> None:
        """Keeps the engine, which holds the model's values ([Note: the engine behind a Trainer])."""
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---- checkpoints ([Note: Lightning checkpoints in infinity's format]) -----------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine writes the weights, a unit at a time

    def optimizer_state(self, optimizer: Any) -> dict[str, torch.Tensor]:
        return {}  # the engine writes the optimizer state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options: InfinityStrategy writes checkpoints through the engine, not a "
                            "CheckpointIO plugin")
        filepath = os.fspath(self.broadcast(filepath))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.save_full_weights:
            save_full_weights(self.engine, filepath, extra, self.exclude_frozen_parameters)
        else:
            self.engine.save_checkpoint(filepath, tag=_TAG, client_state=extra,
                                        exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.load_full_weights:
            return super().load_checkpoint(self.broadcast(checkpoint_path), weights_only)
        load_dir, tag = _checkpoint_location(checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=fitting,
                                                      load_lr_scheduler_states=False,
                                                      load_module_strict=self.lightning_module.strict_loading)
        if client_state is None:
            raise _not_a_checkpoint(checkpoint_path)
        self._refit_without_state = False
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.load_full_weights:  # else the engine loaded them in load_checkpoint
            load_full_weights(self.lightning_module, checkpoint["state_dict"], strict, self.is_global_zero)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded them in `load_checkpoint`."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register(cls, strategy_registry)


def _loader_batch_size(trainer: Any) -> int:
    """The training loader's batch size (the engine's train_micro_batch_size_per_gpu, which it uses
    for its sample counts only), else 1: what DeepSpeedStrategy reads."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is not None and source.is_defined():
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        if getattr(sampler, "batch_size", None):
            return int(sampler.batch_size)
    return 1

