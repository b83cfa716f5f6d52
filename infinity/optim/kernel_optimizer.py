"""KernelOptimizer: what CPUAdam, CPUAdagrad and CPULion share as torch.optim.Optimizers over
infinity's CPU kernel (the state's creation and checks, one kernel call a step, pickling).
Each subclass names its moments and turns a param group into the kernel's hyper-parameters.

[Note: one step, one kernel call]
step() checks every parameter that has a gradient (creating the state of new ones) before it
counts any step, then passes all of them to the kernel in one call: the threads wake once per
step and share out chunks of all the tensors ([Note: one region per batch] in
csrc/adam/updater.h), on torch's own OpenMP threads where torch runs on OpenMP ([Note:
torch's OpenMP team] in csrc/adam/openmp_team.h). With one call per parameter on a pool of
our own, a step over 100M parameters in six tensors run right after torch's fused AdamW step
was 0.95x its speed (quartiles 0.92-0.97, 2 threads; bench/bench_adam.py, public API side by
side), though the kernel alone was not slower. A parameter that fails its checks raises
before any step is counted or any parameter changes.

[Note: half-precision parameters]
bf16 and fp16 parameters (as DeepSpeed's CPU optimizers take them) get an fp32 copy in their
state ("master"), made at their first step; the kernel updates master and moments with fp32
arithmetic and writes the rounded value into the parameter in the same pass, so no precision
is lost between steps. DeepSpeed instead updates the half-precision value itself, rounding it
every step: the two agree on the first step and drift apart by rounding after it.

[Note: moment dtype]
`fp32_optimizer_states` is a param-group key (so it is in `defaults`, where the engine reads
it, and saved with the groups): True keeps a group's moments in fp32, False in bf16 ([Note:
bf16 moments] in csrc/adam/adam.h); the master stays fp32. torch's load_state_dict casts every
loaded state tensor to its parameter's dtype, so a moment may arrive in another dtype than its
group asks for: it is converted at the parameter's next step (bf16 to fp32 exactly, fp32 to
bf16 rounded to nearest even), as is a master that arrives in half precision. DeepSpeed's
keyword keeps the moments in the parameter's dtype when False (fp32 for fp32 parameters); here
False means bf16 for every parameter, as the engine's `fp32_optimizer_states` does.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

import torch

from infinity._native import _adam
from infinity.optim.functional import check_tensor, kernel_job, simd_path, torch_thread_updater

__all__ = ["KernelOptimizer"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ParamEntry = tuple[dict[str, Any], torch.Tensor, dict[str, Any]]  # (group, param, its state)


class KernelOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step is one call of infinity's CPU kernel over every parameter
    that has a gradient ([Note: one step, one kernel call]).

    Subclasses set `name` (the prefix of error messages) and `moment_keys`, the state keys
    passed as the kernel's exp_avg and exp_avg_sq (None where the rule has no such moment), and
    implement `_check_group` and `_hyper`.
    """

    name: ClassVar[str]
    moment_keys: ClassVar[tuple[str | None, str | None]]

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any], *,
                 num_threads: int | None, fp32_optimizer_states: bool) -> None:
        defaults = dict(defaults, fp32_optimizer_states=bool(fp32_optimizer_states))
        self._check_group(defaults)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"{self.name}: num_threads must be >= 1, got {num_threads}")
        self._num_threads = num_threads
        self._updater = torch_thread_updater()
        super().__init__(params, defaults)

    @property
    def fp32_optimizer_states(self) -> bool:
        """The default moment format of new groups ([Note: moment dtype])."""
        return bool(self.defaults["fp32_optimizer_states"])

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises ValueError for a hyper-parameter out of range or an option the rule lacks."""
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any], step: int) -> _adam.HyperParams:
        """The kernel's hyper-parameters of `group` at `step`."""
        raise NotImplementedError

    def _complete_group(self, group: dict[str, Any]) -> None:
        """Adds the keys of ours that a group saved by another optimizer (torch's) lacks."""
        group.setdefault("fp32_optimizer_states", self.defaults.get("fp32_optimizer_states", True))

    def _initial_moment(self, group: dict[str, Any]) -> float:
        """The value the moments start at."""
        return 0.0

    def _adopt_state(self, state: dict[str, Any]) -> None:
        """Renames the keys of a state saved by another optimizer (DeepSpeed's) to ours."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(self.param_groups[index])
            for i, p in enumerate(self.param_groups[index]["params"]):
                where = f"{self.name}: param_groups[{index}]['params'][{i}]"
                if isinstance(p, torch.Tensor) and p.is_meta:
                    # built under infinity.Init and not yet initialised: accelerate hands such
                    # parameters to a DeepSpeedCPUAdam before `initialize` builds them, and the
                    # engine takes only the groups; a step on them is refused by the step's checks
                    check_tensor(where, p.new_empty(0, device="cpu"), _PARAM_DTYPES, None)
                    continue
                check_tensor(where, p, _PARAM_DTYPES, None)
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_updater"):  # unpickled: torch's __getstate__ keeps no attribute
            self._updater = torch_thread_updater()
            self._num_threads = None
        for group in self.param_groups:
            self._complete_group(group)
            self._check_group(group)

    def _prepare(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """Creates the state of `p` at its first step, brings its tensors to the dtypes of its
        group ([Note: moment dtype]) and checks them."""
        keys = [k for k in self.moment_keys if k is not None]
        dtype = torch.float32 if group["fp32_optimizer_states"] else torch.bfloat16
        self._adopt_state(state)
        if any(k not in state for k in keys):
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            for k in keys:
                state[k] = torch.full_like(p, self._initial_moment(group), dtype=dtype,
                                           memory_format=torch.preserve_format)
            if p.dtype != torch.float32:  # [Note: half-precision parameters]
                state["master"] = p.detach().to(torch.float32, copy=True)
        wanted = {k: dtype for k in keys}
        if "master" in state:
            wanted["master"] = torch.float32
        for k, want in wanted.items():
            if state[k].dtype != want:  # loaded in the parameter's dtype ([Note: moment dtype])
                state[k] = state[k].to(want)
        n = p.numel()
        check_tensor(f"{self.name}: param.grad", p.grad, (p.dtype, torch.float32), n)
        for k in keys:
            check_tensor(f"{self.name}: state['{k}']", state[k], (dtype,), n)

    def _update(self, params: list[ParamEntry]) -> None:
        """One step of every (group, param, state) in one kernel call ([Note: one step, one
        kernel call])."""
        for group, p, state in params:
            self._prepare(group, p, state)
        simd = simd_path()  # raises for a bad $INFINITY_SIMD before any step is counted
        _count_steps([state for _, _, state in params])
        hypers: dict[tuple[int, int], _adam.HyperParams] = {}  # one per group and step count
        jobs = []
        first, second = self.moment_keys
        for group, p, state in params:
            step = int(state["step"])
            hyper = hypers.get((id(group), step))
            if hyper is None:
                hyper = hypers[id(group), step] = self._hyper(group, step)
            half = p.dtype != torch.float32  # [Note: half-precision parameters]
            jobs.append(kernel_job(hyper, state["master"] if half else p, p.grad,
                                   state[first] if first else None, state[second] if second else None,
                                   half_out=p if half else None, offset=0, count=p.numel()))
        num_threads = self._num_threads or torch.get_num_threads()
        self._updater.update_many(jobs, num_threads=num_threads, simd=simd)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if state and not isinstance(state["step"], torch.Tensor):  # saved by DeepSpeed: an int
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                params.append((group, p, state))
        self._update(params)
        return loss


def _count_steps(states: list[dict[str, Any]]) -> None:
    """Adds one to every state's step: torch's float tensors in one call (as torch's own
    optimizers do), DeepSpeedCPUAdam.step_subgroup's Python ints ([Note: sub-group steps] in
    cpu_adam.py) one by one."""
    tensors = [s["step"] for s in states if isinstance(s["step"], torch.Tensor)]
    if tensors:
        torch._foreach_add_(tensors, 1)
    for s in states:
        if not isinstance(s["step"], torch.Tensor):
            s["step"] += 1
