"""The device interface ([Note: in-flight copies] in `infinity.device`)."""

from __future__ import annotations

import signal
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

# The signals a user's preemption handler listens for: the engine holds them during a step
# ([Note: signals at step boundaries] in infinity/engine/signals.py) and every thread of ours
# but the main one blocks them, so that the kernel hands them to the main thread.
HELD = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
             if hasattr(signal, name))


class InFlight(NamedTuple):
    """A copy issued and not yet waited for: its destination, its source (kept alive until the
    wait) and what marks it complete (a CUDA event, a threading.Event, or None when done)."""

    tensor: torch.Tensor
    source: torch.Tensor | None
    fence: Any


class Device:
    """Where units are gathered and computed, and how bytes cross between it and the host."""

    compute: torch.device  # where gathered units, activations and gradients live
    name: str

    # ---- copies ---------------------------------------------------------------------------

    def to_device(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> InFlight:
        """Starts copying host memory `src` into `dst` (a new device tensor when None)."""
        raise NotImplementedError

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> InFlight:
        """Starts copying device memory `src`, as the compute issued so far leaves it, into
        host memory `dst`."""
        raise NotImplementedError

    def wait_compute(self, x: InFlight) -> torch.Tensor:
        """Compute issued from now on may use `x.tensor` (and overwrite `x.source`)."""
        raise NotImplementedError

    def wait_host(self, x: InFlight) -> torch.Tensor:
        """Blocks until the copy is complete: the host may read `x.tensor` and reuse `x.source`."""
        raise NotImplementedError

    def done(self, x: InFlight) -> bool:
        """Whether the copy is complete, without blocking."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Blocks until the work issued on the device, compute and copies, is complete (a CPU
        computes synchronously: nothing to wait for)."""

    # ---- small, synchronous moves ---------------------------------------------------------

    def move(self, tree: Any) -> Any:
        """Every tensor in `tree` (inputs, buffers, scalars) on the compute device, synchronously."""
        return pytree.tree_map(lambda t: t.to(self.compute) if isinstance(t, torch.Tensor) else t, tree)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A synchronous host copy of a small device tensor (a norm, a checkpoint value)."""
        return t.to("cpu", copy=True)

    # ---- memory -------------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.compute)

    def pin(self) -> bool:
        """Whether host buffers must be registered with the device driver to copy asynchronously."""
        return False

    def scribble(self, buffer: torch.Tensor) -> None:
        """Called on every pool buffer handed back; the test device overwrites it."""

    # ---- random numbers (checkpoints) ---------------------------------------------------------

    def rng_state(self) -> torch.Tensor | None:
        """The device's own generator state (None where it has none beyond torch's CPU one)."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compute})"
