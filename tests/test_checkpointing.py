"""DeepSpeed's activation checkpointing API (infinity.checkpointing) against torch's own
checkpoint: the same gradients bit for bit, the recompute really run, the inputs really held in
host memory (and the device tensor really let go) with cpu_checkpointing, their copies ordered on
the asynchronous test device, and the engine on NVMe training through it as plain PyTorch does."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import infinity
from infinity import checkpointing
from infinity.offload import activations


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts unconfigured, with its own device and host stash."""
    monkeypatch.setattr(activations, "STATE", activations.ActivationState())


def _layers(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    widths = [16, 24, 32, 8]
    return nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(0.2), nn.LayerNorm(b))
                         for a, b in zip(widths, widths[1:]))


def _grads(how: str, input_grad: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """Gradients of a 3-block stack (dropout: the recompute must replay the RNG) run `how`."""
    layers = _layers(seed)
    torch.manual_seed(1)
    x = torch.randn(5, 16, requires_grad=input_grad)
    h = x
    for block in layers:
        if how == "none":
            h = block(h)
        elif how == "torch":
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        else:
            h = checkpointing.checkpoint(block, h)
    (h * torch.arange(h.numel()).view_as(h)).sum().backward()
    return [p.grad.clone() for p in layers.parameters()] + ([x.grad.clone()] if input_grad else [])


SETTINGS = {
    "default": {},
    "cpu_checkpointing": {"checkpoint_in_cpu": True},
    "partitioned_on_host": {"partition_activations": True, "checkpoint_in_cpu": True},
    "contiguous": {"partition_activations": True, "checkpoint_in_cpu": True, "contiguous_checkpointing": True,
                   "num_checkpoints": 3},
    "synchronized_and_profiled": {"synchronize": True, "profile": True},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("input_grad", [False, True])
def test_gradients_are_torchs_checkpoint_bit_for_bit(setting, input_grad):
    checkpointing.configure(None, **SETTINGS[setting])
    ours = _grads("ours", input_grad)
    theirs = _grads("torch", input_grad)
    plain = _grads("none", input_grad)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert max((a - b).abs().max().item() for a, b in zip(ours, plain)) <= 1e-6


def test_the_recompute_really_runs_and_not_without_grad():
    calls = []
    block = nn.Linear(4, 4)

    def f(x):
        calls.append(torch.is_grad_enabled())
        return torch.tanh(block(x))

    out = checkpointing.checkpoint(f, torch.randn(2, 4))
    assert calls == [True]
    out.sum().backward()
    assert calls == [True, True]  # the recompute, during backward
    with torch.no_grad():
        checkpointing.checkpoint(f, torch.randn(2, 4))
    assert calls == [True, True, False]


def test_keyword_tensors_take_part_in_autograd_and_a_retained_graph_recomputes_again():
    torch.manual_seed(0)
    w = nn.Linear(6, 6)
    x = torch.randn(3, 6, requires_grad=True)
    scale = torch.randn(3, 6, requires_grad=True)
    out = checkpointing.checkpoint(lambda a, s=None: torch.sin(w(a)) * s, x, s=scale)
    out.sum().backward(retain_graph=True)
    first = (x.grad.clone(), scale.grad.clone())
    out.sum().backward()  # the recomputed tensors were handed out once: a second recompute
    ref_x, ref_s = x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    (torch.sin(w(ref_x)) * ref_s).sum().backward()
    assert torch.equal(first[0], ref_x.grad) and torch.equal(first[1], ref_s.grad)
    assert torch.equal(x.grad, 2 * ref_x.grad) and torch.equal(scale.grad, 2 * ref_s.grad)


def _numpy_backed(shape) -> tuple[torch.Tensor, weakref.finalize]:
    """A tensor whose memory is a numpy array, and a finalizer that tells when that memory goes."""
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    gone = weakref.finalize(array, lambda: None)
    return torch.from_numpy(array), gone


@pytest.mark.parametrize("on_host", [False, True])
def test_cpu_checkpointing_lets_the_device_tensor_go_once_its_copy_is_done(on_host):
    checkpointing.configure(checkpoint_in_cpu=on_host)
    block = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x, gone = _numpy_backed((8, 64))
    reference = x.clone()
    out = checkpointing.checkpoint(block, x)
    del x
    # The test device lands and reports its copies within 4 ms of an idle machine; a loaded one
    # (CI on 2 cores) may take longer, so a copy still in flight is waited for, up to 5 s.
    deadline = time.monotonic() + 5.0
    while True:
        time.sleep(0.05)
        checkpointing.checkpoint(torch.nn.functional.relu, torch.ones(1, requires_grad=True))  # a later one looks
        gc.collect()
        if not on_host or not gone.alive or time.monotonic() > deadline:
            break
    assert gone.alive is not on_host  # held by the checkpoint only without cpu_checkpointing
    out.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    block(reference).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters()))


