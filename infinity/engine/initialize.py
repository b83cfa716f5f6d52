"""`infinity.initialize`: DeepSpeed's entry point, from its arguments to an Engine.

[Note: client optimizer and scheduler]
As in DeepSpeed's initialize, `optimizer` is a torch optimizer, a callable params -> optimizer,
or None for the config's; `lr_scheduler` is a scheduler object, a callable optimizer ->
scheduler, or None for the config's. A client scheduler (object or callable) replaces the
config's, which is then never built: building it would write its first lr into the very groups
the client's scheduler reads its base lr from. The engine's optimizer shares the client
optimizer's param-group dicts, so a scheduler object drives the update exactly when it steps
those dicts: whether it was built on the client optimizer, or on another optimizer that the
client one was built over (accelerate passes `DeepSpeedCPUAdam(optimizer.param_groups)` beside
a scheduler of the original). A scheduler object without an instantiated client optimizer is
refused (DeepSpeed asserts the same), and so is one stepping other dicts: its learning rates
would never reach the update.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from infinity.offload import activations
from infinity.engine.data_loader import TrainingDataLoader
from infinity.config import load_config
from infinity.device import Device, make_device
from infinity.engine import Engine
from infinity.zero import dist as zdist
from infinity.zero.model_parallel import ModelParallel
from infinity.zero.partitioner import UnitPolicy
from infinity.zero.registry import owner_of
from infinity.zero.zero_optimizer import ZeroOptimizer


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int | None = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None, *,
               units: UnitPolicy = None, device: torch.device | str | None = None,
               ) -> tuple[Engine, ZeroOptimizer, Any, Any]:
    """DeepSpeed's entry point, with its arguments: returns (engine, optimizer, training
    dataloader or None, lr_scheduler).

    `config` (or `config_params`) is a DeepSpeed JSON config, a dict or a path;
    `args.deepspeed_config` (or `args.deepscale_config`) is read when neither is given.
    `optimizer` may be a torch Adam/AdamW or a callable params -> optimizer; `lr_scheduler` a
    scheduler of that optimizer or a callable optimizer -> scheduler, either replacing the config's
    ([Note: client optimizer and scheduler]). `training_data` (a Dataset)
    gives a DataLoader of `train_micro_batch_size_per_gpu` (a DistributedSampler over ranks, and
    `collate_fn`). `units` (ours) overrides which modules are gathered together: a list of module
    classes or a callable (qualified_name, module) -> bool. `device` (ours) is the device a
    framework chose ("cpu", "cuda:1"; Lightning's root device): the engine computes there, and a
    contradicting INFINITY_DEVICE or GPU of this process is an error; None: INFINITY_DEVICE, else
    CUDA when present. A model given as the first positional argument is taken as `model`
    (infinity's earlier signature). A config with an `activation_checkpointing` section configures
    `infinity.checkpointing` with it (as `checkpointing.configure(deepspeed_config=config)`), and
    the checkpoints run on the engine's device.
    """
    if isinstance(args, nn.Module) and model is None:
        args, model = None, args
    if model is None:
        raise ValueError("model: expected the torch.nn.Module to train, got None")
    _check_not_partitioned(model)
    if mesh_param is not None:
        raise ValueError("mesh_param: DeepSpeed's device mesh (sequence or tensor parallelism built by DeepSpeed) is "
                         "not supported by infinity; give a model-parallel framework's groups as mpu instead")
    if config is not None and config_params is not None:
        raise ValueError("config and config_params: give one of them (config_params is DeepSpeed's older name)")
    config = config if config is not None else config_params
    in_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and in_args is not None:
        raise ValueError("args.deepspeed_config and config: the DeepSpeed config was given twice; give it one way")
    config = config if config is not None else in_args
    if config is None:
        raise ValueError("config: expected a DeepSpeed JSON config (dict or path), got None")
    accelerator = _device(device)
    cfg = load_config(config, world_size=_data_parallel_size(accelerator, dist_init_required, mpu))
    lr_scheduler, scheduler_factory = _client_scheduler(lr_scheduler, optimizer)
    optimizer = _client_optimizer(optimizer, model, model_parameters)
    engine = Engine(model, cfg, model_parameters=model_parameters, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, units=units, accelerator=accelerator, mpu=mpu)
    activations.attach(accelerator, cfg.activation_checkpointing)
    if scheduler_factory is not None:
        engine.lr_scheduler = scheduler_factory(engine.optimizer)
    loader = None
    if training_data is not None:
        loader = TrainingDataLoader(training_data, cfg.batch.train_micro_batch_size_per_gpu, engine.rank,
                                    engine.world_size, collate_fn=collate_fn)
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _data_parallel_size(accelerator: Device, dist_init_required: bool | None, mpu: Any) -> int:
    """The ranks the batch-size rule counts: every process, initialising torch.distributed unless
    told not to, or the mpu's data-parallel ranks (as DeepSpeed's with an mpu)."""
    if dist_init_required is not False:
        zdist.init_distributed(nccl=accelerator.name == "cuda")
    return ModelParallel(mpu).dp_world if mpu is not None else zdist.world_size(everyone=True)


def _device(device: Any) -> Device:
    """The engine's device: `device` as a framework chose it, checked against INFINITY_DEVICE
    and this process's GPU; else `make_device()`'s choice."""
    if device is None:
        return make_device()
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device, 'cpu' or 'cuda[:index]', got {device!r}") from None
    chosen = os.environ.get("INFINITY_DEVICE")
    if wanted.type == "cpu":
        if chosen == "cuda":
            raise ValueError("device: the CPU was asked for, but INFINITY_DEVICE=cuda; unset INFINITY_DEVICE or set "
                             "it to cpu")
        return make_device("async-test" if chosen == "async-test" else "cpu")  # the test device computes on the CPU
    if wanted.type != "cuda":
        raise ValueError(f"device: infinity computes on CUDA or the CPU, got {wanted}")
    if chosen in ("cpu", "async-test"):
        raise ValueError(f"device: {wanted} was asked for, but INFINITY_DEVICE={chosen}; unset INFINITY_DEVICE or "
                         "set it to cuda")
    accelerator = make_device("cuda")
    if wanted.index is not None and accelerator.compute != wanted:
        raise ValueError(f"device: {wanted} was asked for, but this process's GPU is {accelerator.compute} "
                         "(LOCAL_RANK, else the current CUDA device); start the process on that GPU")
    return accelerator


class _ScheduleFromCallable:
    """Holds the engine's lr_scheduler while the engine is built, so that it builds none from the
    config; the client's callable then builds the real one ([Note: client optimizer and scheduler])."""


def _client_optimizer(optimizer: Any, model: nn.Module, model_parameters: Any) -> Any:
    """The client's optimizer; a callable is called with the parameters to train."""
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    built = optimizer(list(model_parameters) if model_parameters is not None else
                      [p for p in model.parameters() if p.requires_grad])
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"optimizer: the callable returned {type(built).__name__}, expected a torch optimizer")
    return built


