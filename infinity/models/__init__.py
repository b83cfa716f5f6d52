"""Small reference models for the command line's default job and the benchmarks."""

from infinity.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
