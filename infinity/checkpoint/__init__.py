"""Checkpoints (save, crash-safe publish, exact resume, re-sharding) and export to Hugging Face's
safetensors layout ([Note: checkpoint layout] in layout.py). They see the engine through
`protocol.Checkpointable` only ([Note: the checkpoint protocol] in protocol.py)."""

from infinity.checkpoint.export import consolidate
from infinity.checkpoint.layout import CheckpointError

__all__ = ["CheckpointError", "consolidate"]
