"""Checkpoints (save, crash-safe publish, exact resume, re-sharding) and export to Hugging Face's
safetensors layout; users of the engine's API ([Note: checkpoint layout] in layout.py)."""

from infinity.checkpoint.export import consolidate
from infinity.checkpoint.layout import CheckpointError

__all__ = ["CheckpointError", "consolidate"]
