"""Small reference models for the command line's default job and the benchmarks, and Llama-style
architectures by name (`presets`)."""

from infinity.apps.models.gpt import GPT, GPTConfig
from infinity.apps.models.presets import PRESETS, param_count, preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "param_count", "preset"]
