"""`deepspeed.runtime.constants`: the config keys and defaults DeepSpeed's code and tests name,
for the keys infinity reads (defaults are DeepSpeed 0.19.8's, as infinity's parser has them)."""

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 1.0
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = 10
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = False
ZERO_OPTIMIZATION = "zero_optimization"
FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # DeepSpeed's legacy name of the bf16 section
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
