"""fp16 loss scaling with DeepSpeed's rules: a static scale, or a dynamic one that halves on
overflow (after `hysteresis` overflows) and doubles after `loss_scale_window` clean steps."""

from __future__ import annotations

from infinity.config import FP16Config


class LossScaler:
    def __init__(self, fp16: FP16Config):
        self.dynamic = fp16.loss_scale == 0
        self.scale = float(2 ** fp16.initial_scale_power) if self.dynamic else float(fp16.loss_scale)
        self.window = fp16.loss_scale_window
        self.hysteresis = fp16.hysteresis
        self.consecutive_hysteresis = fp16.consecutive_hysteresis
        self.min_scale = fp16.min_loss_scale
        self._hysteresis_left = fp16.hysteresis
        self._iter = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step with whether the gradients overflowed."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iter
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if (self._iter - self._last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= 2
        self._iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "iter": self._iter, "last_overflow": self._last_overflow,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._iter = state["iter"]
        self._last_overflow = state["last_overflow"]
        self._hysteresis_left = state["hysteresis_left"]
