"""I/O errors must never hang a step or apply an update twice ([Note: failed updates] in
infinity/engine/step_policy.py): after an error reaches the user, either the engine refuses to go on
(steps and saves raise, saying to restore a checkpoint) or going on gives masters and moments
bit-identical to a run without the failure.

Real kernel errors first: strace attaches to a training job (tests/fault_job.py) once it is built
and makes its `psync` engine's Nth pread64 or pwrite64 of each I/O thread fail with EIO. Then the
same cases, deterministically, through a wrapper around the real I/O handle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config
from infinity.engine.step_policy import UpdateState
from test_tiers_faults import FaultyHandle

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "fault_job.py")
STEPS = 6
REFUSAL = "restore the run from a checkpoint"


def _strace_works(tmp_path) -> str | None:
    """None if strace can attach to a running process here, else why not."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace is not installed"
    sleeper, tracer = subprocess.Popen(["sleep", "30"]), None
    log = tmp_path / "strace-check.log"
    try:
        with open(log, "w") as f:
            tracer = subprocess.Popen([strace, "-p", str(sleeper.pid), "-e", "trace=none", "-o", os.devnull], stderr=f)
        deadline = time.monotonic() + 10
        while "attached" not in log.read_text():
            if tracer.poll() is not None or time.monotonic() > deadline:
                return f"strace cannot attach to a process here (ptrace not permitted?): {log.read_text().strip()}"
            time.sleep(0.01)
        return None
    finally:
        for proc in (sleeper, tracer):
            if proc is not None:
                proc.kill()
                proc.wait()


def _put(path: str, text: str = "") -> None:
    """Writes a control file whole: the other side sees it only once it has its contents."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Job:
    """tests/fault_job.py in rounds (see its docstring): one process, one engine per round, each
    with its own injection. A round that fails or hangs ends the process; the next starts another."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.child: subprocess.Popen | None = None
        self.starts = 0

    def _start(self) -> None:
        self.starts += 1
        self.dir = self.tmp_path / f"job{self.starts}"
        self.dir.mkdir()
        self.log = self.dir / "job.log"
        with open(self.log, "w") as log:  # the child writes to its own copy of the descriptor
            self.child = subprocess.Popen([sys.executable, JOB, str(self.dir), str(self.dir), "--steps", str(STEPS)],
                                          stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        self.r = 0

    def _path(self, name: str) -> str:
        return str(self.dir / f"{name}.{self.r}")

    def _await(self, path: str, deadline: float, what: str) -> None:
        while not os.path.exists(path):
            assert self.child.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{what}:\n{self.log.read_text()[-4000:]}"
            time.sleep(0.01)

    def round(self, spec: str, queue_depth: int = 1, tries: int = STEPS + 4, timeout: float = 90,
              **settings) -> dict:
        """Trains a new engine with `spec` (strace's -e inject=...) from once it is built until it
        has trained; returns its result.json, with the state read back as "final". Fails the test
        if the round does not end within `timeout` seconds. `settings`: the round's engine,
        persistence and phase (tests/fault_job.py)."""
        if self.child is None:
            self._start()
        deadline = time.monotonic() + timeout
        _put(self._path("round"), json.dumps({"queue_depth": queue_depth, "tries": tries, **settings}))
        tracer = None
        try:
            self._await(self._path("ready"), deadline, "the engine was not built")
            err = self.dir / f"strace.{self.r}.log"
            with open(err, "w") as f:
                tracer = subprocess.Popen(["strace", "-f", "-o", os.devnull, "-p", str(self.child.pid),
                                           "-e", f"trace={spec.split(':')[0]}", "-e", f"inject={spec}"], stderr=f)
            while "attached" not in err.read_text():  # to every thread, then says so
                assert tracer.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.01)
            _put(self._path("go"))
            self._await(self._path("trained"), deadline, f"the job hung with {spec}")
            tracer.send_signal(signal.SIGINT)  # detaches
            tracer.wait(timeout=30)
            _put(self._path("detached"))
            self._await(self._path("result") + ".json", deadline, "the state was not read back")
            with open(self._path("result") + ".json") as f:
                result = json.load(f)
            if result["state"] == "read":
                result["final"] = torch.load(self._path("state") + ".pt")
            if os.path.exists(self._path("export") + ".json"):
                with open(self._path("export") + ".json") as f:
                    result["export"] = json.load(f)
            self.r += 1
            return result
        except BaseException:
            self.close(kill=True)  # in whatever state it is: the next round starts afresh
            raise
        finally:
            if tracer is not None and tracer.poll() is None:
                tracer.kill()
                tracer.wait()

    def reference(self, timeout: float = 120, **settings) -> dict[int, dict[str, torch.Tensor]]:
        """A round without failures: {k: the state after k steps}."""
        if self.child is None:
            self._start()
        _put(self._path("round"), json.dumps({"reference": True, **settings}))
        self._await(self._path("result") + ".json", time.monotonic() + timeout, "the reference did not end")
        states = {k: torch.load(self._path(f"state_{k}") + ".pt") for k in range(1, STEPS + 1)}
        self.r += 1
        return states

    def close(self, kill: bool = False) -> None:
        if self.child is None:
            return
        if not kill:
            _put(self._path("round"), json.dumps({"stop": True}))
            try:
                self.child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.child.kill()  # nothing if it has ended
        self.child.wait()
        self.child = None


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("faults")
    why = _strace_works(tmp_path)
    if why is not None:
        pytest.skip(why)
    driver = Job(tmp_path)
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def reference(job):
    """The fault-free run's state after every applied step: {k: state}."""
    return job.reference()


