"""`deepspeed.accelerator.get_accelerator()`: DeepSpeed's accelerator object over the device
infinity runs on (`infinity.device.device_kind`: CUDA, or the CPU, also when INFINITY_DEVICE
says so on a GPU host).

It answers with torch's module for that device (`torch.cuda`, `torch.cpu`): on CUDA, `torch.cuda`'s
own answers; on the CPU, what DeepSpeed's CPU accelerator means by them where torch has nothing
to ask: device name "cpu", index 0, one device, `synchronize` a no-op, bf16 and fp16 supported,
gloo for collectives, memory counters 0 (torch keeps none for host allocations) except
`total_memory` / `available_memory`, which are the machine's.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch

from infinity.device import device_kind

__all__ = ["InfinityAccelerator", "get_accelerator", "is_current_accelerator_supported"]


class InfinityAccelerator:
    """DeepSpeed's accelerator interface, as far as transformers, accelerate and DeepSpeed's
    examples use it, for one device kind ("cuda" or "cpu")."""

    def __init__(self, kind: str):
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"kind: expected 'cuda' or 'cpu', got {kind!r}")
        self._name = kind
        self._communication_backend_name = "nccl" if kind == "cuda" else "gloo"
        self._module = importlib.import_module(f"torch.{kind}")  # torch.cuda or torch.cpu

    def __repr__(self) -> str:
        return f"InfinityAccelerator({self._name!r})"

    def _cuda(self) -> bool:
        return self._name == "cuda"

    def _optional(self, name: str, default: Any, *args: Any) -> Any:
        """`torch.<device>.<name>(*args)`, or `default` where the device module has no such call."""
        fn = getattr(self._module, name, None)
        return default if fn is None else fn(*args)

    # ---- what the device is ----------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        """Whether work completes before the call that issued it returns (the CPU)."""
        return not self._cuda()

    def device_name(self, device_index: int | str | None = None) -> str:
        if device_index is None or not self._cuda():
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return self._module.is_available()

    def device_count(self) -> int:
        return self._module.device_count()

    def current_device(self) -> int:
        return self._module.current_device() if self._cuda() else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._cuda() else self._name

    def set_device(self, device_index: int) -> None:
        if self._cuda():
            self._module.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        self._module.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- data types ------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return self._module.is_bf16_supported() if self._cuda() else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        return dtypes + [torch.bfloat16] if self.is_bf16_supported() else dtypes

    # ---- tensor constructors (DeepSpeed's XTensor properties: torch.tensor on this device) -----

    def _tensor_of(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._tensor_of(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor_of(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor_of(torch.float64))
    FloatTensor = property(lambda self: self._tensor_of(torch.float32))
    HalfTensor = property(lambda self: self._tensor_of(torch.float16))
    IntTensor = property(lambda self: self._tensor_of(torch.int32))
    LongTensor = property(lambda self: self._tensor_of(torch.int64))

    # ---- random numbers ---------------------------------------------------------------------

    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        (self._module.manual_seed if self._cuda() else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (self._module.manual_seed_all if self._cuda() else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return (self._module.initial_seed if self._cuda() else torch.initial_seed)()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if not self._cuda():
            return torch.get_rng_state()
        return self._module.get_rng_state() if device_index is None else self._module.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if not self._cuda():
            torch.set_rng_state(new_state)
        elif device_index is None:
            self._module.set_rng_state(new_state)
        else:
            self._module.set_rng_state(new_state, device_index)

    # ---- streams and events -----------------------------------------------------------------

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return self._module.Stream

    @property
    def Event(self):  # noqa: N802 (DeepSpeed's name)
        return self._module.Event

    def stream(self, stream):
        return self._module.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return self._module.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return self._optional("default_stream", None, device_index) or self.current_stream(device_index)

    # ---- memory --------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        self._optional("empty_cache", None)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._optional("memory_allocated", 0, device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._optional("max_memory_allocated", 0, device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._optional("reset_peak_memory_stats", None, device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._optional("memory_reserved", 0, device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._optional("max_memory_reserved", 0, device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._optional("reset_peak_memory_stats", None, device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return self._optional("memory_stats", {}, device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda():
            index = self.current_device() if device_index is None else device_index
            return self._module.get_device_properties(index).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda():
            return self._module.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda() else False

    # ---- profiling and amp ------------------------------------------------------------------

    def range_push(self, msg: str) -> None:
        if self._cuda():
            self._module.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda():
            self._module.nvtx.range_pop()

    def amp(self):
        return self._module.amp


_accelerator: InfinityAccelerator | None = None


def get_accelerator() -> InfinityAccelerator:
    """The accelerator of this process (one object, decided on the first call)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = InfinityAccelerator("cuda" if device_kind() == "cuda" else "cpu")
    return _accelerator


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one DeepSpeed supports: always, as infinity runs on
    the two it knows, CUDA and the CPU."""
    return get_accelerator().device_name() in ("cuda", "cpu")
