"""The machine `infinity estimate` fits a job to: its GPUs, memory, NVMe drive and compute
throughput, as the command line gives them or as read from this machine."""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass

import psutil
import torch

from infinity.device import gpu_memory

DEFAULT_GPU_TFLOPS = 100.0  # achieved per GPU in bf16 training, not the data sheet's peak


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """One node: its GPUs, memory and NVMe drive."""

    gpus: int
    """GPUs, one rank each; 0: a CPU-only machine (one rank; the CPU is the device)."""
    gpu_bytes: int | None
    """Memory of each GPU; None: not known, the device is not checked."""
    cpu_bytes: int
    """Host memory, shared by the node's ranks (and on a CPU-only machine by the device)."""
    nvme_free: int
    """Free bytes under nvme_path, shared by the node's ranks."""
    nvme_path: str
    nvme_gbps: float | None
    """Sustained NVMe bandwidth of the node (GB/s); None: not known."""
    tflops: float
    """Achieved compute throughput of one device (TFLOP/s)."""
    described: tuple[str, ...] = ()
    """Where the figures came from, for the header (e.g. "host memory read here")."""

    @property
    def world(self) -> int:
        return max(1, self.gpus)


def measure_cpu_tflops(seconds: float = 0.2) -> float:
    """bf16 matmul throughput of this CPU with torch's threads (TFLOP/s), timed for `seconds`."""
    n = 1024
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm-up: thread pool, kernel choice
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * n ** 3 * count / elapsed / 1e12


def machine_from_args(args: argparse.Namespace) -> Machine:
    """The machine the arguments describe; what they leave out is read from this one."""
    notes = []
    gpus = args.gpus
    if gpus is None:
        gpus = 1 if args.gpu_mem else len(gpu_memory())
        if not args.gpu_mem:
            notes.append(f"{gpus} GPUs found here" if gpus else "no GPU here: a CPU-only machine")
    gpu_bytes = args.gpu_mem
    if gpus and gpu_bytes is None and gpu_memory():
        gpu_bytes = min(gpu_memory())
        notes.append("GPU memory read here")
    cpu_bytes = args.cpu_mem
    if cpu_bytes is None:
        cpu_bytes = psutil.virtual_memory().total
        notes.append("host memory read here")
    nvme_free = args.nvme_free
    if nvme_free is None:
        nvme_free = shutil.disk_usage(args.nvme_path).free
        notes.append(f"free space of {args.nvme_path} read here")
    tflops = args.tflops
    if tflops is None:
        if gpus:
            tflops = DEFAULT_GPU_TFLOPS
            notes.append(f"{tflops:g} TFLOP/s per GPU assumed (--tflops)")
        else:
            tflops = measure_cpu_tflops()
            notes.append(f"{tflops:.3g} TFLOP/s measured on this CPU in a bf16 matmul (--tflops)")
    return Machine(gpus=gpus, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, nvme_free=nvme_free, nvme_path=args.nvme_path,
                   nvme_gbps=args.nvme_gbps, tflops=tflops, described=tuple(notes))
