"""CPU Adam/AdamW over flat fp32 shards, SIMD path chosen at run time (csrc/adam).

Private: use infinity.optim (adam_update, CPUAdam), which checks tensors before their
addresses reach this module. Addresses are plain integers (tensor.data_ptr()).
"""

import enum

class DType(enum.Enum):
    none = ...
    float32 = ...
    bfloat16 = ...
    float16 = ...

class HyperParams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float
    step: int
    adamw_mode: bool
    bias_correction: bool
    def __init__(
        self,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_scale: float = 1.0,
        step: int = 1,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None: ...

class Job:
    """One tensor of Updater.update_many: the arguments of Updater.update."""

    count: int
    def __init__(
        self,
        hyper: HyperParams,
        param: int,
        grad: int,
        exp_avg: int,
        exp_avg_sq: int,
        count: int,
        grad_dtype: DType,
        half_out: int = 0,
        half_dtype: DType = DType.none,
    ) -> None: ...

class Updater:
    """A pool of worker threads (started on first need) that runs updates; owns no state."""

    def __init__(self, *, borrow_openmp_team: bool = False) -> None:
        """borrow_openmp_team: run on the OpenMP team of the runtime torch loaded, from the main
        thread, instead of this Updater's own threads."""
    def update_many(self, jobs: list[Job], num_threads: int = 1, simd: str = "") -> None:
        """The updates of all `jobs` in one parallel region; the GIL is released."""
    def update(
        self,
        hyper: HyperParams,
        param: int,
        grad: int,
        exp_avg: int,
        exp_avg_sq: int,
        count: int,
        grad_dtype: DType,
        half_out: int = 0,
        half_dtype: DType = DType.none,
        num_threads: int = 1,
        simd: str = "",
    ) -> None:
        """Adam step over `count` elements at the given addresses; the GIL is released.
        Raises ValueError for an unknown or unsupported `simd` ('' reads INFINITY_SIMD)."""
    def stream_inplace(
        self,
        param: int,
        grad: int,
        exp_avg: int,
        exp_avg_sq: int,
        count: int,
        num_threads: int = 1,
        simd: str = "",
    ) -> None:
        """param, exp_avg, exp_avg_sq += grad (fp32): the update's memory roofline."""

def available_simd() -> list[str]:
    """SIMD paths this CPU and OS can run, best first ('scalar' last)."""

def resolve_simd(name: str = "") -> str:
    """The path a call with simd=name runs: '' reads INFINITY_SIMD, then picks the best."""
