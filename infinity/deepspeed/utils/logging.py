"""`deepspeed.utils.logging`: `logger` is infinity's logger (named "infinity", the one the engine
writes to), so a framework that sets DeepSpeed's log level (transformers' Trainer does) sets the
engine's; `log_dist` logs on the ranks it is given."""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["get_current_level", "log_dist", "logger", "should_log_le"]

logger = logging.getLogger("infinity")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Logs `message` with `[Rank r]` in front on the ranks listed (all when None or -1 is listed)."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at most the named one ("info", "warning", ...)."""
    level = logging.getLevelName(max_log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"max_log_level_str: expected a logging level name, got {max_log_level_str!r}")
    return get_current_level() <= level
