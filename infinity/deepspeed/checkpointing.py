"""`deepspeed.checkpointing`: infinity's activation checkpointing (infinity.checkpointing), under
DeepSpeed's module and names."""

from infinity.checkpointing import (checkpoint, configure, is_configured, non_reentrant_checkpoint,
                                    partition_activations_in_checkpoint, reset, set_num_layers)

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]
