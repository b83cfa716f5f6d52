"""The training engine: DeepSpeed's forward / backward / step over ZeRO units (`initialize`,
which builds it from DeepSpeed's arguments, is in infinity/engine/initialize.py).

The engine is the DeepSpeed surface (the getters, state dicts, DeepSpeed's helpers);
what happens in a step is the step policy's ([Note: one step] in infinity/engine/step_policy.py),
where each unit's bytes are is the tiers', and every copy between host and device is the device
layer's ([Note: in-flight copies] in infinity/device).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.device import Device, make_device
from infinity.optim.lr_schedules import build_scheduler
from infinity.optim.rules import STREAMED
from infinity.engine.accumulation import Accumulation
from infinity.engine.checkpoint_face import CheckpointFace
from infinity.engine.deepspeed_face import DeepSpeedFace
from infinity.engine.getters import ConfigGetters
from infinity.engine.values import FullValues
from infinity.engine.module_face import ModuleSurface
from infinity.engine.lifecycle import Lifecycle, Phase
from infinity.engine.signals import SignalGate, deferred_signals
from infinity.device.timeline import TIMELINE
from infinity.zero import dist as zdist
from infinity.zero.fetcher import Fetcher
from infinity.offload.placement import resolve_max_in_cpu
from infinity.offload.schedule import StepSchedule
from infinity.zero.hooks import UnitHooks
from infinity.zero.init import DeferredInit, is_deferred
from infinity.zero.loss_scaler import LossScaler
from infinity.zero.model_parallel import ModelParallel
from infinity.offload.nvme_io import with_measured_aio
from infinity.offload.optimizer.memory import ResidentOptimizerState
from infinity.offload.optimizer.sizing import tied_tile_size
from infinity.offload.params.memory import ResidentParams
from infinity.zero.partitioner import UnitPolicy, plan_units
from infinity.zero.registry import register_units
from infinity.engine.report import StepReport
from infinity.engine.hf_models import ChunkedLoss, chunked_heads, route_gradient_checkpointing
from infinity.engine.step_policy import (PendingUpdates, StepPolicy, UpdateMode, choose_update_mode,
                                       expected_update_order, gradients_used_at_once)
from infinity.zero.head_loss import HeadLinear
from infinity.zero.tiling import TiledLinear, tied_stashes, tile_model
from infinity.zero.unit import Unit
from infinity.zero.zero_optimizer import ZeroOptimizer

log = logging.getLogger("infinity")


def _param_groups(model: nn.Module, model_parameters: Any, optimizer: Any, inference: bool) -> list[dict]:
    """What trains, in which groups: a client optimizer's own groups, as in DeepSpeed
    (`model_parameters` only builds the optimizer of the config); none for inference."""
    if optimizer is not None:
        return list(optimizer.param_groups)
    if inference:
        return []
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


class Engine(ConfigGetters, DeepSpeedFace, CheckpointFace, FullValues, ModuleSurface):
    """Wraps a module; forward, backward and step run ZeRO stage 3 (or 1/2) with offload."""

    def __init__(self, model: nn.Module, config: InfinityConfig, *, model_parameters: Any = None,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 units: UnitPolicy = None, accelerator: Device | None = None, mpu: Any = None):
        measured = config.aio.tune
        self.config = config = with_measured_aio(config)  # [Note: the disk tunes itself] in io/autotune.py
        self.accelerator = accelerator or make_device()  # every stream, event and copy ([Note: in-flight copies])
        self.model_parallel = self._join(mpu)  # sets rank and world_size: the data-parallel group's
        self.device = self.accelerator.compute
        self.module = model
        self.dtype = config.compute_dtype
        self._init_counters()
        # [Note: engine lifecycle] in infinity/engine/lifecycle.py; [Note: signals at step boundaries] in infinity/engine/signals.py
        many = zdist.world_size(everyone=True) > 1  # signals are agreed over the whole job
        self.lifecycle = Lifecycle(SignalGate(agree=self._agree_on_signals if many else None))
        self.accumulation = Accumulation(config.batch.gradient_accumulation_steps, self.lifecycle)
        groups, tiles = self._init_optimizer(model, model_parameters, optimizer, lr_scheduler)

        zero = config.zero
        self.units, modules = self._build_units(model, groups, units)
        if self.optimizer.rule.two_pass:  # LAMB's per-tensor norms ([Note: LAMB's two passes])
            self.optimizer.rule.bind(self.units, tiles)
        auto_budgets = [section for section in ("offload_param", "offload_optimizer")
                        if getattr(config.zero, section).max_in_cpu == "auto"]
        # [Note: host memory before the disk]; the mode is that of NVMe state, the one it sizes
        in_backward = self._update_mode(updates_can_wait=True) is UpdateMode.IN_BACKWARD
        self.config = config = resolve_max_in_cpu(config, self.units, rule=self.optimizer.rule, in_backward=in_backward)
        self.params = self._param_tier()
        self.optim_state, self.schedule = self._optimizer_tier()
        self.chosen = self._choices(measured, auto_budgets)
        # Decided once, read by the tiers and the policy ([Note: update modes] in engine/step_policy.py).
        self.update_mode = self._update_mode(self.optim_state.updates_can_wait)
        self._partition(model)
        self.updates = PendingUpdates(self.params, self.optim_state, self.lifecycle, self.schedule)  # [Note: a unit's update] in engine/step_policy.py
        self.optimizer.bind(self.optim_state, self.units, self._set_trainable_values, self.updates.run_all)
        self.trainable_numel = sum(s.numel for u in self.units for s in u.slots if s.group >= 0)
        self.frozen_numel = sum(s.numel for u in self.units for s in u.slots if s.group < 0)
        self.fetcher = Fetcher(self.units, self.params, zero, self.updates, self.schedule)
        self.policy = StepPolicy(self.units, self.params, self.optim_state, self.fetcher, self.updates, self.optimizer,
                                 self.accelerator, self.accumulation, mode=self.update_mode, clip=config.gradient_clipping, scaler=self.scaler,
                                 skip_nonfinite=config.bf16.check_grad_overflow, model_parallel=self.model_parallel)
        self.hooks = UnitHooks(self.units, modules, self.fetcher, self.policy.on_unit_grads,
                               outside_backward=self._backward_outside_engine,
                               between=self.optim_state.poll if self.optim_state.updates_can_wait else None)
        self.report = StepReport(wall_clock_breakdown=config.wall_clock_breakdown,
                                 steps_per_print=config.steps_per_print, rank=zdist.rank(everyone=True))
        self._attach(model)
        log.info("infinity: %d units, %d trainable and %d frozen parameters", len(self.units),
                 self.trainable_numel, self.frozen_numel)

    # ---- construction ---------------------------------------------------------------------

    def _init_counters(self) -> None:
        """The step counters and per-run records, as a new engine has them."""
        self.global_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._step_applied = False
        self.global_samples = 0  # samples over all ranks in the steps taken (DeepSpeed's counter)
        self.training_dataloader: Any = None  # initialize(training_data=...)'s loader
        self._values_cache: dict[int, torch.Tensor] | None = None  # [Note: state dict values]
        self.last_checkpoint: dict[str, Any] | None = None  # path, bytes, seconds, gbps of the last save
        self._tracing = False  # recording the timeline for config.trace ([Note: the timeline])
        self._trace_from = 0  # the first step recorded; 0 until the timeline starts (once per engine)

    def _init_optimizer(self, model: nn.Module, model_parameters: Any, optimizer: torch.optim.Optimizer | None,
                        lr_scheduler: Any) -> tuple[list[dict], dict[int, list[nn.Parameter]]]:
        """The param groups (the model adapted to them: its tiles, returned with them), the
        optimizer over the shards, its scheduler and fp16's loss scaler. Without an optimizer
        (none passed, no config section) the engine is for inference, as DeepSpeed's: every
        parameter is frozen and backward is an error."""
        config = self.config
        self.inference = optimizer is None and config.optimizer is None
        groups = _param_groups(model, model_parameters, optimizer, self.inference)
        tiles = self._adapt_model(model, groups)
        self.optimizer = ZeroOptimizer(groups, config.optimizer, optimizer)
        if self.optimizer.rule.client and config.zero.offload_optimizer.device == "nvme" and not self.inference:
            raise TypeError(f"optimizer: {self.optimizer.rule.name} runs with its own step() over the shards only with "
                            "the optimizer state in memory (zero_optimization.offload_optimizer.device \"none\" or "
                            f"\"cpu\"); the optimizers whose state streams to NVMe are {', '.join(STREAMED)}")
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and config.scheduler is not None:
            self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer)
        self.scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        return groups, tiles

    def _join(self, mpu: Any) -> ModelParallel | None:
        """Joins the job (initialising torch.distributed if needed) and takes the group ZeRO
        partitions over: every rank, or the mpu's data-parallel group ([Note: model parallelism]
        in zero/model_parallel.py); sets `rank` and `world_size` in that group."""
        zdist.init_distributed(nccl=self.accelerator.name == "cuda")
        model_parallel = ModelParallel(mpu) if mpu is not None else None
        zdist.set_data_parallel_group(model_parallel and model_parallel.dp_group, self)
        self.rank, self.world_size = zdist.rank(), zdist.world_size()
        return model_parallel

    def _partition(self, model: nn.Module) -> None:
        """Each unit's first shard into its tiers, materialising a model built under Init unit by
        unit ([Note: deferred initialisation]); the module's own copies are freed as it goes."""
        deferred = DeferredInit(model) if is_deferred(model) else None
        for u in self.units:
            if deferred is not None:
                deferred.materialize([s.param for s in u.slots])
            shard = u.initial_shard()
            if u.trainable:  # [Note: frozen parameters] in unit.py: no optimizer state
                self.optim_state.add(u, shard[:u.train_shard_numel])
            self.params.add(u, shard)
            u.bind_params()
            del shard
        if deferred is not None:
            deferred.finish()

    def _attach(self, model: nn.Module) -> None:
        """The last of construction: persistent units gathered, buffers moved to the device, the
        parameters registered as partitioned and state_dict hooked."""
        for u in self.units:
            if u.persistent:
                self.fetcher.acquire(u)
        self.fetcher.begin_step()
        for module in model.modules():  # buffers; parameters are empty until gathered
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = self.accelerator.move(buf)  # noqa: SLF001 (what Module.to does)
        register_units(self, self.units)
        self._owner = {id(s.param): (u, s) for u in self.units for s in u.slots}
        self._state_dict_hooks = self._hook_state_dict(model)

    def _adapt_model(self, model: nn.Module, groups: list[dict]) -> dict[int, list[nn.Parameter]]:
        """What the engine changes in the user's model before its units are planned: its large
        weights tiled (stage 3, before the groups are read: the tiles train in the weight's place),
        the chunked loss, and Hugging Face's gradient checkpointing routed through infinity's.
        Returns the tiles (`tile_model`)."""
        zero = self.config.zero
        tied = (tied_tile_size(zero.tile_size, zero.sub_group_size, zero.offload_optimizer.buffer_count)
                if zero.offload_optimizer.device == "nvme" else None)  # [Note: a tied weight's tiles] in offload/optimizer/sizing.py
        tiles = tile_model(model, zero.tile_size, groups, tied_size=tied) if zero.stage == 3 else {}
        self._tied_tile = (tied if tied is not None and tied < zero.tile_size
                           and tied_stashes([model]) else None)
        self._chunked_losses = self._chunk_losses(model)
        route_gradient_checkpointing(model)  # [Note: Hugging Face's gradient checkpointing]
        return tiles

    def _chunk_losses(self, model: nn.Module) -> list[ChunkedLoss]:
        """[Note: chunked loss for Hugging Face causal LMs] on each causal LM of `model` whose head
        is tiled or an nn.Linear without bias (given the class `HeadLinear`, so that its loss runs
        inside its own call)."""
        if not self.config.chunked_loss.enabled:
            for m in model.modules():  # a model that chunks its own loss is told to keep the logits whole
                if callable(getattr(m, "chunked_loss_head", None)):
                    m.chunk_bytes = 0
            return []
        if self.inference:
            return []
        installed = []
        for lm, head in chunked_heads(model):
            chunk = self.config.chunked_loss.chunk_bytes
            if type(head) is nn.Linear and head.bias is None:
                head.__class__ = HeadLinear
            elif not isinstance(head, (TiledLinear, HeadLinear)):
                log.info("infinity: %s computes its logits whole: its head is a %s", type(lm).__name__,
                         type(head).__name__)
                chunk = 0
            if hasattr(lm, "chunked_loss_head"):
                lm.chunk_bytes = chunk
            elif chunk:
                installed.append(ChunkedLoss(lm, chunk))
        return installed

    def _build_units(self, model: nn.Module, groups: list[dict], policy: UnitPolicy):
        zero = self.config.zero
        # [Note: frozen parameters] in unit.py: outside every group, or not requiring grad.
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"] if p.requires_grad}
        threshold = zero.stage3_param_persistence_threshold if zero.stage == 3 else 0
        plans, persistent = plan_units(model, policy, threshold)
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                raise TypeError(f"parameter {name}: only floating-point parameters can be partitioned, got {p.dtype}")
        units: list[Unit] = []
        modules: list[list[nn.Module]] = []
        every_unit_persists = zero.stage < 3  # stages 1/2: parameters stay whole on the device

        def add(name, params, unit_modules, persists):
            entries = [(n, p, group_of.get(id(p), -1)) for n, p in params]
            units.append(Unit(len(units), name, entries, self.dtype, self.device, self.rank, self.world_size,
                              persistent=persists, model_parallel=self.model_parallel is not None))
            modules.append([] if persists else unit_modules)

        for plan in plans:
            if plan.params:
                add(plan.name, plan.params, plan.modules, every_unit_persists)
        if persistent:
            add("<persistent>", persistent, [], True)
        return units, modules

    def _param_tier(self):
        offload = self.config.zero.offload_param
        if offload.device == "nvme":
            from infinity.offload.params.nvme import NvmeParams
            return NvmeParams(self.accelerator, offload, self.config.aio, rank=zdist.rank(everyone=True),
                              units=self.units,
                              prefetch_numel=self.config.zero.stage3_prefetch_bucket_size,
                              on_damage=self.lifecycle.damaged)
        return ResidentParams(self.accelerator, offload=offload.device == "cpu")

    def _optimizer_tier(self):
        """The optimizer tier, and the step's orders ([Note: the step's orders] in
        offload/schedule.py), which start from the order the NVMe tier's updates are expected in."""
        offload = self.config.zero.offload_optimizer
        rule = self.optimizer.rule  # [Note: update rules] in infinity/optim/rules.py
        one_pass = self.config.batch.gradient_accumulation_steps == 1
        if offload.device == "nvme" and any(u.trainable for u in self.units):  # else no state, no files
            from infinity.offload.optimizer.nvme import NvmeOptimizerState
            from infinity.offload.optimizer.split import split_by_budget
            # The mode wherever some state is on NVMe: a tier whose updates can wait holds it.
            mode = self._update_mode(NvmeOptimizerState.updates_can_wait)
            at_once = gradients_used_at_once(self.units, mode, self.config.batch.gradient_accumulation_steps)
            order = expected_update_order(self.units, mode)
            schedule = StepSchedule(order, at_next_use=mode is UpdateMode.AT_NEXT_USE)
            # [Note: host memory before the disk] in offload/placement.py: max_in_cpu elements stay in memory.
            return split_by_budget(self.accelerator, offload.max_in_cpu, [u for u in self.units if u.trainable], order,
                                   lambda units: NvmeOptimizerState(
                                       self.accelerator, offload, self.config.aio, self.config.zero.sub_group_size,
                                       rank=zdist.rank(everyone=True), units=units, schedule=schedule,
                                       at_next_use=mode is UpdateMode.AT_NEXT_USE, no_accumulator=at_once,
                                       on_damage=self.lifecycle.damaged, rule=rule, one_pass=one_pass),
                                   rule=rule, one_pass=one_pass), schedule
        return ResidentOptimizerState(self.accelerator, on_device=offload.device == "none",
                                      units=[u for u in self.units if u.trainable], rule=rule,
                                      one_pass=one_pass), StepSchedule([], at_next_use=False)

    def _choices(self, aio_measured: bool, auto_budgets: list[str]) -> dict[str, Any]:
        """What the engine sized itself within the config's budgets, for users and reports: the
        disk's measured aio setting, the optimizer pipeline ([Note: the pool is a budget] in
        offload/optimizer/sizing.py), "auto" budgets resolved ([Note: host memory before the disk])."""
        chosen: dict[str, Any] = {}
        aio = self.config.aio
        if aio_measured and not aio.tune:
            chosen["aio"] = {"block_size": aio.block_size, "queue_depth": aio.queue_depth,
                             "thread_count": aio.thread_count, "engine": aio.engine,
                             "min_request": aio.min_request}
        if self.optim_state.chosen is not None:
            chosen["offload_optimizer"] = self.optim_state.chosen
        for section in auto_budgets:
            chosen[f"{section}.max_in_cpu"] = getattr(self.config.zero, section).max_in_cpu
        if self._tied_tile is not None:  # [Note: a tied weight's tiles] in offload/optimizer/sizing.py
            chosen["tied_tile_size"] = self._tied_tile
        return chosen

    def _update_mode(self, updates_can_wait: bool) -> UpdateMode:
        """[Note: update modes] in engine/step_policy.py, for an optimizer tier whose updates can
        wait for the next use or not."""
        return choose_update_mode(clip=self.config.gradient_clipping, loss_scaling=self.scaler is not None,
                                  updates_can_wait=updates_can_wait, whole_tensors=self.optimizer.rule.two_pass)

    @property
    def update_in_backward(self) -> bool:
        """Whether units are updated during backward ([Note: update modes] in engine/step_policy.py)."""
        return self.update_mode is UpdateMode.IN_BACKWARD

    # ---- the training loop ----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        training = torch.is_grad_enabled()  # a training pass: its backward will follow
        opens = self.lifecycle.begin_forward(training)  # holds the signals first ([Note: engine lifecycle])
        if opens:
            self.fetcher.begin_step()
            if training:
                self.hooks.reset_backward()
                self._maybe_start_trace()
                self.policy.begin_pass(last=self.accumulation.expected())
        args, kwargs = self.accelerator.move((args, kwargs))  # inputs go where the model computes
        try:
            if opens:
                self.fetcher.ready_persistent()  # [Note: persistent units' updates] in engine/step_policy.py
            with TIMELINE.span("forward", "phase"):
                out = self.module(*args, **kwargs)
        except BaseException:  # the pass is over: nothing will run its backward
            if opens or self.lifecycle.in_pass:
                self.fetcher.end_step()
                self.hooks.reset_backward()
                self.lifecycle.forward_failed()
            raise
        if opens and not training:  # evaluation: no backward will end this pass
            self.fetcher.end_step()
        self.report.add_time("forward", time.perf_counter() - t0)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` scaled for accumulation (unless `scale_wrt_gas` is false) and by the
        fp16 loss scale; reduces gradients. Returns the loss as scaled for accumulation, as
        DeepSpeed does."""
        self.lifecycle.check_open()
        if self.inference:
            if self.lifecycle.in_pass:
                self._discard_pass("backward without an optimizer")
            raise RuntimeError("engine.backward: this engine has no optimizer (the config has no 'optimizer' section "
                               "and none was passed to initialize), so it is for inference; give one to train")
        self.policy.confirm_boundary(self.accumulation.begin_backward())  # [Note: the boundary of a pass]
        self.params.release_writes()  # the disk idles in the backward ([Note: parameter writes held for the backward])
        t0 = time.perf_counter()
        gas_scale = 1.0 / self.config.batch.gradient_accumulation_steps if scale_wrt_gas else 1.0
        scale = gas_scale
        if self.scaler is not None:
            scale *= self.scaler.scale
        try:
            with TIMELINE.span("backward", "phase"), self.hooks.running_backward():
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
                self.hooks.finish_backward()
        except BaseException:
            self._discard_pass("backward failed")
            raise
        self.fetcher.end_step()
        self.accumulation.end_backward()
        self.report.add_time("backward", time.perf_counter() - t0)
        return loss * gas_scale if gas_scale != 1.0 else loss

    def _abandon_backward(self, what: str) -> None:
        """The accumulation is abandoned: the next micro-step starts a new one, and nothing of
        this pass (gradients in flight, state read ahead) holds a buffer."""
        self.schedule.end_step()  # the gradients that became final before the failure: their order stands
        self.optim_state.abort_pass()
        self.hooks.reset_backward()
        for unit in self.units:  # what autograd accumulated before the failure, not handed on yet
            for slot in unit.slots:
                slot.param.grad = None
        last = self.accumulation.last
        if dropped := self.accumulation.abandon():
            log.warning("infinity: %s; the %d earlier micro-batches of this accumulation are discarded, and the "
                        "next micro-batch starts a new one", what, dropped)
        if self.update_in_backward and last:
            self.lifecycle.step_failed("a backward that updates units as their gradients are final failed")
        self.policy.abandon()

    def _discard_pass(self, what: str) -> None:
        """A backward that failed, or was refused before anything of it was reduced or updated:
        the pass ends and the micro-batch is discarded."""
        self._abandon_backward(what)
        self.fetcher.end_step()
        self.lifecycle.backward_failed()

    def _backward_outside_engine(self) -> None:
        """Called by the hooks at the first parameter gradient of a backward that
        `engine.backward` did not start (`loss.backward()`): nothing has been reduced or
        updated yet, so the micro-batch is discarded whole and the error says what to call."""
        self._discard_pass("a backward ran outside engine.backward()")
        raise RuntimeError("a backward through the engine's model ran outside engine.backward() (loss.backward()?): "
                           "call engine.backward(loss), which scales the loss for gradient accumulation and fp16 and "
                           "hands each unit's gradients to the partitioned optimizer; this micro-batch is discarded")

    @property
    def micro_steps(self) -> int:
        """`step()` calls (DeepSpeed's counter), a partial accumulation included."""
        return self.accumulation.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.accumulation.micro_steps = value

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-step under way (from its forward to its `step()`) ends an
        accumulation, as DeepSpeed counts (`Accumulation.is_boundary`)."""
        return self.accumulation.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the count: whether the micro-step under way (or, between micro-steps, the
        next one) ends an accumulation. accelerate calls it with its `sync_gradients` after each
        forward, before the backward, which is where the boundary takes effect ([Note: the
        boundary of a pass] in engine/step_policy.py)."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary: expected a bool, got {is_boundary!r}")
        self.accumulation.set_boundary(is_boundary)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Ends the micro-step: at an accumulation boundary applies the update (and steps the
        LR scheduler, with `lr_kwargs` as keyword arguments); counts the micro-step always."""
        applies = self.lifecycle.begin_step()
        try:
            if applies:
                self._step(lr_kwargs)
        except BaseException as e:
            self.lifecycle.end_step(ok=False, why=f"step {self.global_steps + 1} failed ({type(e).__name__}: {e})")
            raise
        finally:
            self.accumulation.count_step(applies)
        if applies:
            self.lifecycle.end_step(ok=True)  # held signal handlers run now ([Note: signals at step boundaries])

    def _agree_on_signals(self, arrived: set[int]) -> set[int]:
        """The signals any rank received ([Note: signals at step boundaries]); all ranks call it."""
        from infinity.engine.signals import HELD
        flags = torch.tensor([float(s in arrived) for s in HELD])
        flags = self.accelerator.move(flags)
        zdist.all_reduce_max(flags, everyone=True)
        return {s for s, f in zip(HELD, self.accelerator.host(flags).tolist()) if f}

    def _step(self, lr_kwargs: dict | None = None) -> None:
        t0 = time.perf_counter()
        try:
            with TIMELINE.span("step", "phase"):
                outcome = self.policy.step(self.global_steps)
        finally:  # a failed step is abandoned: the next micro-step starts a new accumulation
            self.accumulation.step_ended()
        self._step_applied = outcome.applied
        if not self.updates:  # every shard has its new values
            self.fetcher.prefetch_next_step()
        if outcome.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
        self._grad_norm = outcome.grad_norm
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.report.add_time("step", time.perf_counter() - t0)
        waits = TIMELINE.take_waits()
        update_s = waits.pop("optimizer update", 0.0)  # CPU Adam on this thread: not a wait, not hidden either
        facts = {"waits": waits, "compute_wait_s": sum(waits.values()), "optimizer_update_s": update_s, "grad_norm": outcome.grad_norm, "loss_scale": self.get_loss_scale(), "lr": self.get_lr(),
                 "peak_live_numel": self.fetcher.peak_live_numel,
                 "units_updated_in_backward": outcome.updated_in_backward,
                 "trainable_params": self.trainable_numel, "frozen_params": self.frozen_numel,
                 **self.params.io_stats(), **{f"optimizer_{k}": v for k, v in self.optim_state.io_stats().items()}}
        # the optimizer's bytes a step per trainable parameter, both ways ([Note: moment formats] in infinity/optim/formats.py)
        moved = facts.get("optimizer_nvme_read_bytes", 0) + facts.get("optimizer_nvme_write_bytes", 0)
        facts["optimizer"] = self.optimizer.rule.describe()
        facts["optimizer_nvme_bytes_per_param"] = moved / max(1, self.trainable_numel)
        self.report.finish_step(self.global_steps, facts, {"gather": self.fetcher.gather_seconds,
                                                           "reduce": self.hooks.reduce_seconds})
        trace = self.config.trace
        if self._tracing and self.global_steps >= self._trace_from + trace.steps - 1:
            self._write_trace()

    def _maybe_start_trace(self) -> None:
        trace = self.config.trace
        # At start_step, or at the first step after it where a resumed run begins.
        if (trace.path is not None and not self._trace_from and self.accumulation.first
                and self.global_steps + 1 >= trace.start_step):
            TIMELINE.start()
            self._tracing = True
            self._trace_from = self.global_steps + 1

    def _write_trace(self) -> None:
        """Writes the steps recorded so far ([Note: the timeline])."""
        self._tracing = False
        events = TIMELINE.stop()
        path = str(self.config.trace.path) + (f".rank{self.rank}" if self.rank else "")
        TIMELINE.write(path, events, self.rank)
        log.info("infinity: timeline of steps %d-%d written to %s (open it in https://ui.perfetto.dev)",
                 self._trace_from, self.global_steps, path)

    def close(self) -> None:
        """Releases the tiers (removes NVMe files unless asked to keep them). The engine and its
        module cannot be used afterwards: their parameters' values are gone with the tiers."""
        if not self.lifecycle.close():  # delivers the signals held, while the engine is still open
            return
        with deferred_signals() as arrived:  # what arrives now waits for the cleanup ([Note: signals during cleanup])
            try:
                self._close()
            finally:  # before the handlers run: a save they try says why there is nothing to save
                self.lifecycle.signals_in_close = list(arrived)

    @property
    def closed(self) -> bool:
        return self.lifecycle.phase is Phase.CLOSED

    def _close(self) -> None:
        if self._tracing:  # closed before the last recorded step: what was recorded
            self._write_trace()
        elif self.config.trace.path is not None and not self._trace_from:
            log.warning("infinity: trace.path %s: nothing recorded, the engine closed at step %d, before "
                        "trace.start_step %d", self.config.trace.path, self.global_steps, self.config.trace.start_step)
        self.hooks.remove()
        for chunked in self._chunked_losses:
            chunked.remove()
        for h in self._state_dict_hooks:
            h.remove()
        try:
            try:
                self.params.close()
            finally:  # a write failure raised by the first still leaves the second's files removed
                self.optim_state.close()
        except InterruptedError as e:
            # [Note: an interrupted wait at close] A Ctrl-C that lands after a write's wait returned
            # and before the handle recorded its outcome leaves that outcome unknown
            # ([Note: waiting again] in infinity/io/handle.py). The close that the interrupt leads to
            # meets it as a failed write. The stores' files go with the close, so no bytes that
            # could be read again are in doubt. Raising here would put an OSError in place of the
            # KeyboardInterrupt the user pressed for (an `infinity finetune` then exited 2, not 130).
            # Any other failure is still raised.
            log.warning("infinity: close: %s; the offload files went with the engine, so nothing that could be "
                        "read again is lost", e)

        def refuse(module, args):
            self.lifecycle.check_open()
        self.module.register_forward_pre_hook(refuse)