def test_a_recompute_that_skips_the_wait_for_its_inputs_computes_garbage():
    """The copies really go through the device: without the compute wait the test device's
    destination is NaN, so the parity above is not vacuous."""
    checkpointing.configure(checkpoint_in_cpu=True)
    device = activations.STATE.device
    assert device.name == "async-test"
    device.wait_compute = lambda x: x.tensor  # the bug: read the destination before the copy landed
    grads = _grads("ours")
    assert any(not torch.isfinite(g).all() for g in grads)


def test_inputs_come_back_ahead_of_their_recompute():
    """The copy back of a checkpoint's inputs is issued when the recompute of the checkpoint after
    it starts, before its own recompute runs."""
    checkpointing.configure(checkpoint_in_cpu=True)
    device = activations.STATE.device
    events = []
    to_device = device.to_device

    def record(src, dst=None):
        events.append(("copy in", src.shape[-1]))
        return to_device(src, dst)

    device.to_device = record
    layers = _layers()

    recording = [False]

    def run(i):
        def block(h):
            if recording[0]:
                events.append(("recompute", i))
            return layers[i](h)
        return block

    h = torch.randn(5, 16)
    for i in range(3):
        h = checkpointing.checkpoint(run(i), h)
    recording[0] = True
    h.sum().backward()
    widths = {0: 16, 1: 24, 2: 32}  # the width of each checkpoint's input
    for i in (1, 2):
        assert events.index(("copy in", widths[i - 1])) < events.index(("recompute", i))
    assert [e for e in events if e[0] == "recompute"] == [("recompute", 2), ("recompute", 1), ("recompute", 0)]


def test_contiguous_arena_holds_number_checkpoints_and_says_when_it_is_too_small():
    checkpointing.configure(partition_activations=True, checkpoint_in_cpu=True, contiguous_checkpointing=True,
                            num_checkpoints=2)
    with pytest.raises(RuntimeError, match="number_checkpoints: more than 2 checkpoints"):
        _grads("ours")


def test_the_cpu_as_device_has_nothing_to_move(monkeypatch, caplog):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    checkpointing.configure(checkpoint_in_cpu=True)
    with caplog.at_level(logging.INFO, logger="infinity"):
        ours = _grads("ours")
        _grads("ours")
    said = [r.getMessage() for r in caplog.records if "nothing is moved" in r.getMessage()]
    assert len(said) == 1 and "compute device is the CPU" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(ours, _grads("torch")))


def test_profile_logs_forward_and_recompute_times(caplog):
    checkpointing.configure(profile=True)
    with caplog.at_level(logging.INFO, logger="infinity"):
        _grads("ours")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("infinity.checkpointing: ")]
    assert sum(" forward " in line and line.endswith(" ms") for line in lines) == 3
    assert sum(" recompute " in line and line.endswith(" ms") for line in lines) == 3