@pytest.fixture(scope="module")
def reference_persistent(job):
    """The same with the default persistence threshold, under which the model is one unit."""
    return job.reference(persistence="default")


def _check(result: dict, reference: dict, spec: str, complete: bool = True, silent: bool = False) -> str:
    """The job's outcome is one of the two allowed; returns which. `complete`: a job that did not
    refuse applied every step (else it may have run out of tries, each of them an I/O error).
    `silent`: the failed call may be one the engine tries again unseen (a reap of completions,
    whose pieces are still the kernel's), so no error need reach the job."""
    events = result["events"]
    errors = [e for e in events if e[0] in ("step error", "save error", "state error", "load error")]
    assert errors or silent, f"{spec}: no error reached the job: the injection missed"
    for kind, name, message in errors:
        # An I/O error (naming the file and offset), or a refusal: never a leaked buffer's
        # TimeoutError, or an error of the error path (release of what was never fetched).
        assert name in ("OSError", "RuntimeError"), (spec, kind, name, message)
        assert name == "RuntimeError" or "Input/output error" in message, (spec, message)
    assert result["buffers_in_use"] == [0, 0], (spec, result["buffers_in_use"])
    assert result["files_left"] == [], (spec, result["files_left"])
    # (an export is a call into the engine as a step or a save is, and may be the one that refuses)
    refused = [i for i, e in enumerate(events)
               if e[0] in ("step error", "save error", "16bit error") and REFUSAL in e[2]]
    if refused:  # from the first refusal on, nothing is stepped or saved
        after = events[refused[0]:]  # (an export of the checkpoint, not the engine, may still be written)
        assert all(e[0].endswith(" error") for e in after), (spec, after)
        assert all(REFUSAL in e[2] for e in after if e[0] in ("save error", "16bit error")), (spec, after)
        return "refused"
    applied = result["applied"]
    assert applied == STEPS or not complete and applied > 0, (spec, events)
    # Going on applied every step once: the state read once the tracer left (which runs the
    # updates still pending; tried again after an error, as a step is) is that of the run
    # without failures after as many steps.
    assert result["state"] == "read", (spec, events)
    final, expected = result["final"], reference[applied]
    differ = [k for k in expected if not torch.equal(final[k], expected[k])]
    assert not differ, f"{spec}: differs from the run without the failure in {differ}; events {events}"
    return "exact"


