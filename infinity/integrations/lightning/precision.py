"""The precision plugins on the engine: `InfinityPrecision` for the Trainer and
`InfinityFabricPrecision` for Fabric, both naming the dtype the engine computes in."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
              "bf16-true": torch.bfloat16, "16-true": torch.float16}


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


class _EngineDtype:
    """What both plugins mean by a precision: the dtype the engine computes in, the model cast to
    it for "-true" precisions only, and inputs cast to it."""

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


class InfinityPrecision(_EngineDtype, Precision):
    """A precision of the Trainer on the engine: the engine computes in the dtype its config's
    bf16/fp16 section names (fp32 masters, the fp16 loss scale), so a "-mixed" precision means
    the model in that dtype, not autocast; "-true" casts the model first (its masters are then the
    cast values). Inputs are cast to that dtype. `Trainer(precision=...)` is turned into this; on
    the CPU Lightning turns "16-mixed" into "bf16-mixed" first, so pass
    `InfinityStrategy(precision_plugin=InfinityPrecision("16-mixed"))` for fp16 there."""

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning's automatic optimization has already divided the loss by accumulate_grad_batches;
        # DeepSpeed's backward divides it again, so its gradients are 1/gas^2 of plain Lightning's
        # (Lightning issue #6170; Adam hardly shows it, SGD does). The engine does not divide twice.
        if getattr(model, "automatic_optimization", True):
            kwargs.setdefault("scale_wrt_gas", False)
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


class InfinityFabricPrecision(_EngineDtype, FabricPrecision):
    """InfinityPrecision's meaning for Fabric; outputs come back in the default dtype."""

    def convert_output(self, data: Any) -> Any:
        return _cast_floats(data, torch.get_default_dtype())
