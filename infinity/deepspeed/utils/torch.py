"""`deepspeed.utils.torch.required_torch_version`: whether the running torch's major.minor lies
within [min_version, max_version] (numbers such as 1.8 or 2.3)."""

from __future__ import annotations

import torch

__all__ = ["required_torch_version"]


def _major_minor(version: str | float) -> tuple[int, int]:
    major, minor = (str(version).split("+")[0].split(".") + ["0"])[:2]
    return int(major), int(minor)


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    running = _major_minor(torch.__version__)
    if min_version is not None and running < _major_minor(min_version):
        return False
    return max_version is None or running <= _major_minor(max_version)