def test_in_place_changes_to_kept_inputs_are_refused():
    block = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="changed its tensor argument 0 in place"):
        checkpointing.checkpoint(lambda x: block(x.mul_(2)), torch.randn(2, 4))
    x = torch.randn(2, 4)
    out = checkpointing.checkpoint(block, x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="changed in place between its forward and its recompute"):
        out.sum().backward()


@pytest.mark.parametrize("on_host", [False, True])
def test_an_input_made_under_inference_mode_is_kept_without_a_version(on_host):
    checkpointing.configure(checkpoint_in_cpu=on_host)
    with torch.inference_mode():
        x = torch.randn(3, 4)
    bias = nn.Parameter(torch.randn(4))
    checkpointing.checkpoint(lambda h: torch.tanh(h + bias), x).sum().backward()  # autograd saves no x
    ours = bias.grad.clone()
    bias.grad = None
    torch.tanh(x + bias).sum().backward()
    assert torch.equal(ours, bias.grad)


def test_configure_reads_deepspeeds_section_and_arguments_win(tmp_path):
    assert not checkpointing.is_configured()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                             "number_checkpoints": 4, "profile": False}}))
    checkpointing.configure(None, deepspeed_config=str(path), profile=True)
    assert checkpointing.is_configured()
    cfg = activations.STATE.config
    assert (cfg.partition_activations, cfg.cpu_checkpointing, cfg.number_checkpoints, cfg.profile) == (True, True, 4,
                                                                                                       True)
    checkpointing.set_num_layers(6)
    assert activations.STATE.config.number_checkpoints == 6


class _MPU:
    def __init__(self, size):
        self.size = size

    def get_model_parallel_world_size(self):
        return self.size


@pytest.mark.parametrize(("kwargs", "error", "said"), [
    ({"contiguous_checkpointing": True, "num_checkpoints": 2}, ValueError,
     "contiguous_memory_optimization: needs partition_activations"),
    ({"contiguous_checkpointing": True, "partition_activations": True}, ValueError, "needs number_checkpoints"),
    ({"num_checkpoints": 0}, ValueError, "number_checkpoints: expected an integer >= 1, got 0"),
    ({"checkpoint_in_cpu": "yes"}, TypeError, "cpu_checkpointing: expected true or false"),
    ({"deepspeed_config": {"activation_checkpointing": {"cpu_checkpoint": True}}}, ValueError,
     "activation_checkpointing.cpu_checkpoint: unknown key; did you mean activation_checkpointing.cpu_checkpointing"),
    ({"deepspeed_config": {"activation_checkpointing": {"nvme_path": "/no/such/dir"}}}, ValueError,
     "activation_checkpointing.nvme_path: directory does not exist: /no/such/dir"),
    ({"mpu_": _MPU(2)}, ValueError, "mpu_: model-parallel world size 2"),
])
def test_configure_errors_name_the_key(kwargs, error, said):
    with pytest.raises(error, match=said):
        checkpointing.configure(**kwargs)


def test_a_model_parallel_unit_of_size_one_is_accepted():
    checkpointing.configure(_MPU(1), partition_activations=True)
    assert all(torch.equal(a, b) for a, b in zip(_grads("ours"), _grads("torch")))


class _Checkpointed(nn.Module):
    """A small transformer-ish stack whose blocks run through a checkpoint function."""

    def __init__(self, checkpoint_fn):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = h + self.checkpoint_fn(block, h)
        return nn.functional.cross_entropy(self.head(h), y)


def test_the_engine_on_nvme_trains_through_it_as_pytorch_through_torchs(tmp_path):
    checkpointing.configure(partition_activations=True, checkpoint_in_cpu=True)
    torch.manual_seed(3)
    batches = [(torch.randn(6, 12), torch.randint(0, 4, (6,))) for _ in range(3)]
    plain = _Checkpointed(lambda f, h: torch_checkpoint.checkpoint(f, h, use_reentrant=False))
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    expected = []
    for x, y in batches:
        loss = plain(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    nvme = str(tmp_path)
    model = _Checkpointed(checkpointing.checkpoint)
    engine, *_ = infinity.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 6, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 9}}})
    got = []
    try:
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
    finally:
        engine.close()
    assert np.allclose(got, expected, rtol=0, atol=1e-5), (got, expected)


