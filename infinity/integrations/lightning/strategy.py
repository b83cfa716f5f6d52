"""Lightning on infinity: `InfinityStrategy` for the Trainer and `InfinityFabricStrategy` for
Fabric, taking `DeepSpeedStrategy`'s arguments, on the CPU accelerator as on CUDA, and
`convert_zero_checkpoint_to_fp32_state_dict` for a single-file checkpoint
(`pip install "infinity[lightning]"`).

    import infinity.integrations.lightning.strategy  # registers the names below with Lightning
    trainer = Trainer(strategy="infinity_stage_3_offload", precision="bf16-mixed")
    trainer = Trainer(strategy=InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                                remote_device="nvme", offload_params_device="nvme",
                                                offload_optimizer_device="nvme", nvme_path="/local_nvme"))

Registered names (Trainer and Fabric): `infinity` (ZeRO stage 2, as `deepspeed` is),
`infinity_stage_1`, `infinity_stage_2`, `infinity_stage_2_offload`, `infinity_stage_3`,
`infinity_stage_3_offload`, `infinity_stage_3_offload_nvme`.

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
import importlib.util
import json
import logging
import os
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any, Callable

if importlib.util.find_spec("lightning") is None:
    raise ModuleNotFoundError('infinity.integrations.lightning.strategy needs Lightning: pip install "infinity[lightning]"')

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.load import _move_state_into
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

import infinity
from infinity.offload import activations
from infinity.checkpoint.layout import LATEST, MANIFEST
from infinity.engine import Engine
from infinity.integrations.lightning.single_file import convert_checkpoint, load_full_weights, save_full_weights
from infinity.zero.registry import owner_of

__all__ = ["InfinityFabricStrategy", "InfinityPrecision", "InfinityStrategy",
           "convert_zero_checkpoint_to_fp32_state_dict", "deepspeed_config"]

log = logging.getLogger("infinity")

_TAG = "checkpoint"  # the tag DeepSpeed's strategy saves under, in the directory Lightning names

# DeepSpeedStrategy's arguments that write its DeepSpeed config, with their defaults (Lightning 2.6).
OPTIONS: dict[str, Any] = {
    "zero_optimization": True, "stage": 2, "offload_optimizer": False, "offload_parameters": False,
    "offload_params_device": "cpu", "offload_optimizer_device": "cpu", "nvme_path": "/local_nvme",
    "params_buffer_count": 5, "params_buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
    "optimizer_buffer_count": 4, "block_size": 1_048_576, "queue_depth": 8, "single_submit": False,
    "overlap_events": True, "thread_count": 1, "pin_memory": False, "sub_group_size": 1_000_000_000_000,
    "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True, "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000, "zero_allow_untested_optimizer": True,
    "logging_batch_size_per_gpu": "auto", "partition_activations": False, "cpu_checkpointing": False,
    "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
}
# Arguments read also when a config is given: the fp16 section they write when it has none.
FP16_OPTIONS: dict[str, Any] = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                                "hysteresis": 2, "min_loss_scale": 1}
PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
              "bf16-true": torch.bfloat16, "16-true": torch.float16}


def deepspeed_config(**options: Any) -> dict:
    """The DeepSpeed config `DeepSpeedStrategy` writes from its arguments (`OPTIONS`)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of DeepSpeedStrategy's config (expected one of "
                        f"{', '.join(OPTIONS)})")
    o = {**OPTIONS, **options}
    config: dict[str, Any] = {
        "activation_checkpointing": {k: o[k] for k in ("partition_activations", "cpu_checkpointing",
                                                       "contiguous_memory_optimization",
                                                       "synchronize_checkpoint_boundary")},
        "aio": {k: o[k] for k in ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")},
    }
    if o["zero_optimization"]:
        zero = {k: o[k] for k in ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions",
                                  "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")}
        if o["offload_optimizer"]:
            zero["offload_optimizer"] = {"device": o["offload_optimizer_device"], "nvme_path": o["nvme_path"],
                                         "buffer_count": o["optimizer_buffer_count"], "pin_memory": o["pin_memory"]}
        if o["offload_parameters"]:
            zero["offload_param"] = {"device": o["offload_params_device"], "nvme_path": o["nvme_path"],
                                     "buffer_count": o["params_buffer_count"], "buffer_size": o["params_buffer_size"],
                                     "max_in_cpu": o["max_in_cpu"], "pin_memory": o["pin_memory"]}
        config["zero_allow_untested_optimizer"] = o["zero_allow_untested_optimizer"]
        config["zero_optimization"] = zero
    if o["logging_batch_size_per_gpu"] != "auto":
        config["train_micro_batch_size_per_gpu"] = o["logging_batch_size_per_gpu"]
    return config


