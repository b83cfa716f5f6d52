"""`deepspeed.runtime.lr_schedules`: infinity's schedules (DeepSpeed's numbers, infinity/lr_schedules.py)
and the names accelerate checks a scheduler's type against (`VALID_LR_SCHEDULES`)."""

from infinity.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["LR_RANGE_TEST", "ONE_CYCLE", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR",
           "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
