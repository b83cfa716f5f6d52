"""Misuse of the API gets a clear error, never a bare assert, a silent change or a wedge."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config, reference_run


def nvme(tmp_path, *, clip: float = 1.0, gas: int = 1) -> dict:
    cfg = config(3, "nvme", "nvme", gas=gas, clip=clip)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=str(tmp_path), buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    return cfg


@pytest.mark.parametrize("clip", [0.0, 1.0])  # update in backward, and after the norm
def test_backward_twice_without_step_is_an_error_in_both_modes(tmp_path, clip):
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=nvme(tmp_path, clip=clip))
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    before = engine.consolidated_state_dict()
    # The next training forward is refused already ([Note: engine lifecycle]: BOUNDARY -> step() only).
    with pytest.raises(RuntimeError, match=r"backward\(\) ended an accumulation and step\(\) has not run"):
        engine.backward(engine(idx, tgt))
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was applied twice
    engine.step()
    engine.backward(engine(idx, tgt))  # and training goes on
    engine.step()
    assert engine.global_steps == 2
    engine.close()


def test_a_second_backward_inside_an_accumulation_is_an_error_and_counts_once():
    """gradient_accumulation_steps 2: backward twice on the first micro-batch would add its
    gradients twice; it is refused, and the step is plain PyTorch's."""
    torch.manual_seed(0)
    model = TinyGPT()
    data = batches(4, 4)
    ref_losses, ref_model = reference_run(model, data, gas=2)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=config(3, "cpu", "cpu", gas=2))
    losses = []
    for i, (idx, tgt) in enumerate(data):
        loss = engine(idx, tgt)
        engine.backward(loss, retain_graph=True)
        if i == 0:
            with pytest.raises(RuntimeError, match=r"called again before engine.step\(\).*would count twice"):
                engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])] == pytest.approx(ref_losses, rel=1e-6)
    state = engine.consolidated_state_dict()
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5)


def test_a_failed_backward_leaves_the_engine_usable(tmp_path):
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=nvme(tmp_path, gas=2))
    idx, tgt = batches(1, 4)[0]
    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()  # not a boundary yet
    with pytest.raises(RuntimeError, match="not after a training forward"):
        engine.backward(loss)  # no forward opened a pass: refused before autograd runs
    engine(idx, tgt)  # a pass whose backward is given the old loss
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        engine.backward(loss)  # autograd's own error, raised through the engine
    for _ in range(4):
        engine.backward(engine(idx, tgt))
        engine.step()
    assert engine.global_steps == 2 and engine.fetcher.live_numel == 0
    engine.close()


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while `armed`: a backward that fails half way, after the
    units above it have their gradients."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            raise RuntimeError("failed half way")
        return grad


class _BreakableGPT(TinyGPT):
    def __init__(self):
        super().__init__()
        self.blocks[1].register_forward_pre_hook(lambda module, args: (_FailOnce.apply(args[0]),))


def test_a_backward_that_fails_half_way_leaves_no_gradient_behind():
    """The parameters that got a gradient before the failure (the final norm's, above the
    failure, in a unit not finished yet) must not carry it into the next micro-batch: after the
    failure the engine trains as one that never saw that micro-batch. (With clipping 0 the units
    above the failure are updated as their gradients are final; that failure leaves the engine
    refusing to save until the next step.)"""
    torch.manual_seed(0)
    model = _BreakableGPT()
    data = batches(3, 4)
    cfg = config(3, "cpu", "cpu", clip=1.0)
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
    _FailOnce.armed = True
    try:
        with pytest.raises(RuntimeError, match="failed half way"):
            engine.backward(engine(*data[0]))
    finally:
        _FailOnce.armed = False
    engine.step()
    runs = []
    for e in (engine, infinity.initialize(copy.deepcopy(model), config=cfg)[0]):
        losses = []
        for idx, tgt in data:
            loss = e(idx, tgt)
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        runs.append((losses, e.consolidated_state_dict()))
        e.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())


def test_a_closed_engine_says_so(tmp_path):
    engine, *_ = infinity.initialize(TinyGPT(), config=nvme(tmp_path))
    idx, tgt = batches(1, 4)[0]
    engine.close()
    for call in (lambda: engine(idx, tgt), lambda: engine.module(idx, tgt), engine.step):
        with pytest.raises(RuntimeError, match="engine was closed"):
            call()


