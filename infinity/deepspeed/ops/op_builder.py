"""`deepspeed.ops.op_builder`: DeepSpeed's builders of the ops infinity has. Infinity compiles its
extensions at `pip install`, so `load()` returns what is already built: `AsyncIOBuilder` the aio
handle's module, `CPUAdamBuilder` / `CPUAdagradBuilder` / `CPULionBuilder` the optimizers'
modules (`deepspeed.ops.adam` and friends, whose classes are the public face: DeepSpeed's raw
C++ entry points such as `create_adam` are not provided), and `FusedAdamBuilder` the module of
`FusedAdam` (torch's Adam, fused on CUDA, so usable on the CPU too). `compatible_ops()` is what
`deepspeed.ops.__compatible_ops__` reports."""

from __future__ import annotations

import importlib

from infinity.io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "compatible_ops"]


class _Builder:
    """One op, built with the package: `load()` returns its module."""

    NAME = ""
    MODULE = ""

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True):
        return importlib.import_module(self.MODULE)


class CPUAdamBuilder(_Builder):
    NAME = "cpu_adam"
    MODULE = "infinity.deepspeed.ops.adam"


class CPUAdagradBuilder(_Builder):
    NAME = "cpu_adagrad"
    MODULE = "infinity.deepspeed.ops.adagrad"


class CPULionBuilder(_Builder):
    NAME = "cpu_lion"
    MODULE = "infinity.deepspeed.ops.lion"


class FusedAdamBuilder(_Builder):
    NAME = "fused_adam"
    MODULE = "infinity.deepspeed.ops.adam"


def compatible_ops() -> dict[str, bool]:
    """{op name: usable in this process}, as DeepSpeed's `__compatible_ops__`."""
    ops = {AsyncIOBuilder.NAME: AsyncIOBuilder().is_compatible()}
    for builder in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder):
        ops[builder.NAME] = builder().is_compatible()
    return ops
