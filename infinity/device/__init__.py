"""Every stream, event and host <-> device copy of the engine, behind one small interface.

[Note: in-flight copies]
A copy between host and device memory returns an `InFlight`: the destination paired with what
must be waited on. Nothing reads the destination, and nothing reuses or frees the source, before
the matching wait:
  * `wait_compute(x)`: the compute that is issued from now on may use `x.tensor` (on a GPU the
    compute stream waits for the copy's event; the host does not block);
  * `wait_host(x)`: the host may read `x.tensor` and reuse `x.source` (the host blocks).
`done(x)` asks without blocking. Host memory on either side of a copy is page-locked and comes
from a `BufferPool`, so that a GPU copy is asynchronous.

Three implementations, chosen by `make_device` (`INFINITY_DEVICE` overrides the choice):
  * `CudaDevice`: a copy-in stream (host -> device, overlaps compute) and a copy-out stream
    (device -> host, overlaps compute), events between them and the compute stream.
  * `CpuDevice`: host memory is device memory; copies are plain and complete at once.
  * `AsyncTestDevice`: the CPU as a device that behaves like an asynchronous one: a copy lands
    only later, on another thread, and is guaranteed only at its wait; a destination is filled
    with garbage until then, and a pool buffer handed back is scribbled over. The CPU test suite
    runs on it, so that a missing wait fails a parity test here instead of on the first GPU.

[Note: what a CPU cannot check]
The test device checks ordering: that nothing reads a copy's destination or reuses its source
before the wait. It cannot check that the copies overlap compute (that the host -> device copy of
a shard runs under the previous unit, that a gradient's copy to the host runs under the next
unit's backward, that no wait blocks the host needlessly): that is timing, measured on a GPU by
bench/, not asserted by tests. Nor can it check CUDA's own rules: `record_stream` for memory
allocated on one stream and used on another, and page-locked host memory for asynchronous copies
(both kept inside `CudaDevice`).
"""

from __future__ import annotations

import os

import torch

from infinity.device.base import Device, InFlight
from infinity.device.cpu import AsyncTestDevice, CpuDevice
from infinity.device.pinning import CudaHostRegistration
from infinity.io.memory import use_host_registration

# Host buffers are registered with the driver here, not in io/ ([Note: page-locking is the
# device layer's] in infinity/io/memory.py).
use_host_registration(CudaHostRegistration())

__all__ = ["AsyncTestDevice", "CpuDevice", "Device", "InFlight", "device_kind", "make_device", "nccl_version"]

KINDS = ("cuda", "cpu", "async-test")


def device_kind(kind: str | None = None) -> str:
    """The kind of device the engine runs on: `kind`, else $INFINITY_DEVICE, else CUDA when present."""
    kind = kind or os.environ.get("INFINITY_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in KINDS:
        raise ValueError(f"INFINITY_DEVICE: expected one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def make_device(kind: str | None = None) -> Device:
    """The device the engine runs on (`device_kind`)."""
    kind = device_kind(kind)
    if kind == "cuda":
        from infinity.device.cuda import CudaDevice
        return CudaDevice()
    if kind == "cpu":
        return CpuDevice()
    # INFINITY_ASYNC_DELAY_S: how late a copy may land and be reported
    return AsyncTestDevice(max_delay_s=float(os.environ.get("INFINITY_ASYNC_DELAY_S", "0.004")))


def default_dist_backend() -> str:
    """The process-group backend for the device the engine will run on: NCCL on CUDA (after
    putting this process on its LOCAL_RANK's GPU, which NCCL needs first), gloo otherwise, also on
    a GPU machine whose engine runs on the CPU (INFINITY_DEVICE=cpu)."""
    if device_kind() != "cuda":
        return "gloo"
    from infinity.device.cuda import local_index
    torch.cuda.set_device(local_index())
    return "nccl"


def gpu_memory() -> list[int]:
    """Total memory in bytes of each GPU this process can see (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def nccl_version() -> str:
    """NCCL's "major.minor" as torch was built with it, "0.0" without CUDA (DeepSpeed's torch_info)."""
    if not torch.cuda.is_available():
        return "0.0"
    try:
        major, minor, *_ = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "0.0"
    return f"{major}.{minor}"
