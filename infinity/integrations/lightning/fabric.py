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
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

import infinity
from infinity.engine import Engine
from infinity.integrations.lightning.checkpoints import (_TAG, _checkpoint_above, _checkpoint_location, _checkpoint_tag,
                                                         _is_checkpoint_dir, _not_a_checkpoint)
from infinity.integrations.lightning.config import (_add_precision, _check_device_indices, _register, _split_options,
                                                    _user_config, _zero_stage)
from infinity.integrations.lightning.precision import InfinityFabricPrecision, _precision_name
from infinity.integrations.lightning.single_file import load_full_weights
from infinity.integrations.lightning.trainer import _engine_of

log = logging.getLogger("infinity")

# DeepSpeed's engine state keys, which its save merges the client state into (Lightning warns of them)
DEEPSPEED_STATE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "lr_scheduler",
                        "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
                        "dp_world_size", "mp_world_size", "ds_config", "ds_version"}


_CLIPPING = ("gradient clipping: the engine clips by the global norm in its step, as DeepSpeed handles gradient "
             "clipping automatically within the optimizer. Make sure to set the `gradient_clipping` value in your "
             "Config.")


class InfinityFabricStrategy(FabricDDPStrategy):
    """Fabric's side: `fabric.setup(model, optimizer)` builds the engine and returns it with its
    optimizer, whose `step()` (through Fabric) is `engine.step()`; `fabric.backward(loss)` is
    `engine.backward(loss)`; `fabric.save` / `fabric.load` go through the engine's checkpoints
    (the other objects of the state are its client state). Gradient accumulation and clipping
    come from the config (`gradient_accumulation_steps`, `gradient_clipping`), as for DeepSpeed;
    call `optimizer.step()` after every `fabric.backward`. Arguments as InfinityStrategy's; a raw
    state dict or a plain checkpoint file loads into the engine ([Note: plain checkpoints in
    Fabric])."""

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
        self.remote_device = remote_device
        self.exclude_frozen_parameters = exclude_frozen_parameters
        log.setLevel(logging_level)
        self._engine: Engine | None = None
        # accumulation boundaries come from the config (gradient_accumulation_steps), as for
        # DeepSpeed: fabric.no_backward_sync(model) warns and does nothing, as with DeepSpeedStrategy
        self._backward_sync_control = None

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
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # Fabric has no loader to read it from
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
        raise NotImplementedError("InfinityFabricStrategy does not support setting up the module and optimizer(s) "
                                  "independently: the engine takes the optimizer with the model, "
                                  "fabric.setup(model, optimizer)")

    def _setup_distributed(self) -> None:
        _check_device_indices(self.parallel_devices)
        super()._setup_distributed()

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
        raise NotImplementedError(_CLIPPING)

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_CLIPPING)

    def save_checkpoint(self, path: Any, state: dict, storage_options: Any = None, filter: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options: `DeepSpeedStrategy.save_checkpoint(..., storage_options=...)` is not "
                            "supported, and neither is InfinityFabricStrategy's: the engine writes its checkpoint "
                            "itself, without a CheckpointIO plugin")
        if filter is not None:
            raise TypeError("filter: InfinityFabricStrategy manages the state serialization internally (the engine "
                            "writes the model and optimizer a unit at a time); save without a filter")
        engine = self._engine_in(state)
        path = self.broadcast(path)
        rest = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        colliding = sorted(set(rest) & DEEPSPEED_STATE_KEYS)
        if colliding:
            rank_zero_warn("Your state has keys that collide with DeepSpeed's internal engine state: "
                           f"{', '.join(colliding)}. DeepSpeed would overwrite them with its own when saving "
                           "(infinity keeps the client state apart, but the names mislead): consider renaming them")
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        engine.save_checkpoint(path, tag=_TAG, client_state=rest,
                               exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(state, torch.optim.Optimizer):
            if self._engine is not None and state is self._engine.optimizer:
                raise NotImplementedError("state: an optimizer's state from a file cannot be loaded into the engine's "
                                          "offloaded optimizer; load an infinity checkpoint directory with "
                                          "fabric.load(path, {'model': model, 'optimizer': optimizer})")
            # an optimizer of Fabric's own (not the engine's): its state dict loads as without infinity
            return super().load_checkpoint(self.broadcast(path), state, strict, weights_only)
        saved_here = _is_checkpoint_dir(path)
        plain_file = os.path.isfile(os.fspath(path)) and _checkpoint_above(path) is None
        if isinstance(state, (nn.Module, Engine)) or (state and plain_file):
            return self._load_file(os.fspath(self.broadcast(path)), state, strict, weights_only)
        if not state:
            raise ValueError(f"state: Got DeepSpeedStrategy.load_checkpoint(..., state={state!r}) (here "
                             "InfinityFabricStrategy's): the engine loads into the model fabric.setup returned, so "
                             "pass a dict holding it (and its optimizer to load the optimizer state)")
        load_dir, tag = (path, _checkpoint_tag(path)) if saved_here else _checkpoint_location(path)
        engine = self._engine_in(state)
        with_optimizer = any(v is engine.optimizer for v in state.values())
        _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=with_optimizer,
                                                 load_lr_scheduler_states=False, load_module_strict=strict)
        if client_state is None:
            raise _not_a_checkpoint(path)
        keys = set(client_state) & {k for k, v in state.items() if v is not engine and v is not engine.optimizer}
        _move_state_into(source=client_state, destination=state, keys=keys)
        return client_state

    def _load_file(self, path: str, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """[Note: plain checkpoints in Fabric] A raw state dict (`fabric.load_raw(path, model)`) or a
        plain `torch.save`d checkpoint (`fabric.load(path, {"model": model, ...})`, written
        without infinity) read into the engine, one module's parameters gathered at a time with
        rank 0's values (`load_full_weights`); other objects of `state` get their entries as
        Fabric gives them. An optimizer's entry is refused: its state cannot become the
        engine's offloaded one. Returns what the file holds beyond `state`."""
        checkpoint = torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)
        if isinstance(state, (nn.Module, Engine)):
            self._load_module(state, checkpoint, strict)
            return {}
        engine = self._engine_in(state)
        for key, obj in state.items():  # everything checked before anything is loaded
            if key not in checkpoint and strict:
                raise KeyError(f"{path}: no {key!r} in the checkpoint (it holds {sorted(checkpoint)}); "
                               "load with strict=False to skip it")
            if key in checkpoint and obj is engine.optimizer:
                raise NotImplementedError(f"state[{key!r}]: an optimizer's state from a file cannot be loaded into "
                                          "the engine's offloaded optimizer; leave it out of the state")
        for key, obj in state.items():
            if key not in checkpoint:
                continue
            if isinstance(obj, (nn.Module, Engine)):
                self._load_module(obj, checkpoint[key], strict)
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(checkpoint[key])
            else:
                state[key] = checkpoint[key]
        return {k: v for k, v in checkpoint.items() if k not in state}

    def _load_module(self, module: nn.Module | Engine, state_dict: Any, strict: bool) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"the checkpoint's entry for the model: expected a state dict, got {type(state_dict).__name__}")
        target = module.module if isinstance(module, Engine) else module
        load_full_weights(target, state_dict, strict, self.is_global_zero)
        if isinstance(module, Engine):
            module.after_load()

    @staticmethod
    def _engine_in(state: dict) -> Engine:
        """The one engine among the state's values (or inside a module among them)."""
        engines = [v for v in state.values() if isinstance(v, Engine)]
        engines += [m for v in state.values() if isinstance(v, nn.Module) for m in v.modules() if isinstance(m, Engine)]
        if not engines:
            raise ValueError("state: Could not find a DeepSpeed model in the provided checkpoint state: expected "
                             "the model fabric.setup returned (an infinity Engine) among its values")
        if len(engines) > 1:
            raise ValueError(f"state: Found multiple DeepSpeed engine modules in the given state ({len(engines)}): "
                             "save or load one model set up by fabric.setup at a time")
        return engines[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register(cls, strategy_registry)
