"""`deepspeed.utils`: infinity.deepspeed.utils.full_values' full-value helpers under DeepSpeed's names, and the logger."""

from infinity.deepspeed.utils.logging import log_dist, logger
from infinity.deepspeed.utils.full_values import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                            safe_set_full_fp32_param)

__all__ = ["log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param"]
