"""CPU optimizers over offloaded fp32 shards (infinity._adam underneath)."""

from infinity.optim.cpu_adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from infinity.optim.cpu_adam import CPUAdam, DeepSpeedCPUAdam
from infinity.optim.cpu_lamb import CPULamb, FusedLamb
from infinity.optim.cpu_lion import CPULion, DeepSpeedCPULion
from infinity.optim.functional import (adagrad_update, adam_update, available_simd_paths, lion_update,
                                       simd_path)

__all__ = ["CPUAdagrad", "CPUAdam", "CPULamb", "CPULion", "FusedLamb", "DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion",
           "adagrad_update", "adam_update", "available_simd_paths", "lion_update", "simd_path"]
