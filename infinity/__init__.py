"""infinity: train models larger than GPU and CPU memory on one node (ZeRO-Infinity style)."""

__version__ = "0.1.0"
