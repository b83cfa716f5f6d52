"""The device layer: one place for every stream, event and host <-> device copy, an asynchronous
test device that makes a missing wait fail on the CPU, and the GPU bugs it removes, each checked
here as far as a CPU can check it."""

from __future__ import annotations

import copy
import io
import pathlib
import re
import tokenize

import pytest
import torch
from gpt import TinyGPT, batches, config, engine_run

import infinity
from infinity.device import AsyncTestDevice, CpuDevice, make_device
from infinity.optim.functional import AdamHyper
from infinity.offload.optimizer.memory import ResidentOptimizerState
from infinity.offload.params.memory import ResidentParams
from infinity.zero.unit import Unit

SOURCE = pathlib.Path(infinity.__file__).parent

# Page-locking is a device call too: cudaHostRegister is in infinity/device/pinning.py ([Note:
# page-locking is the device layer's] in infinity/io/memory.py).
PINNING = {  # DeepSpeed's helper that copies a user's state dict to the CPU for torch.save: not the engine's data path
           "deepspeed/checkpoint/utils.py": ".to(device"}
FORBIDDEN = re.compile(r"torch\.cuda\.[a-zA-Z_]+(\(\))?|non_blocking|\.cuda\(|\.to\((self\.)?device\b"
                       r"|cudaHost[A-Za-z]+|cudart")


def _code_only(source: str) -> list[str]:
    """The source's lines with comments and string literals blanked: notes may name the calls
    the code may not make."""
    lines = [list(line) for line in source.splitlines()]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = lines[r - 1]
                lo, hi = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
                row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in lines]


def test_no_file_outside_the_device_layer_moves_data_between_devices():
    """No stream, event, copy between devices or page-locking call (cudaHostRegister) outside
    infinity/device/: in code, that is; notes and messages may name them."""
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel.startswith("device/"):
            continue
        allowed = set(PINNING.get(rel, "").split("|")) - {""}
        for lineno, line in enumerate(_code_only(path.read_text()), 1):
            for match in FORBIDDEN.finditer(line):
                if match.group(0) not in allowed:
                    offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_scan_finds_what_it_forbids(tmp_path):
    for line in ("x = t.to(device)", "y.copy_(z, non_blocking=True)", "s = torch.cuda.Stream()", "t.cuda()",
                 "ok = torch.cuda.is_available()", "err = cudart.cudaHostRegister(ptr, n, 0)", "lib.cudaHostUnregister(p)"):
        assert FORBIDDEN.search(line), line
    code = _code_only('x = 1  # cudaHostRegister in a comment\n"""t.cuda() in a docstring"""\ny = t.cuda()\n')
    assert [bool(FORBIDDEN.search(line)) for line in code] == [False, False, True]


def test_async_device_copies_land_only_by_their_wait():
    device = AsyncTestDevice(max_delay_s=10.0)  # nothing lands on its own during the test
    src = torch.arange(8, dtype=torch.float32)
    copy_ = device.to_device(src)
    assert torch.isnan(copy_.tensor).all()  # read before its wait: garbage
    src[0] = 42.0  # a source changed before the wait is what gets copied
    assert torch.equal(device.wait_compute(copy_), src)
    host = torch.zeros(8)
    back = device.to_host(src, host)
    assert not device.done(back) and torch.isnan(host).all()
    device.wait_host(back)
    assert device.done(back) and torch.equal(host, src)


def test_async_device_copies_land_on_their_own():
    device = AsyncTestDevice(max_delay_s=0.001)
    copies = [device.to_device(torch.full((4,), float(i))) for i in range(20)]
    for _ in range(200):
        if all(device.done(c) for c in copies):
            break
        torch.cuda._sleep if False else __import__("time").sleep(0.01)
    assert all(device.done(c) for c in copies)
    assert all(torch.equal(c.tensor, torch.full((4,), float(i))) for i, c in enumerate(copies))


def test_make_device_names_the_variable_on_a_typo(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "tpu")
    with pytest.raises(ValueError, match="INFINITY_DEVICE"):
        make_device()
    assert isinstance(make_device("cpu"), CpuDevice)


def test_the_suite_runs_on_the_async_device():
    """On every host, a GPU one too: the suite's references are computed on the CPU."""
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    assert isinstance(engine.accelerator, AsyncTestDevice)
    engine.close()


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("none", "cpu"), ("cpu", "none")])
def test_plain_cpu_device_matches_the_async_device(monkeypatch, param, optim):
    """The same run, bit for bit, on the plain CPU device and on the asynchronous one."""
    torch.manual_seed(0)
    model = TinyGPT()
    runs = []
    for kind in ("cpu", "async-test"):
        monkeypatch.setenv("INFINITY_DEVICE", kind)
        cfg = config(3, param, optim)
        cfg["bf16"] = {"enabled": True}
        engine, *_ = infinity.initialize(copy.deepcopy(model), config=cfg)
        runs.append((engine_run(engine, batches(3, 4), gas=1), engine.consolidated_state_dict()))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


# ---- the GPU bugs, as far as a CPU can show them -------------------------------------------------


def _unit(dtype=torch.bfloat16) -> Unit:
    lin = torch.nn.Linear(64, 64, bias=False)
    return Unit(0, "u", [("w", lin.weight, 0)], dtype, torch.device("cpu"), 0, 1)


