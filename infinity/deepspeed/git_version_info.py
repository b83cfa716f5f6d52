"""`deepspeed.git_version_info`: what DeepSpeed's build records about itself, for infinity: the
DeepSpeed version infinity follows, no git commit, the ops infinity compiles (all of them, at
`pip install`), and the torch it runs with (DeepSpeed records the torch it was built against;
infinity's extensions are not built against torch, so this is the torch of this process)."""

from __future__ import annotations

import torch

from infinity.deepspeed._alias import DEEPSPEED_VERSION
from infinity.device import nccl_version

__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version = DEEPSPEED_VERSION
git_hash = None
git_branch = None


def _major_minor(text: str | None) -> str:
    return ".".join((text or "0.0").split("+")[0].split(".")[:2])


torch_info = {"version": _major_minor(torch.__version__), "bf16_support": True,
              "cuda_version": _major_minor(torch.version.cuda), "nccl_version": nccl_version(), "hip_version": "0.0"}


def _ops() -> dict[str, bool]:
    from infinity.deepspeed.ops import op_builder
    return dict(op_builder.compatible_ops())


installed_ops = _ops()
compatible_ops = installed_ops