def test_deepspeed_checkpointing_is_this_module_under_the_alias():
    script = textwrap.dedent("""
        import json, infinity
        infinity.as_deepspeed()
        import deepspeed
        from deepspeed.checkpointing import checkpoint
        import infinity.checkpointing as ours
        from infinity.offload import activations
        deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
        print(json.dumps([deepspeed.checkpointing.checkpoint is ours.checkpoint, checkpoint is ours.checkpoint,
                          ours.is_configured(), activations.STATE.config.cpu_checkpointing]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())  # not the checkout, which would shadow the installed package
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, True, True]


# ---- inputs on NVMe ([Note: checkpointed inputs on NVMe]) ------------------------------------------


def _spill_to(path, min_bytes: int = 0, **settings) -> None:
    """configure(), then infinity's own keys, as a config's section gives them."""
    section = {"nvme_path": str(path), "nvme_min_bytes": min_bytes, **settings}
    checkpointing.configure(deepspeed_config={"activation_checkpointing": section})


def _written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _drain() -> None:
    """Every spilled checkpoint's write done and reaped: its inputs are on disk only. The test
    device lands and reports its copies within 4 ms of an idle machine; a loaded one (CI on 2
    cores) may take longer, so a copy still in flight is waited for, up to 5 s."""
    deadline = time.monotonic() + 5.0
    for frame in (ref() for ref in activations.STATE.frames):
        if frame is not None and frame.spill is not None:
            frame.spill.advance()
            while frame.spill.where is activations.Where.COPYING and time.monotonic() < deadline:
                time.sleep(0.005)
                frame.spill.advance()
            if frame.spill.where is activations.Where.WRITING:
                frame.spill.finish_write()
            assert frame.spill.where is activations.Where.ON_DISK


def _spill_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith("inputs"))


@pytest.mark.parametrize("device", ["async-test", "cpu"])
@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("input_grad", [False, True])
def test_inputs_spilled_to_nvme_give_torchs_gradients_bit_for_bit(tmp_path, monkeypatch, device, on_host, input_grad):
    monkeypatch.setenv("INFINITY_DEVICE", device)
    _spill_to(tmp_path, cpu_checkpointing=on_host)
    ours = _grads("ours", input_grad)
    assert len(_spill_files(tmp_path)) == 3  # one file per checkpoint alive at once
    assert all(torch.equal(a, b) for a, b in zip(ours, _grads("torch", input_grad)))
    ours = _grads("ours", input_grad, seed=1)  # the files again, overwritten in place
    assert len(_spill_files(tmp_path)) == 3
    assert all(torch.equal(a, b) for a, b in zip(ours, _grads("torch", input_grad, seed=1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io")
def test_spilled_inputs_leave_memory_for_the_disk_and_come_back(tmp_path, monkeypatch):
    """The input's own memory goes once its write is done; the bytes reach the disk (the kernel's
    count of this process's writes to storage, and the file's content), and come back for backward.
    On the CPU as the device (the test device's copy thread holds its last source a while longer)."""
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    _spill_to(tmp_path, min_bytes=4096)
    block = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x, gone = _numpy_backed((512, 256))  # 512 KiB
    expected = x.numpy().tobytes()
    reference = x.clone()
    before = _written_bytes()
    out = checkpointing.checkpoint(block, x)
    del x
    _drain()
    gc.collect()
    assert not gone.alive  # the checkpoint let go of the input: it is on disk only
    assert _written_bytes() - before >= len(expected)
    (path,) = _spill_files(tmp_path)
    with open(path, "rb") as f:
        assert f.read(len(expected)) == expected
    out.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    block(reference).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters()))


def test_inputs_under_nvme_min_bytes_stay_in_memory(tmp_path):
    _spill_to(tmp_path, min_bytes=1 << 20)
    assert all(torch.equal(a, b) for a, b in zip(_grads("ours"), _grads("torch")))  # inputs of 5 x 32 floats
    assert _spill_files(tmp_path) == []


