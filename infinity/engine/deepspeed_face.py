"""DeepSpeed's engine methods that scripts, frameworks and DeepSpeed's own tests call beside
forward / backward / step (`get_lr`, `zero_grad`, `was_step_applied`, `empty_partition_cache`,
...); the getters of the config are in getters.py. A mixin of `Engine` (engine.py)."""

from __future__ import annotations

import os
from typing import Any


class DeepSpeedFace:
    """DeepSpeed's `DeepSpeedEngine` methods on an `Engine`."""

    # ---- DeepSpeed's engine surface -------------------------------------------------------

    def train(self, mode: bool = True) -> "DeepSpeedFace":
        self.module.train(mode)
        return self

    def eval(self) -> "DeepSpeedFace":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def get_mom(self) -> list[Any]:
        """Each param group's Adam betas (DeepSpeed's name)."""
        return [g["betas"] for g in self.optimizer.param_groups]

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    def destroy(self) -> None:
        """DeepSpeed's name for `close()`.

        [Note: evaluate before train in the HF Trainer]
        accelerate's `free_memory()` destroys the engine it prepared last, and the Hugging Face
        Trainer (5.x) calls it at the start of `train()`. After an `evaluate()` under ZeRO-3 that
        engine is the evaluation's, which the Trainer then keeps as its model for training, with
        no engine left in accelerate for `accelerator.backward` (it fails there with DeepSpeed
        too). The error then says so, with what works: an evaluation inside training."""
        if self.inference:
            self.lifecycle.closed_note = (
                "; it was the engine of an evaluation (no optimizer), destroyed by accelerate's free_memory(): the "
                "Hugging Face Trainer's train() after evaluate() under ZeRO-3 keeps training through it, and "
                "accelerate has no engine left for backward (with DeepSpeed too). For a baseline evaluation, give "
                "TrainingArguments(eval_on_start=True) (--eval_on_start), which evaluates with the training engine")
        self.close()

    # DeepSpeed's getters of the config are in infinity/engine/getters.py (ConfigGetters).
    def was_step_applied(self) -> bool:
        """Whether the last `step()` at an accumulation boundary updated the parameters (False
        when fp16 overflow skipped it)."""
        return self._step_applied

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: gives back the memory of every gathered unit not in use (kept for reuse or
        read ahead); persistent ones stay. The next use gathers them again."""
        self.lifecycle.check_open()
        self.fetcher.release_idle()

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping; None before the first)."""
        return self._grad_norm

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save: whether a framework's
        save_model may gather the whole 16-bit state dict (accelerate asks before it calls
        `_zero3_consolidated_16bit_state_dict`, and refuses to save weights when false)."""
        return self.config.zero.stage3_gather_16bit_weights_on_model_save