# Reads: the 5th fails a parameter read in the first forward and a master read inside a save;
# the 20th an optimizer read in the middle of a unit's deferred update. Writes: the 20th loses a
# piece of optimizer state. The slow sweep covers many more.
@pytest.mark.parametrize("spec,outcome", [
    ("pread64:error=EIO:when=5", "exact"),
    ("pread64:error=EIO:when=20", "exact"),
    ("pwrite64:error=EIO:when=20", "refused"),
])
def test_real_kernel_errors_in_a_clipped_run(job, reference, spec, outcome):
    assert _check(job.round(spec), reference, spec) == outcome


# The default engine (io_uring on any recent kernel), at the default queue depth: a failed
# io_uring_enter used to leave its entries in the ring, sent with the next one over buffers already
# given back (each of these four points hung before the fix). Odd calls of the I/O thread submit,
# even ones mostly reap.
@pytest.mark.parametrize("when,phase", [(1, "train"), (3, "train"), (1, "save"), (3, "state"), (3, "load")])
def test_real_io_uring_errors(job, reference, when, phase):
    spec = f"io_uring_enter:error=EIO:when={when}"
    result = job.round(spec, engine="io_uring", phase=phase, queue_depth=8)
    assert _check(result, reference, spec, silent=phase != "train" or when % 2 == 0) in ("exact", "refused")


@pytest.mark.parametrize("spec", ["io_submit:error=EIO:when=3", "io_getevents:error=EIO:when=4"])
def test_real_kernel_aio_errors(job, reference, spec):
    _check(job.round(spec, engine="aio"), reference, spec, silent="getevents" in spec)


def test_a_read_error_in_a_persistent_units_update_inside_step(job, reference_persistent):
    """The default persistence threshold: every unit of this model stays gathered and is updated
    inside `step()`. A failed optimizer read there used to leave the unit released for good (every
    later forward: "'weight' must be 2-D"); now the retry reads again and applies the step once."""
    spec = "pread64:error=EIO:when=2"
    result = job.round(spec, persistence="default")
    assert _check(result, reference_persistent, spec, silent=True) == "exact"
    warned = [w for w in result["warnings"] if "persistent unit" in w and "Input/output error" in w]
    assert warned or any(e[0] != "ok" for e in result["events"]), f"{spec}: the injection missed"


# "2+2": every other call from the 2nd, which may all be reaps the engine tries again unseen (then
# both exports are whole); "1+4": the first submit fails, so an error always reaches the job.
@pytest.mark.parametrize("when,must_hit", [("2+2", False), ("1+4", True)])
def test_io_errors_inside_an_export(job, reference, when, must_hit):
    """save_16bit_model and consolidate with failed io_uring_enter calls in: an export either
    raises (leaving no file under its name) or is whole, equal to the one written after."""
    spec = f"io_uring_enter:error=EIO:when={when}"
    result = job.round(spec, engine="io_uring", phase="export", queue_depth=8)
    assert not [e for e in result["events"] if e[0].endswith(" left")], result["events"]
    assert all(v in (None, True) for v in result["export"].values()), result["export"]
    if must_hit:
        assert any(e[0].endswith("error") for e in result["events"]), f"{spec}: the injection missed"
    _check(result, reference, spec, silent=True)  # the engine after it: exact, or refusing


@pytest.mark.slow
def test_real_io_uring_errors_at_many_points(job, reference):
    outcomes = {}
    for phase, points in (("train", (2, 5, 6, 12, 30, "9+20", "15+")), ("save", (1, 5, 9)),
                          ("state", (3, 16, 45)), ("load", (1, 2, 5, 9))):
        for when in points:
            spec = f"io_uring_enter:error=EIO:when={when}"
            periodic = "+" in str(when)
            result = job.round(spec, engine="io_uring", phase=phase, queue_depth=8,
                               tries=40 if periodic else STEPS + 4)
            outcomes[(phase, spec)] = _check(result, reference, spec, complete=not periodic, silent=True)
    assert "exact" in outcomes.values(), outcomes


@pytest.mark.slow
def test_persistent_units_at_many_points(job, reference_persistent):
    for when in (3, 5, 8, 12, 16, 20, 30, 45, 60):
        spec = f"pread64:error=EIO:when={when}"
        _check(job.round(spec, persistence="default"), reference_persistent, spec, silent=True)


