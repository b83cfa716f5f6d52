"""CPU optimizers over offloaded fp32 shards (infinity._adam underneath)."""

from infinity.optim.cpu_adam import CPUAdam, DeepSpeedCPUAdam
from infinity.optim.functional import adam_update, available_simd_paths, simd_path

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "adam_update", "available_simd_paths", "simd_path"]
