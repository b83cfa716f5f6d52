"""`CudaDevice`: the two copy streams and their events ([Note: in-flight copies])."""

from __future__ import annotations

import os

import torch

from infinity.device.base import Device, InFlight
from infinity.device.timeline import profiled


def local_index() -> int:
    """The GPU of this process: LOCAL_RANK under torchrun (whoever created the process group;
    an engine started after the caller initialised NCCL must not put every rank on cuda:0)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= int(local) < count:
        raise RuntimeError(f"LOCAL_RANK={local}: this process would use GPU {local}, but {count} GPU(s) are visible; "
                           "start one process per GPU (torchrun --nproc-per-node at most the GPU count), or run "
                           "on the CPU with INFINITY_DEVICE=cpu")
    return int(local)


class CudaDevice(Device):
    """Compute on the current stream; host -> device copies on `copy_in`, device -> host on
    `copy_out`, each ordered against the compute stream by events."""

    name = "cuda"

    def __init__(self) -> None:
        index = local_index()
        torch.cuda.set_device(index)
        self.compute = torch.device("cuda", index)
        self.copy_in = torch.cuda.Stream(self.compute)  # parameter shards in, under the current unit's compute
        self.copy_out = torch.cuda.Stream(self.compute)  # gradient shards and new values out, under compute

    def to_device(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> InFlight:
        compute = torch.cuda.current_stream(self.compute)  # before the `with`, inside which copy_in is current
        with profiled("infinity::h2d"), torch.cuda.stream(self.copy_in):
            if dst is None:
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.compute)
            else:  # the compute stream may still read dst's old values
                self.copy_in.wait_stream(compute)
                dst.record_stream(self.copy_in)  # the allocator must not reuse dst under the copy
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_in)
        return InFlight(dst, src, event)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> InFlight:
        compute = torch.cuda.current_stream(self.compute)
        with profiled("infinity::d2h"), torch.cuda.stream(self.copy_out):
            self.copy_out.wait_stream(compute)  # src as the compute issued so far leaves it
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.copy_out)  # the allocator must not reuse src before the copy read it
            event = torch.cuda.Event()
            event.record(self.copy_out)
        return InFlight(dst, src, event)

    def wait_compute(self, x: InFlight) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.compute)
        compute.wait_event(x.fence)
        if x.tensor.is_cuda:
            x.tensor.record_stream(compute)  # allocated on copy_in, used on the compute stream
        return x.tensor

    def wait_host(self, x: InFlight) -> torch.Tensor:
        x.fence.synchronize()
        return x.tensor

    def done(self, x: InFlight) -> bool:
        return x.fence.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.compute)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", copy=True)  # synchronous: the host reads it next

    def pin(self) -> bool:
        return True

    def rng_state(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state(self.compute)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state, self.compute)