@pytest.mark.slow
def test_real_kernel_errors_at_many_points(job, reference):
    """`9+20`: the 9th and every 20th after (a resumed update keeps the pieces it did, so the
    job gets through); `15+`: every call from the 15th (a dead disk: the job gives up after its
    tries, each of them an error, and nothing it applied was applied twice)."""
    outcomes = {}
    for syscall in ("pread64", "pwrite64"):
        for when in (3, 8, 12, 16, 24, 30, 40, 55, "9+20", "15+"):
            spec = f"{syscall}:error=EIO:when={when}"
            periodic = "+" in str(when)
            result = job.round(spec, tries=40 if periodic else STEPS + 4)
            outcomes[spec] = _check(result, reference, spec, complete=not periodic)
    assert set(outcomes.values()) == {"exact", "refused"}, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pread64:error=EIO:when=6+15", "pwrite64:error=EIO:when=10"])
def test_several_failures_in_flight(job, reference, spec):
    """Eight I/O threads a handle, each failing its own calls: failed requests of one transfer and
    of several transfers in flight at once."""
    _check(job.round(spec, queue_depth=8, tries=40), reference, spec, complete=False)


# ---- the same, deterministically, through a wrapper around the real handle -------------------

def _engine(tmp_path, clip: float = 1.0):
    cfg = config(3, "nvme", "nvme", clip=clip)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=str(tmp_path), buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=12)
    z["sub_group_size"] = 4096  # several pieces per unit
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=cfg)
    engine.params.swapper.timeout = engine.optim_state.swapper.timeout = 5.0  # a leak fails fast
    return engine


def _state(engine) -> dict[str, torch.Tensor]:
    return {f"{u.index}/{kind}": engine.full_optimizer_values(u, kind)
            for u in engine.units if u.trainable for kind in ("master", "exp_avg", "exp_avg_sq")}


def _train(engine, data) -> list[str]:
    """Trains until every batch of `data` is applied once (a failed step is tried again on the
    same batch); returns the outcome of every try."""
    outcomes, applied = [], 0
    while applied < len(data) and len(outcomes) < len(data) + 4:
        try:
            engine.backward(engine(*data[applied]))
            engine.step()
        except (OSError, RuntimeError) as e:
            outcomes.append(f"{type(e).__name__}: {e}")
            continue
        outcomes.append("ok")
        applied += 1
    return outcomes


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """clip -> the state after 4 steps without a failure."""
    runs = {}

    def run(clip: float = 1.0) -> dict[str, torch.Tensor]:
        if clip not in runs:
            engine = _engine(tmp_path_factory.mktemp("clean"), clip)
            assert _train(engine, batches(4, 4)) == ["ok"] * 4
            runs[clip] = _state(engine)
            engine.close()
        return runs[clip]
    return run


def _assert_same(engine, expected: dict[str, torch.Tensor]) -> None:
    state = _state(engine)
    differ = [name for name in expected if not torch.equal(state[name], expected[name])]
    assert not differ, f"differ from the run without the failure: {differ}"


def _arm(engine, kind: str, key, op: str = "read") -> FaultyHandle:
    swapper = engine.optim_state.swapper
    faulty = FaultyHandle()
    if op == "read":
        faulty.inner, swapper.handle = swapper.handle, faulty
    else:
        faulty.inner, swapper.write_handle = swapper.write_handle, faulty
    faulty.fail(engine.optim_state.store.extent(kind, key), op)
    return faulty