def _user_config(config: Any, options: dict) -> dict:
    """The config a strategy starts from: the user's (a dict, copied, or a JSON path), else the one
    its arguments write. With a config, the arguments that would write it are an error rather
    than ignored."""
    if config is None:
        return deepspeed_config(**options)
    if options:
        raise ValueError(f"{sorted(options)[0]}: given with config=...; with a config every setting comes from it "
                         "(DeepSpeedStrategy ignores such arguments): set it in the config")
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise FileNotFoundError(f"config: no DeepSpeed config file at {config}")
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a DeepSpeed config dict or a JSON file's path, got {type(config).__name__}")
    return copy.deepcopy(config)


def _split_options(kwargs: dict) -> tuple[dict, dict]:
    """(config-writing options, fp16 options) of a strategy's keyword arguments."""
    unknown = sorted(set(kwargs) - set(OPTIONS) - set(FP16_OPTIONS))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of InfinityStrategy (DeepSpeedStrategy's config arguments: "
                        f"{', '.join(OPTIONS)}; fp16: {', '.join(FP16_OPTIONS)})")
    return ({k: v for k, v in kwargs.items() if k in OPTIONS},
            {**FP16_OPTIONS, **{k: v for k, v in kwargs.items() if k in FP16_OPTIONS}})


def _add_precision(config: dict, precision: str, fp16: dict) -> None:
    """The fp16 or bf16 section a precision asks for, unless the config has its own (as Lightning)."""
    if precision in ("16-mixed", "16-true") and "fp16" not in config:
        config["fp16"] = {"enabled": True, **fp16}
    elif precision in ("bf16-mixed", "bf16-true") and "bf16" not in config:
        config["bf16"] = {"enabled": True}


def _config_dtype(config: dict) -> torch.dtype:
    """The dtype an engine of this config computes in."""
    enabled = lambda key: bool((config.get(key) or {}).get("enabled", False))  # noqa: E731
    if enabled("fp16"):
        return torch.float16
    return torch.bfloat16 if enabled("bf16") or enabled("bfloat16") else torch.float32


def _zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def _engine_of(module: nn.Module) -> Engine | None:
    """The engine that holds the module's parameters ([Note: the engine behind a Trainer])."""
    for p in module.parameters():
        found = owner_of(p)
        if found is not None:
            return found[0]
    return None


def _checkpoint_location(path: str) -> tuple[str, str | None]:
    """(directory with `latest`, tag) of a checkpoint Lightning was given."""
    path = os.fspath(path)
    if os.path.isfile(path):
        raise ValueError(f"{path}: a single-file checkpoint; load it with InfinityStrategy(load_full_weights=True) "
                         "(an infinity checkpoint is a directory holding 'latest')")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    if not os.path.isfile(os.path.join(path, LATEST)):
        raise FileNotFoundError(f"{path}: not an infinity checkpoint (no {LATEST!r} file, no {MANIFEST})")
    return path, None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _precision_name(plugin: Any) -> str:
    name = getattr(plugin, "precision", None)
    if name not in PRECISIONS:
        raise ValueError(f"precision: infinity runs {', '.join(PRECISIONS)}, got {name!r} "
                         f"({type(plugin).__name__})")
    return name


# ---- the Trainer ------------------------------------------------------------------------------