def test_state_updated_with_torch_ops_writes_half_precision_values():
    """Bug 1: with the optimizer state on an accelerator (torch ops, not the CPU kernel), a
    bf16 target was never written, and the weights became zeros after step 1. The torch-ops
    branch runs here on CPU tensors; the target must hold the new master, rounded."""
    unit = _unit()
    state = ResidentOptimizerState(CpuDevice(), on_device=True, units=[unit])
    state._cpu_kernel = False  # what an accelerator-resident state takes
    master = torch.randn(unit.train_shard_numel)
    state.add(unit, master)
    state.accumulate(unit, torch.randn(unit.train_shard_numel, dtype=torch.bfloat16), first=True, last=True)
    out = torch.zeros(unit.train_shard_numel, dtype=torch.bfloat16)
    state.update(unit, [AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, True, True)], 1, 1.0, out)
    new = state.read(unit, "master")
    assert not torch.equal(new, master)
    assert torch.equal(out, new.to(torch.bfloat16))


def test_dropped_prefetches_are_waited_for_before_they_are_forgotten():
    """Bug 7: prefetched copies were forgotten while still reading their host shards."""
    device = AsyncTestDevice(max_delay_s=10.0)
    unit = _unit()
    tier = ResidentParams(device, offload=True)
    tier.add(unit, torch.randn(unit.shard_numel))
    issued = []
    real = device.to_device
    device.to_device = lambda *a, **k: issued.append(real(*a, **k)) or issued[-1]
    assert tier.prefetch(unit)
    assert not device.done(issued[0])
    tier.drop_prefetched()
    assert device.done(issued[0])


def test_inputs_go_to_the_engine_device():
    """Bug 3: inputs were never moved to the engine's device."""
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    moved = []
    real = engine.accelerator.move
    engine.accelerator.move = lambda tree: moved.append(tree) or real(tree)
    idx, tgt = batches(1, 4)[0]
    engine.backward(engine(idx, tgt))
    engine.step()
    assert any(any(t is idx for t in torch.utils._pytree.tree_leaves(tree)) for tree in moved)
    engine.close()


def test_each_rank_takes_its_local_gpu(monkeypatch):
    """Bug 6: a process group created by the caller left every rank on cuda:0; the device
    layer takes LOCAL_RANK whoever created the group (checked without a GPU: the index)."""
    from infinity.device.cuda import local_index

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert local_index() == 3
    # More ranks than GPUs (two ranks on a one-GPU machine, seen on a lent H100): named, not
    # CUDA's "invalid device ordinal" from deep inside set_device.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3: .* 1 GPU"):
        local_index()


def test_a_gpu_machine_whose_engine_runs_on_the_cpu_gets_gloo(monkeypatch):
    """With INFINITY_DEVICE=cpu on a GPU machine the engine's collectives run on CPU tensors, so
    the process group that `deepspeed.init_distributed` starts must be gloo, not NCCL."""
    from infinity.device import default_dist_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kind in ("cpu", "async-test"):
        monkeypatch.setenv("INFINITY_DEVICE", kind)
        assert default_dist_backend() == "gloo"
    monkeypatch.setenv("INFINITY_DEVICE", "tpu")
    with pytest.raises(ValueError, match="INFINITY_DEVICE"):
        default_dist_backend()


def _imports(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """The modules of `known` that `module` (at `path`) imports anywhere: at the top, inside
    functions (lazy imports) and under `if TYPE_CHECKING:` (type-only imports are a dependency
    of the code's reader, and STYLE.md's layers forbid them upwards as much as the others)."""
    import ast

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []  # `from . import x`
            source = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & known


def test_no_import_cycle_in_the_package():
    """No module of infinity reaches itself through its imports, lazy and type-only ones included."""
    modules = {}
    for path in SOURCE.rglob("*.py"):
        name = path.relative_to(SOURCE.parent).with_suffix("").as_posix().replace("/", ".")
        modules[name.removesuffix(".__init__")] = path
    graph = {name: _imports(path, name, set(modules)) for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        assert state.get(name) != 1, "import cycle: " + " -> ".join(trail[trail.index(name):] + [name])
        state[name] = 1
        for dep in sorted(graph[name]):
            if dep != "infinity":  # the package's own __init__ re-exports; importing it is not a layer edge
                visit(dep, trail + [name])
        state[name] = 2

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_shards_are_written_only_once_their_copies_are_known_to_be_over(tmp_path, monkeypatch, clip):
    """On a GPU the host learns that a host -> device copy has ended only by asking; an update
    that writes a unit's shard must first get back the pool buffers that copy read (it failed
    with 'is fetched' when done() lagged the copy)."""
    monkeypatch.setenv("INFINITY_DEVICE", "async-test")
    monkeypatch.setenv("INFINITY_ASYNC_DELAY_S", "0.3")  # done() lags every copy by up to 0.3 s
    cfg = config(3, "nvme", "cpu", clip=clip)
    cfg["zero_optimization"]["offload_param"].update(nvme_path=str(tmp_path), buffer_count=6, max_in_cpu=0)
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=cfg)
    engine_run(engine, batches(2, 4), gas=1)
    assert engine.global_steps == 2
    engine.close()


def test_cpu_offload_keeps_no_device_copy_after_use():
    """A fetched shard's device copy dies with the gathered unit's use of it: the tier keeps
    only what the host waits for before the host shard changes."""
    engine, *_ = infinity.initialize(TinyGPT(), config=config(3, "cpu", "cpu"))
    idx, tgt = batches(1, 4)[0]
    loss = engine(idx, tgt)
    kept = engine.params._reading.values()
    assert kept and all(x.tensor is x.source for x in kept)
    engine.backward(loss)
    engine.step()
    engine.close()
