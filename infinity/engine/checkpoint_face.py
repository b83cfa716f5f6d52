"""The engine's face to checkpoints: DeepSpeed's save_checkpoint / load_checkpoint /
save_16bit_model, and the narrow protocol through which infinity/checkpoint/ reads and writes
the engine's shards and counters ([Note: the checkpoint protocol] in
infinity/checkpoint/protocol.py). A mixin of `Engine` (engine.py), which holds the state."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from infinity.checkpoint.protocol import TrainingState
from infinity.engine.lifecycle import Health
from infinity.zero.unit import Unit, UnitState


class CheckpointFace:
    """Saving, loading and exporting an `Engine`'s state."""

    # ---- checkpoints and export ([Note: checkpoint layout] in infinity/checkpoint/layout.py) --------

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's save_checkpoint: `save_dir/tag` (default `global_step<N>`), then `latest`
        names it; every rank calls it. Crash-safe ([Note: publishing a checkpoint] in
        infinity/checkpoint/files.py); `last_checkpoint` says what it cost.
        exclude_frozen_parameters: the frozen parameters' values are not saved, and a load keeps
        the model's own (Hugging Face's Trainer asks for this with PEFT models)."""
        if self.model_parallel is not None:  # [Note: model-parallel checkpoints] in checkpoint/model_parallel.py
            from infinity.checkpoint.model_parallel import save_sliced as save_checkpoint
        else:
            from infinity.checkpoint.save import save_checkpoint
        with self._held_signals():
            self.last_checkpoint = save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                                   exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """DeepSpeed's load_checkpoint: the tag `latest` names by default; returns (checkpoint
        directory, client_state), or (None, None) when `load_dir` has no `latest`. Any world size
        and offload placement loads any checkpoint of the same model ([Note: re-sharding]).
        custom_load_fn (DeepSpeed's hook for loading a whole module state dict) has nothing to
        call here, where a rank never holds the whole state: it must be None."""
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported: the values are loaded shard by "
                             "shard, never as one module state dict; pass None")
        from infinity.checkpoint.load import load_checkpoint
        with self._held_signals():
            return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                                   load_optimizer_states=load_optimizer_states,
                                   load_lr_scheduler_states=load_lr_scheduler_states,
                                   load_module_only=load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The weights as the model computes with them (bf16/fp16, or fp32), in Hugging Face's
        safetensors layout in `save_dir`; every rank calls it, rank 0 writes."""
        from infinity.checkpoint.export import save_16bit_model
        self.updates.run_all()  # [Note: a unit's update] in engine/step_policy.py
        with self._held_signals():
            return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    @contextlib.contextmanager
    def _held_signals(self):
        """A save or load runs whole: a handler (one that saves, too) waits for its end, and a
        second save or load from inside it is refused ([Note: engine lifecycle])."""
        self.lifecycle.begin_checkpoint()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.lifecycle.end_checkpoint(ok)

    def check_step_boundary(self, what: str, replaces_all: bool = False) -> None:
        """Raises unless the engine is between steps (what checkpoints read and write);
        `replaces_all`: a load of every value, which mends a half-updated state."""
        self.lifecycle.check_open()
        if not replaces_all:  # a failed write, or an update that cannot resume ([Note: failed updates] in step_policy.py)
            self.policy.check_intact(what)
        self.lifecycle.check_between_steps(what, replaces_all)
        self.updates.run_all()  # [Note: a unit's update] in engine/step_policy.py

    def _check_sound(self, what: str) -> None:
        """Half-updated or half-loaded values are exported as little as saved."""
        self.policy.check_intact(what)
        if self.lifecycle.health is not Health.SOUND:
            self.check_step_boundary(what)

    def mark_broken(self, why: str, *, until_load: bool = False) -> None:
        """The values may be half-updated: no checkpoint is taken until a step or a load succeeds
        (`until_load`: a load; a step on half-loaded values does not mend them)."""
        if until_load:
            self.lifecycle.part_loaded(why)
        else:
            self.lifecycle.step_failed(why)

    def after_load(self) -> None:
        """New values were loaded: nothing of the step before them carries over."""
        self.lifecycle.loaded()
        self.accumulation.restart()
        self._grad_norm = None
        self._values_cache = None

    # ---- the checkpoint protocol ([Note: the checkpoint protocol] in infinity/checkpoint/protocol.py) ----
    # Beside check_step_boundary, mark_broken, after_load and the full_* values: all checkpoint/ sees.

    def training_state(self) -> TrainingState:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        optimizer = {"step_count": self.optimizer.step_count, "param_groups": groups}
        if self.optimizer.rule.client:  # [Note: a client optimizer over shards] in infinity/optim/rules.py
            self.updates.run_all()
            optimizer["client"] = self.optimizer.rule.state_dict()
        return TrainingState(self.global_steps, self.skipped_steps, self.global_samples, self.micro_steps,
                             optimizer=optimizer,
                             lr_scheduler=getattr(self.lr_scheduler, "state_dict", lambda: None)(),
                             loss_scaler=self.scaler.state_dict() if self.scaler is not None else None,
                             device_rng=self.accelerator.rng_state())

    def load_training_state(self, state: TrainingState) -> None:
        self.global_steps, self.skipped_steps = state.global_steps, state.skipped_steps
        self.global_samples, self.micro_steps = state.global_samples, state.micro_steps
        if state.optimizer is not None:
            self.optimizer.step_count = state.optimizer["step_count"]
            for group, saved in zip(self.optimizer.param_groups, state.optimizer["param_groups"]):
                group.update(saved)
            if self.optimizer.rule.client and state.optimizer.get("client") is not None:
                self.optimizer.rule.load_state_dict(state.optimizer["client"])
        if state.lr_scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)
        if state.loss_scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(state.loss_scaler)
        if state.device_rng is not None:
            self.accelerator.set_rng_state(state.device_rng)

    def flush_shards(self) -> None:
        self.optim_state.flush()
        self.params.flush()

    def optimizer_kinds(self) -> tuple[str, ...]:
        return self.optimizer.rule.kinds

    def read_optimizer_shard(self, unit: Unit, kind: str) -> torch.Tensor:
        return self.optim_state.read(unit, kind)

    def read_param_shard(self, unit: Unit) -> torch.Tensor:
        return self.params.host_copy(unit)

    def write_optimizer_shards(self, unit: Unit, values: dict[str, torch.Tensor]) -> None:
        self.optim_state.write(unit, values)

    def write_param_shard(self, unit: Unit, shard: torch.Tensor) -> None:
        self.params.replace(unit, shard)

    @contextlib.contextmanager
    def replacing_shards(self):
        gathered = [u for u in self.units if u.state is UnitState.GATHERED]  # persistent ones, stages 1/2
        for u in gathered:
            u.to_released()
        try:
            yield
        finally:
            for u in gathered:
                u.to_gathered(self.params.fetch(u))
                self.params.done(u)

    def peak_gathered_bytes(self) -> int:
        """The most bytes of gathered units this rank's device has held at once (for reports)."""
        return self.fetcher.peak_live_numel * self.dtype.itemsize