@pytest.mark.parametrize("kind,piece", [("master", 1), ("exp_avg_sq", 2), ("exp_avg", -1)])
def test_a_deferred_update_that_fails_part_way_resumes_from_the_failed_piece(tmp_path, clean_run, kind, piece):
    """A read of piece k fails inside a unit's update, which the next forward runs (clipping):
    pieces 0..k-1 are updated and written already; going on applies the step to each piece
    once, so every number is the run without the failure's."""
    engine = _engine(tmp_path)
    data = batches(4, 4)
    assert _train(engine, data[:1]) == ["ok"]
    unit = next(u for u in engine.units if u.trainable and len(engine.optim_state.pieces.of[u.index]) >= 3)
    k = piece % len(engine.optim_state.pieces.of[unit.index])
    _arm(engine, kind, (unit.index, k))
    assert engine.updates.state(unit) is UpdateState.PENDING
    with pytest.raises(OSError) as failed:
        engine(*data[1])  # its update runs before its first use, and reads piece k
    assert f"({unit.index}, {k})" in str(failed.value)
    assert engine.updates.state(unit) is UpdateState.PARTIAL  # [Note: a unit's update]: resumed at its next use
    outcomes = _train(engine, data[1:])
    assert outcomes == ["ok"] * 3, outcomes
    assert engine.optimizer.step_count == 4
    _assert_same(engine, clean_run())
    engine.close()
    assert engine.optim_state.pool.stats.bytes_in_use == engine.params.pool.stats.bytes_in_use == 0


@pytest.mark.parametrize("clip,op", [(1.0, "write"), (0.0, "read")])
def test_an_update_that_cannot_resume_refuses_until_a_checkpoint_is_loaded(tmp_path, clean_run, clip, op):
    """A lost write (clipped run), or an update in backward that fails after other units took
    the step (no clipping): steps and saves refuse, saying to restore a checkpoint; loading one
    mends it, and training from there gives the numbers of a run without the failure."""
    engine = _engine(tmp_path, clip)
    data = batches(4, 4)
    assert _train(engine, data[:2]) == ["ok"] * 2
    engine.save_checkpoint(tmp_path / "ckpt", tag="two")
    unit = next(u for u in engine.units if u.trainable and len(engine.optim_state.pieces.of[u.index]) >= 3)
    _arm(engine, "exp_avg", (unit.index, 1), op)
    outcomes = _train(engine, data[2:])
    first = next(i for i, o in enumerate(outcomes) if o != "ok")
    assert f"shard ({unit.index}, 1) of kind 'exp_avg'" in outcomes[first], outcomes  # the shard, by name
    assert len(outcomes) == 6 and all(REFUSAL in o for o in outcomes[first + 1:]), outcomes  # then every step refuses
    with pytest.raises(RuntimeError, match=REFUSAL):
        engine.save_checkpoint(tmp_path / "ckpt", tag="broken")
    assert not (tmp_path / "ckpt" / "broken").exists()
    engine.load_checkpoint(tmp_path / "ckpt", tag="two")
    assert _train(engine, data[2:]) == ["ok"] * 2
    _assert_same(engine, clean_run(clip))
    engine.close()
    assert engine.optim_state.pool.stats.bytes_in_use == engine.params.pool.stats.bytes_in_use == 0


def test_a_read_error_inside_save_checkpoint_is_raised_as_it_is(tmp_path, clean_run):
    """The EIO comes out, and nothing else (no release of what the failed read never held); the
    engine is consistent afterwards: the next save works, and training goes on exactly."""
    engine = _engine(tmp_path)
    data = batches(4, 4)
    assert _train(engine, data[:2]) == ["ok"] * 2
    engine.save_checkpoint(tmp_path / "ckpt", tag="warm")  # settles the deferred updates
    last = max(u.index for u in engine.units if u.trainable)
    pieces = len(engine.optim_state.pieces.of[last])
    _arm(engine, "exp_avg_sq", (last, pieces - 1))
    with pytest.raises(OSError, match="Input/output error") as caught:
        engine.save_checkpoint(tmp_path / "ckpt", tag="failed")
    assert caught.type is OSError and f"({last}, {pieces - 1})" in str(caught.value)
    assert not (tmp_path / "ckpt" / "failed").exists()
    engine.optim_state.swapper.check_invariants()  # every buffer back with its shard, or in the pool
    engine.params.swapper.check_invariants(outside=0)
    assert engine.optim_state.pool.stats.bytes_in_use == 0
    engine.save_checkpoint(tmp_path / "ckpt", tag="again")
    assert _train(engine, data[2:]) == ["ok"] * 2
    _assert_same(engine, clean_run())
    engine.close()
