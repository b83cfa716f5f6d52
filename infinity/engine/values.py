"""Full values of partitioned parameters: a unit's whole fp32 masters, compute-dtype values or
optimizer state gathered from every rank's shards, new values written into them, and the state
dicts built from them (`state_dict()` of the model, `consolidated_state_dict`, DeepSpeed's
`_zero3_consolidated_16bit_state_dict`). What `GatheredParameters`, `safe_get_full_*` and the
exports read. A mixin of `Engine` (engine.py)."""

from __future__ import annotations

import torch
from torch import nn

from infinity.engine.module_face import named_state
from infinity.zero.unit import Unit, UnitState


class FullValues:
    """Reading and writing an `Engine`'s parameters whole."""

    # ---- full values of partitioned parameters --------------------------------------------

    def _local_fp32(self, unit: Unit) -> torch.Tensor:
        """This rank's shard in fp32: the masters of the trainable part, the compute-dtype values
        of the frozen part (frozen parameters have no master)."""
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        shard = torch.empty(unit.shard_numel, dtype=torch.float32)
        parts = unit.split(shard)
        if unit.trainable:
            parts.train.copy_(self.optim_state.read(unit, "master"))
        if unit.frozen_shard_numel:
            parts.frozen.copy_(unit.split(self.params.host_copy(unit)).frozen)
        return shard

    def _gather_full(self, unit: Unit, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard` of the unit, as a full flat buffer on the CPU (all ranks call it)."""
        shard = self.accelerator.move(shard)
        full = torch.empty(unit.padded_numel, dtype=shard.dtype, device=self.device)
        return self.accelerator.host(unit.gather_into(full, unit.split(shard)))

    def full_compute_values(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat buffer in the compute dtype on the CPU; all ranks call it."""
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        return self._gather_full(unit, self.params.host_copy(unit))

    def full_fp32_values(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat buffer in fp32 on the CPU (masters where trainable); all ranks call it."""
        return self._gather_full(unit, self._local_fp32(unit))

    def full_optimizer_values(self, unit: Unit, kind: str) -> torch.Tensor | None:
        """The unit's full flat buffer (fp32, CPU, the trainable region filled) of one kind of
        optimizer state: "master", "exp_avg", "exp_avg_sq", or "grad" (the accumulated gradient,
        between the backward that ends an accumulation and `step()`). None for a unit without
        trainable parameters, or a gradient no longer kept. All ranks call it."""
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        if not unit.trainable:
            return None
        if kind == "grad":
            if self.update_in_backward:
                raise RuntimeError(
                    "safe_get_full_grad: the gradients were used by the update during backward and are not "
                    "kept (gradient_clipping is 0 and fp16 is off); set gradient_clipping > 0 to keep them "
                    "until step()")
            local = self.optim_state.read(unit, "grad") if self.lifecycle.grads_final else None
            if local is None:
                return None
            local = local / self.get_loss_scale()
        elif kind == "master":
            local = self.optim_state.read(unit, "master")
        else:
            local = self.optim_state.read(unit, kind)
        shard = torch.zeros(unit.shard_numel, dtype=torch.float32)
        unit.split(shard).train.copy_(local)
        return self._gather_full(unit, shard)

    def gather_for_user(self, unit: Unit) -> None:
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        unit.to_gathered(self.params.fetch(unit), fresh=True)  # views may outlive the release
        self.params.done(unit)

    def release_for_user(self, unit: Unit) -> None:
        unit.to_released()

    def set_unit_values(self, unit: Unit, shard: torch.Tensor) -> None:
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        shard = self.accelerator.host(shard)
        if unit.trainable:  # the values were written in the compute dtype; fp32 keeps them exactly
            self.optim_state.write(unit, {"master": unit.split(shard).train.to(torch.float32)})
        self.policy.write_params(unit, new_shard=shard)

    def _set_trainable_values(self, unit: Unit, master: torch.Tensor) -> None:
        """The trainable part of the unit's shard becomes `master` (this rank's, fp32) rounded."""
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        shard = self.params.host_copy(unit)
        unit.split(shard).train.copy_(master)
        self.policy.write_params(unit, new_shard=shard)

    def set_fp32_values(self, unit: Unit, full: torch.Tensor) -> None:
        """Makes `full` (the unit's full flat buffer in fp32, identical on every rank) the unit's
        values: fp32 masters of the trainable part, compute-dtype shard of both parts."""
        self.updates.run(unit)  # [Note: a unit's update] in engine/step_policy.py
        shard = unit.local_shard(full.to(torch.float32).cpu())
        if unit.trainable:
            self.optim_state.write(unit, {"master": unit.split(shard).train.clone()})
        self.policy.write_params(unit, new_shard=shard.to(unit.dtype))

    def _hook_state_dict(self, model: nn.Module) -> list:
        """`state_dict()` of the module or any submodule holds the real values ([Note: state dict
        values]); the hooks go on every module that holds parameters below it."""
        keep_vars: list[bool] = []  # one entry per module whose state_dict() is running

        def before(module, prefix, keep):
            self._check_sound("state_dict()")
            released = [p for p in module.parameters(recurse=False)
                        if id(p) in self._owner and self._owner[id(p)][0].state is UnitState.RELEASED]
            if self.world_size > 1 and not keep and released:  # gathered ones (GatheredParameters) are whole
                raise RuntimeError(
                    f"state_dict(): the model's parameters are partitioned over {self.world_size} ranks and "
                    "no rank holds them whole; call engine.consolidated_state_dict() on every rank (rank 0 "
                    "gets the full fp32 state dict), or gather them with infinity.GatheredParameters")
            keep_vars.append(keep)

        def after(module, state_dict, prefix, local_metadata):
            if not keep_vars.pop():
                for name, param in module.named_parameters(recurse=False):
                    if id(param) in self._owner and prefix + name in state_dict:
                        state_dict[prefix + name] = self._param_value(param)
            if not keep_vars:
                self._values_cache = None  # the outermost call is done: drop the copies

        handles = []
        for m in model.modules():
            if any(True for _ in m.parameters()):
                handles += [m.register_state_dict_pre_hook(before), m.register_state_dict_post_hook(after)]
        return handles

    def _param_value(self, param: nn.Parameter) -> torch.Tensor:
        """[Note: state dict values]
        A released parameter is an empty tensor, so `state_dict()` would hold 0-element tensors.
        Its hooks put in each parameter's real value instead: a CPU copy in the compute dtype,
        gathered one unit at a time; the copies are kept until the outermost call returns, so a
        tied parameter comes out as one tensor under both names. With several ranks no rank holds
        a released unit whole and `state_dict()` raises, naming what works; inside
        `GatheredParameters` every rank holds them, and it returns them."""
        if self._values_cache is None:
            self._values_cache = {}
        if id(param) not in self._values_cache:
            unit, _ = self._owner[id(param)]
            if unit.state is UnitState.GATHERED:
                full = self.accelerator.host(unit.full)
            else:
                full = self.full_compute_values(unit)
            self._values_cache.update({id(s.param): unit.param_values(full, s).clone() for s in unit.slots})
        return self._values_cache[id(param)]

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 state dict on CPU, gathered unit by unit, on rank 0 (empty elsewhere),
        under the module's state_dict names (a tiled weight whole). Under model parallelism: this
        model-parallel rank's slice, on rank 0 of its data-parallel group."""
        self._check_sound("consolidated_state_dict")
        full_values: dict[int, torch.Tensor] = {}
        for u in self.units:
            full = self.full_fp32_values(u)
            if self.rank == 0:
                for s in u.slots:
                    full_values[id(s.param)] = u.param_values(full, s).clone()
        return named_state(self.module, full_values, keep_unlisted=True) if self.rank == 0 else {}

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's: the module's state dict in the compute dtype on rank 0 (an empty dict on
        the others), parameters and persistent buffers under every name they have (tied weights
        as one tensor, a tiled weight whole). Streamed one unit at a time: the unit is gathered, its values copied to
        the host, and its full buffer dropped before the next. All ranks call it."""
        self._check_sound("_zero3_consolidated_16bit_state_dict")
        values: dict[int, torch.Tensor] = {}
        for u in self.units:
            slots = [s for s in u.slots if not (exclude_frozen_parameters and s.group < 0)]
            if slots:
                full = self.full_compute_values(u)
                values.update({id(s.param): u.param_values(full, s).clone() for s in slots if self.rank == 0})
                del full
        return named_state(self.module, values, keep_unlisted=False) if self.rank == 0 else {}