def test_a_second_engine_on_the_same_path_opens_beside_the_first(tmp_path):
    """[Note: stores of one process] in infinity/offload/store.py."""
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(infinity.initialize(TinyGPT(), config=nvme(tmp_path))[0])
    losses = [[], []]
    for idx, tgt in batches(3, 4):  # interleaved: each reads back only its own bytes
        for engine, seen in zip(engines, losses):
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            seen.append(loss.item())
    assert losses[0] == losses[1]
    first, second = engines
    first.close()
    second.close()
    assert os.listdir(tmp_path) == []


SIGTERM_SCRIPT = r"""
import os, signal, sys, time, torch
sys.path.insert(0, sys.argv[2])
import infinity
from gpt import TinyGPT, batches
from test_misuse import nvme

def on_sigterm(signum, frame):  # a preemption handler: save what the engine holds, then leave
    torch.save(engine.consolidated_state_dict(), os.path.join(sys.argv[1], "saved.pt"))
    sys.exit(0)

if sys.argv[3] == "before":
    signal.signal(signal.SIGTERM, on_sigterm)
torch.manual_seed(0)
engine, *_ = infinity.initialize(TinyGPT(), config=nvme(os.path.join(sys.argv[1], "nvme")))
if sys.argv[3] == "after":
    signal.signal(signal.SIGTERM, on_sigterm)
for idx, tgt in batches(2, 4):
    engine.backward(engine(idx, tgt))
    engine.step()
torch.save(engine.consolidated_state_dict(), os.path.join(sys.argv[1], "expected.pt"))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("installed", ["before", "after"])  # the user's handler, around initialize
def test_a_sigterm_handler_of_the_user_finds_the_state(tmp_path, installed):
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "nvme").mkdir()
    # From outside the source tree: a checkout's root would shadow the installed package.
    with subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path), os.path.dirname(__file__),
                           installed], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path) as child:
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            child.send_signal(signal.SIGTERM)
            _, stderr = child.communicate(timeout=60)
        finally:
            child.kill()
    assert child.returncode == 0, stderr
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    assert os.listdir(tmp_path / "nvme") == []  # removed on the exit that followed


def test_importing_an_unbuilt_source_tree_says_what_to_do(tmp_path):
    """From a checkout's root, Python finds the source package first; without its compiled
    extensions the error must say so, not blame a circular import."""
    import pathlib
    import shutil
    import subprocess
    import sys

    source = pathlib.Path(infinity.__file__).parent
    shutil.copytree(source, tmp_path / "infinity", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    probe = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Redirect' not in type(f).__name__]; "
             "sys.path.insert(0, '.'); import infinity")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "compiled extensions" in out.stderr and "pip install" in out.stderr, out.stderr


def test_builds_of_one_checkout_do_not_share_a_build_directory():
    import pathlib
    import tomllib

    pyproject = pathlib.Path(__file__).parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not run from a checkout")
    build = tomllib.loads(pyproject.read_text())["tool"]["scikit-build"]
    assert "build-dir" not in build  # a fixed one made two concurrent `pip install .` collide


@pytest.mark.parametrize("aio,key", [({"block_size": 3, "engine": "aio"}, "aio.block_size"),
                                     ({"queue_depth": 100000}, "aio.queue_depth"),
                                     ({"thread_count": 1000}, "aio.thread_count")])
def test_aio_errors_name_their_config_key(tmp_path, aio, key):
    cfg = nvme(tmp_path)
    cfg["aio"] = aio
    with pytest.raises(ValueError, match=rf"^{key}: expected"):
        infinity.initialize(TinyGPT(), config=cfg)


def test_path_errors_show_where_they_point(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    cfg = nvme("missing/dir")
    with pytest.raises(ValueError, match=rf"directory does not exist: {tmp_path}/missing/dir \(given as missing/dir\)"):
        infinity.initialize(TinyGPT(), config=cfg)
    with pytest.raises(OSError, match="nvme_path must be a writable directory") as raised:
        infinity.initialize(TinyGPT(), config=nvme("/proc"))
    assert "job id" not in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_handle_arguments_are_checked_by_name(tmp_path):
    from infinity.io import AsyncIOHandle, aligned_empty

    handle = AsyncIOHandle()
    buf = aligned_empty(4096)
    with pytest.raises(ValueError, match="path: contains a NUL byte"):
        handle.submit_write(buf, str(tmp_path / "x\0y"))
    assert list(tmp_path.iterdir()) == []  # nothing written under the part before the NUL
    with pytest.raises(ValueError, match="offset: .* past the largest file offset"):
        handle.submit_write(buf, str(tmp_path / "f"), 2**63)
    with pytest.raises(IsADirectoryError, match="path: expected a file, got a directory"):
        handle.submit_read(buf, str(tmp_path))
    with pytest.raises(OSError, match="numel: cannot allocate"):
        aligned_empty(1 << 45)