def _client_scheduler(lr_scheduler: Any, client_optimizer: Any) -> tuple[Any, Any]:
    """(what the Engine gets as lr_scheduler, the callable that builds it after the engine or
    None), checked as [Note: client optimizer and scheduler] says."""
    if lr_scheduler is None:
        return None, None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return _ScheduleFromCallable(), lr_scheduler
    if not isinstance(client_optimizer, torch.optim.Optimizer):
        given = "None" if client_optimizer is None else "a callable"
        raise ValueError(f"lr_scheduler: a scheduler object needs the optimizer it steps passed as optimizer=, "
                         f"got {given}; pass that optimizer, or pass a callable optimizer -> scheduler")
    groups = _stepped_groups(lr_scheduler)
    if groups is not None and not all(any(g is h for h in client_optimizer.param_groups) for g in groups):
        raise ValueError("lr_scheduler: it steps an optimizer that is not the one given to initialize() nor one "
                         "sharing its param groups, so its learning rates would never reach the update; build it "
                         "on that optimizer, or pass a callable optimizer -> scheduler")
    bound = getattr(lr_scheduler, "optimizer", None)
    if groups is not None and bound is not client_optimizer and hasattr(bound, "step"):
        # torch warns at a scheduler's first step unless its optimizer's step() ran; the engine
        # steps only the client optimizer (ZeroOptimizer.mark_stepped), and the scheduler steps
        # only after an applied update, so by then this one has been stepped through its groups.
        bound._opt_called = True  # noqa: SLF001 (torch's own flag)
    return lr_scheduler, None


def _stepped_groups(scheduler: Any) -> list[dict] | None:
    """The param-group dicts a scheduler writes its lr into (through `.optimizer`, or a wrapper's
    `.optimizer.optimizer`); None when it does not say."""
    bound = getattr(scheduler, "optimizer", None)
    for holder in (bound, getattr(bound, "optimizer", None)):
        groups = getattr(holder, "param_groups", None)
        if isinstance(groups, list):
            return groups
    return None


def _check_not_partitioned(model: nn.Module) -> None:
    """An engine empties the parameters it partitions (their values live in its tiers), and
    close() frees those tiers: such a model has nothing left to build another engine from."""
    for param in model.parameters():
        found = owner_of(param)
        if found is None:
            continue
        if found[0].closed:
            raise ValueError("model: its parameters were released by engine.close() (their values went with that "
                             "engine's tiers); build the model again (or load it again) and pass the new one")
        raise ValueError("model: its parameters are partitioned by a live engine from an earlier "
                         "infinity.initialize(); use that engine, or close it and build the model again")