def test_the_read_of_spilled_inputs_is_issued_ahead_of_their_recompute(tmp_path):
    _spill_to(tmp_path)
    layers = _layers()
    events = []
    recording = [False]

    def run(i):
        def block(h):
            if recording[0]:
                events.append(("recompute", i))
            return layers[i](h)
        return block

    h = torch.randn(5, 16)
    for i in range(3):
        h = checkpointing.checkpoint(run(i), h)
    _drain()
    handle = activations.STATE.files.handle
    submit_read = handle.submit_read

    def record(buffer, path, offset=0):
        events.append(("read", os.path.basename(path)))
        return submit_read(buffer, path, offset)

    handle.submit_read = record
    recording[0] = True
    h.sum().backward()
    # inputs<i>.bin holds checkpoint i's inputs: each is read when the recompute of the one after it starts
    assert [e for e in events if e[0] == "read"] == [("read", f"inputs{i}.bin") for i in (2, 1, 0)]
    assert events.index(("read", "inputs1.bin")) < events.index(("recompute", 2))
    assert events.index(("read", "inputs0.bin")) < events.index(("recompute", 1))


def test_the_spill_directory_goes_with_the_state_and_a_killed_runs_is_removed(tmp_path):
    _spill_to(tmp_path)
    _grads("ours")
    assert len(_spill_files(tmp_path)) == 3
    checkpointing.reset()
    gc.collect()
    assert os.listdir(tmp_path) == []
    script = textwrap.dedent("""
        import os, sys, torch
        from infinity import checkpointing
        from infinity.offload import activations
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {"nvme_path": sys.argv[1],
                                                                               "nvme_min_bytes": 0}})
        out = checkpointing.checkpoint(torch.nn.Linear(64, 64), torch.randn(64, 64))
        activations.STATE.files.handle.wait()
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())  # not the checkout, which would shadow the installed package
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert len(_spill_files(tmp_path)) == 1  # killed outright: left behind
    _spill_to(tmp_path)
    _grads("ours")
    assert len(_spill_files(tmp_path)) == 3  # the leftover was removed when this run claimed its directory


def test_initialize_configures_checkpointing_from_its_config_section_and_hands_over_its_device(tmp_path):
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}}
    checkpointing.configure(checkpoint_in_cpu=True, profile=True)
    engine, *_ = infinity.initialize(model=nn.Linear(4, 4), config=base)
    assert activations.STATE.config.profile  # no section: the settings stay as configure() left them
    assert activations.STATE.device is engine.accelerator
    engine.close()
    section = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 4,
               "nvme_path": str(tmp_path), "nvme_min_bytes": 4096}
    engine, *_ = infinity.initialize(model=nn.Linear(4, 4), config={**base, "activation_checkpointing": section})
    cfg = activations.STATE.config
    assert (cfg.partition_activations, cfg.cpu_checkpointing, cfg.number_checkpoints, cfg.profile) == (True, True, 4,
                                                                                                       False)
    assert str(cfg.nvme_path) == str(tmp_path) and cfg.nvme_min_bytes == 4096
    assert activations.STATE.device is engine.accelerator
    engine.close()


def test_nothing_of_a_checkpoint_outlives_its_backward():
    """After backward the tensors a recompute made are gone, as with torch's checkpoint: the
    recompute's own graph must not keep them (a tensor it saved, whose node's unpack hook held the
    list of all of them, was a cycle the collector could not break)."""
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    made = []

    def f(h):
        mid = block[0](h)  # saved by the GELU: caught by the recompute
        made.append(weakref.ref(mid))
        return block[2](block[1](mid))

    out = checkpointing.checkpoint(f, torch.randn(32, 64))
    out.sum().backward()
    del out
    gc.collect()
    assert len(made) == 2 and all(ref() is None for ref in made)  # the forward's and the recompute's
