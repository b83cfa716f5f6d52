"""`deepspeed.launcher`: what integrations read of DeepSpeed's launcher (runner.py). The launcher
itself is `infinity run` (infinity.apps.launcher)."""

from infinity.deepspeed.launcher import runner

__all__ = ["runner"]
