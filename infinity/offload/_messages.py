"""Pieces of user-facing messages: every user error names the config key to change, in plain sizes."""

from __future__ import annotations


def config_key(section: str, field: str) -> str:
    """`zero_optimization.<section>.<field>`; `section` is e.g. "offload_param" or "offload_optimizer"."""
    return f"zero_optimization.{section}.{field}"


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")
