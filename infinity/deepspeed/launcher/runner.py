"""`deepspeed.launcher.runner`: the name of the file of environment variables every node's ranks
get, which accelerate's launcher writes before it starts a multi-node DeepSpeed job (`infinity
run` reads the same file: [Note: what runs where] in infinity.apps.launcher)."""

import os

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