class InfinityPrecision(Precision):
    """A precision of the Trainer on the engine: the engine computes in the dtype its config's
    bf16/fp16 section names (fp32 masters, the fp16 loss scale), so a "-mixed" precision means
    the model in that dtype, not autocast; "-true" casts the model first (its masters are then the
    cast values). Inputs are cast to that dtype. `Trainer(precision=...)` is turned into this; on
    the CPU Lightning turns "16-mixed" into "bf16-mixed" first, so pass
    `InfinityStrategy(precision_plugin=InfinityPrecision("16-mixed"))` for fp16 there."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.dtype = PRECISIONS[precision]

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype) if self.precision.endswith("-true") else module

    def convert_input(self, data: Any) -> Any:
        return _cast_floats(data, self.dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype) if self.precision.endswith("-true") else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        model.trainer.strategy.engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError("training_step returned None: skipping a step is not supported by the engine, which "
                               "counts every micro-batch of an accumulation")
        return model.trainer.strategy.engine.step(**kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """The engine clips (config gradient_clipping, from Trainer(gradient_clip_val=...))."""


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
            raise FileNotFoundError(f"{checkpoint_path}: no checkpoint to load")
        self._refit_without_state = False
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.load_full_weights:  # else the engine loaded them in load_checkpoint
            load_full_weights(self.lightning_module, checkpoint["state_dict"], strict, self.is_global_zero)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded them in `load_checkpoint`."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, init in _NAMES:
            strategy_registry.register(name, cls, description=description, override=True, **init)


def _loader_batch_size(trainer: Any) -> int:
    """The training loader's batch size (the engine's train_micro_batch_size_per_gpu, which it uses
    for its sample counts only), else 1: what DeepSpeedStrategy reads."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is not None and source.is_defined():
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        if getattr(sampler, "batch_size", None):
            return int(sampler.batch_size)
    return 1


