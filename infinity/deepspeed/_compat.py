"""DeepSpeed's launcher-side helpers that training scripts call around `initialize`:
`add_config_arguments` (the `--deepspeed*` command-line flags) and `init_distributed`."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import torch.distributed as dist

from infinity.device import default_dist_backend

__all__ = ["add_config_arguments", "init_distributed"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's flags to `parser` and returns it: `--deepspeed` and `--deepscale`
    (flags for the script's own use) and `--deepspeed_config` / `--deepscale_config` (the JSON
    config that `initialize(args=...)` reads)."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser: expected an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration (infinity)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="mark the run as a DeepSpeed/infinity one (for the script; the engine ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="path of the DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help="older name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="older name of --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Creates torch.distributed's default process group, as `deepspeed.init_distributed` does.

    A launcher's environment (torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is used
    when present; without one, this is a single process (rank 0 of 1 on 127.0.0.1:
    `distributed_port`). The backend is `dist_backend`, else NCCL with CUDA and gloo without.
    Nothing happens when a group exists already, unless `dist_init_required` is True, which is
    then an error. MPI discovery is not done (`auto_mpi_discovery` is accepted and ignored):
    start several processes with torchrun."""
    if dist.is_initialized():
        if dist_init_required:
            raise RuntimeError("dist_init_required: true, but torch.distributed is initialised already")
        return
    if dist_init_required is False:
        return
    the_rank = str(rank) if rank >= 0 else os.environ.get("RANK")
    the_world = str(world_size) if world_size > 0 else os.environ.get("WORLD_SIZE")
    if the_rank is None or the_world is None:
        if world_size > 1:
            raise ValueError(f"world_size: {world_size} processes need a launcher's environment (RANK, MASTER_ADDR, "
                             "MASTER_PORT); start them with torchrun")
        the_rank, the_world = "0", "1"
        os.environ.setdefault("LOCAL_RANK", "0")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = the_rank, the_world
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or default_dist_backend()
    kwargs: dict[str, Any] = {}
    if init_method:  # a file:// or tcp:// store reads no environment: it needs them passed
        kwargs.update(init_method=init_method, rank=int(the_rank), world_size=int(the_world))
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, **kwargs)
    _tell_accelerate(backend, sys._getframe(1))  # noqa: SLF001


def _tell_accelerate(backend: str, caller) -> None:
    """[Note: CPU ranks and accelerate]
    accelerate's `PartialState` (which the HF Trainer builds from TrainingArguments) finds no
    backend on a host without GPUs unless it was told `cpu` (--use_cpu): it then starts the
    process group through `deepspeed.comm.init_distributed(dist_backend=None)`, and afterwards
    takes its missing backend to mean one process, so every rank of `infinity run --num_gpus 2`
    thinks it is alone (n_gpu 1, its own batch) while torch.distributed and the engine see two.
    Called from there, this gives the state the backend the group was made with, so accelerate
    counts the group's ranks, as it does when --use_cpu is given. Nothing else is touched."""
    if caller.f_code.co_qualname != "PartialState.__init__":
        return
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and shared.get("backend", "") is None:
        shared["backend"] = backend
