"""CPU Adam/AdamW, Adagrad and Lion over flat fp32 shards, SIMD path chosen at run time
(csrc/adam).

Private: use infinity.optim (adam_update, adagrad_update, lion_update, CPUAdam, CPUAdagrad,
CPULion), which check tensors before their addresses reach this module. Addresses are plain
integers (tensor.data_ptr()).
"""

import enum

class DType(enum.Enum):
    none = ...
    float32 = ...
    bfloat16 = ...
    float16 = ...
    e4m3_block = ...
    """A moment in the "8bit" format of infinity/optim/formats.py: e4m3 codes at the moment's
    address, a float scale a block of 256 at its scales' address (Job's exp_avg_scales...)."""

class Rule(enum.Enum):
    """The update rule of a job (csrc/adam/adam.h)."""

    adam = ...
    adagrad = ...
    lion = ...

class HyperParams:
    """One step's hyper-parameters; each rule reads its own (Adam all but lr_decay; Adagrad lr,
    eps, weight_decay, lr_decay, step; Lion lr, beta1, beta2, weight_decay)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float
    step: int
    adamw_mode: bool
    bias_correction: bool
    rule: Rule
    lr_decay: float
    def __init__(
        self,
        *,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_scale: float = 1.0,
        step: int = 1,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        rule: Rule = Rule.adam,
        lr_decay: float = 0.0,
    ) -> None: ...

class Job:
    """One tensor of Updater.update_many: the arguments of Updater.update. exp_avg and
    exp_avg_sq are 0 where hyper.rule has no such moment (Adagrad's sum is exp_avg_sq, Lion's
    momentum exp_avg); both hold moment_dtype elements (float32, bfloat16, or e4m3_block codes
    with their scales at exp_avg_scales / exp_avg_sq_scales, the first that of the block of
    element 0; count then ends on a block of 256 or at the buffer's end). Raises ValueError for a
    missing buffer the rule needs or a dtype a slot does not take."""

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
        moment_dtype: DType = DType.float32,
        exp_avg_scales: int = 0,
        exp_avg_sq_scales: int = 0,
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
        moment_dtype: DType = DType.float32,
    ) -> None:
        """One step of hyper.rule over `count` elements at the given addresses; the GIL is
        released. Raises ValueError for an unknown or unsupported `simd` ('' reads
        INFINITY_SIMD) and for what Job refuses."""
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

def lamb_norms(
    updater: Updater,
    param: int,
    grad: int,
    exp_avg: int,
    exp_avg_sq: int,
    count: int,
    grad_dtype: DType,
    moment_dtype: DType = DType.float32,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    num_threads: int = 1,
    simd: str = "",
) -> tuple[float, float]:
    """LAMB's first pass over `count` elements (csrc/adam/lamb.h): (sum p^2, sum u^2) in
    float64, nothing written, the same sums on every SIMD path and thread count. exp_avg and
    exp_avg_sq hold moment_dtype elements (float32 or bfloat16). The GIL is released. Raises
    ValueError for a null buffer, a dtype a slot does not take, or an unknown `simd`."""

def lamb_apply(
    updater: Updater,
    param: int,
    grad: int,
    exp_avg: int,
    exp_avg_sq: int,
    count: int,
    grad_dtype: DType,
    moment_dtype: DType = DType.float32,
    half_out: int = 0,
    half_dtype: DType = DType.none,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    step: int = 1,
    bias_correction: bool = True,
    ratio: float = 1.0,
    num_threads: int = 1,
    simd: str = "",
) -> None:
    """LAMB's second pass over `count` elements: param -= float(step_size * ratio) * u, the
    moments written (rounded to nearest even in bfloat16), the new param rounded into half_out
    when half_dtype is not none. The GIL is released; raises as lamb_norms."""
