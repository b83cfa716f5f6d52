"""`deepspeed.runtime.utils.see_memory_usage`: one log line of this process's memory (the
accelerator's allocated / reserved bytes on CUDA, and the host's resident set), as DeepSpeed's
logs it when `force` is true."""

from __future__ import annotations

import logging

import psutil

from infinity.deepspeed.accelerator import get_accelerator

__all__ = ["see_memory_usage"]

log = logging.getLogger("infinity")


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    gib = 1 << 30
    parts = [message]
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        parts.append(f"MA {accelerator.memory_allocated() / gib:.2f} GB, "
                     f"Max_MA {accelerator.max_memory_allocated() / gib:.2f} GB, "
                     f"CA {accelerator.memory_reserved() / gib:.2f} GB")
    parts.append(f"CPU RSS {psutil.Process().memory_info().rss / gib:.2f} GB, "
                 f"used {psutil.virtual_memory().percent:.1f}% of host memory")
    log.info(" | ".join(parts))
