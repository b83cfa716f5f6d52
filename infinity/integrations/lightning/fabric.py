"""`InfinityFabricStrategy`: Fabric on the engine, with `DeepSpeedStrategy`'s arguments."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.load import _move_state_into
from torch import nn

import infinity
from infinity.engine import Engine
from infinity.integrations.lightning.checkpoints import _TAG, _checkpoint_location
from infinity.integrations.lightning.config import _add_precision, _register, _split_options, _user_config, _zero_stage
from infinity.integrations.lightning.precision import InfinityFabricPrecision, _precision_name
from infinity.integrations.lightning.trainer import _engine_of

log = logging.getLogger("infinity")


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
        _register(cls, strategy_registry)