_NVME = {"remote_device": "nvme", "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}
_NAMES: tuple[tuple[str, str, dict], ...] = (
    ("infinity", "infinity, ZeRO stage 2", {}),
    ("infinity_stage_1", "infinity, ZeRO stage 1", {"stage": 1}),
    ("infinity_stage_2", "infinity, ZeRO stage 2", {"stage": 2}),
    ("infinity_stage_2_offload", "infinity, ZeRO stage 2, optimizer on the CPU",
     {"stage": 2, "offload_optimizer": True}),
    ("infinity_stage_3", "infinity, ZeRO stage 3", {"stage": 3}),
    ("infinity_stage_3_offload", "infinity, ZeRO stage 3, parameters and optimizer on the CPU",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ("infinity_stage_3_offload_nvme", "infinity, ZeRO stage 3, parameters and optimizer on NVMe",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **_NVME}),
)


# ---- Fabric -----------------------------------------------------------------------------------


class InfinityFabricPrecision(FabricPrecision):
    """InfinityPrecision's meaning for Fabric; outputs come back in the default dtype."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.dtype = PRECISIONS[precision]

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype) if self.precision.endswith("-true") else module

    def convert_input(self, data: Any) -> Any:
        return _cast_floats(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floats(data, torch.get_default_dtype())

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype) if self.precision.endswith("-true") else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()


class InfinityFabricStrategy(FabricDDPStrategy):
    """Fabric's side: `fabric.setup(model, optimizer)` builds the engine and returns it with its
    optimizer, whose `step()` (through Fabric) is `engine.step()`; `fabric.backward(loss)` is
    `engine.backward(loss)`; `fabric.save` / `fabric.load` go through the engine's checkpoints
    (the other objects of the state are its client state). Gradient accumulation and clipping
    come from the config (`gradient_accumulation_steps`, `gradient_clipping`), as for DeepSpeed;
    call `optimizer.step()` after every `fabric.backward`. Arguments as InfinityStrategy's (no
    single-file loading: `load_full_weights` is the Trainer's only)."""

    def __init__(self, accelerator: Any = None, config: Any = None, *, remote_device: str | None = None,
                 exclude_frozen_parameters: bool = False, logging_level: int = logging.WARN,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, precision: FabricPrecision | None = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout)
        options, self._fp16 = _split_options(options)
        self.config = _user_config(config, options)
        self.config.setdefault("train_micro_batch_size_per_gpu", 1)
        self.remote_device = remote_device
        self.exclude_frozen_parameters = exclude_frozen_parameters
        log.setLevel(logging_level)
        self._engine: Engine | None = None

    @property
    def precision(self) -> InfinityFabricPrecision:
        return self._precision if self._precision is not None else InfinityFabricPrecision()

    @precision.setter
    def precision(self, precision: FabricPrecision | None) -> None:
        if precision is not None and not isinstance(precision, InfinityFabricPrecision):
            precision = InfinityFabricPrecision(_precision_name(precision))
        self._precision = precision

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("InfinityFabricStrategy.engine: no engine yet; fabric.setup(model, optimizer) builds it")
        return self._engine

    @property
    def zero_stage_3(self) -> bool:
        return _zero_stage(self.config) == 3

    def _engine_config(self, training: bool) -> dict:
        config = copy.deepcopy(self.config)
        _add_precision(config, self.precision.precision, self._fp16)
        if not training:
            config.pop("optimizer", None)
            config.pop("scheduler", None)
        return config

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler: Any = None) -> tuple:
        if len(optimizers) != 1:
            raise ValueError(f"optimizers: infinity runs one optimizer, got {len(optimizers)}")
        engine, optimizer, _, scheduler = infinity.initialize(
            model=module, optimizer=optimizers[0], lr_scheduler=scheduler, config=self._engine_config(True),
            dist_init_required=False, device=self.root_device)
        self._engine = engine
        return engine, [optimizer], scheduler

    def setup_module(self, module: nn.Module) -> Engine:
        held = _engine_of(module)
        if held is not None and not held.closed:
            self._engine = held
        else:
            self._engine, *_ = infinity.initialize(model=module, config=self._engine_config(False),
                                                   dist_init_required=False, device=self.root_device)
        return self._engine

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise NotImplementedError("InfinityFabricStrategy builds the optimizer with the engine: "
                                  "fabric.setup(model, optimizer)")

    def module_to_device(self, module: nn.Module) -> None:
        """The engine places the parameters it partitions."""

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        if self.zero_stage_3 and empty_init is False:
            raise NotImplementedError("empty_init=False: at ZeRO stage 3 the model is built on the meta device "
                                      "(infinity.Init) and initialised by the engine")
        stack = contextlib.ExitStack()
        if not self.zero_stage_3:
            stack.enter_context(super().module_init_context(empty_init=empty_init))
        stack.enter_context(self.module_sharded_context())
        return stack

    def module_sharded_context(self) -> contextlib.AbstractContextManager:
        return infinity.Init(enabled=self.zero_stage_3, remote_device=self.remote_device,
                             config_dict_or_path=self.config)

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(tensor, module)
        self.engine.backward(tensor, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise TypeError("optimizer.step(closure): the engine's step takes no closure; run forward and "
                            "fabric.backward first")
        if optimizer is not self.engine.optimizer:
            raise ValueError("optimizer: not the optimizer fabric.setup returned with the engine")
        return self.engine.step()

    def clip_gradients_norm(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the engine clips by the global norm itself: set gradient_clipping in the config")

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the engine clips by the global norm only: set gradient_clipping in the config")

    def save_checkpoint(self, path: Any, state: dict, storage_options: Any = None, filter: Any = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("storage_options / filter: InfinityFabricStrategy saves through the engine")
        engine = self._engine_in(state)
        path = os.fspath(self.broadcast(path))
        rest = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        engine.save_checkpoint(path, tag=_TAG, client_state=rest,
                               exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):
            raise NotImplementedError("InfinityFabricStrategy loads infinity checkpoint directories into the engine: "
                                      "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        if not state:
            raise ValueError("state: expected a dict holding the model fabric.setup returned (and its optimizer "
                             "to load the optimizer state)")
        engine = self._engine_in(state)
        load_dir, tag = _checkpoint_location(path)
        with_optimizer = any(v is engine.optimizer for v in state.values())
        _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=with_optimizer,
                                                 load_lr_scheduler_states=False, load_module_strict=strict)
        if client_state is None:
            raise FileNotFoundError(f"{path}: no checkpoint to load")
        keys = set(client_state) & {k for k, v in state.items() if v is not engine and v is not engine.optimizer}
        _move_state_into(source=client_state, destination=state, keys=keys)
        return client_state

    @staticmethod
    def _engine_in(state: dict) -> Engine:
        engines = [v for v in state.values() if isinstance(v, Engine)]
        if len(engines) != 1:
            raise ValueError(f"state: expected exactly one model set up by fabric.setup, found {len(engines)}")
        return engines[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, init in _NAMES:
            strategy_registry.register(name, cls, description=description, override=True, **init)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_file: Any,
                                               tag: str | None = None) -> dict[str, Any]:
    """A checkpoint `InfinityStrategy` saved (the directory Lightning named, holding `latest`) as
    one Lightning `.ckpt`: fp32 `state_dict` plus Lightning's keys, which
    `LightningModule.load_from_checkpoint` and `Trainer(ckpt_path=...)` for validate / test /
    predict read (no optimizer state: resume training from the directory), written one unit in
    memory at a time ([Note: a torch.save file one unit at a time]). Returns the keys written
    besides `state_dict`."""
    return convert_checkpoint(checkpoint_dir, output_file, tag)


InfinityStrategy.register_strategies(StrategyRegistry)
InfinityFabricStrategy.register_strategies(FABRIC_REGISTRY)
