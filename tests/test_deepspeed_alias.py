"""`deepspeed` meaning infinity where asked for (infinity.deepspeed._alias): nowhere without the opt-in;
after `infinity.as_deepspeed()`, under `python -m infinity.deepspeed` and in the ranks `infinity
run` starts, with the metadata transformers and accelerate check; and the adapters behind
DeepSpeed's names, each against the real thing (torch's optimizers and collectives, the
engine's units)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import sys
import textwrap

import pytest
import torch
from torch import nn

import infinity
from infinity.apps.cli import main as infinity_main
from infinity.deepspeed import comm
from infinity.deepspeed.__main__ import main as boot
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from infinity.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from infinity.deepspeed.ops.adam import FusedAdam
from infinity.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from infinity.deepspeed.runtime.zero import GatheredParameters, ZeroParamStatus
from infinity.deepspeed.runtime.zero.partition_parameters import param_status
from infinity.deepspeed.utils import log_dist, logger


def _python(*args: str, cwd=None) -> dict:
    """Runs python with `args` in a fresh process; the JSON it prints last."""
    # Never the checkout's root: its source tree (no compiled extensions) would shadow the installed package.
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd or tempfile.gettempdir(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- where the alias is, and where it is not ------------------------------------------------------------


def test_no_deepspeed_without_the_opt_in_then_infinity_after_it():
    got = _python("-c", textwrap.dedent("""
        import importlib.metadata, importlib.util, json
        seen = {}
        def look(when):
            seen[when + ":spec"] = importlib.util.find_spec("deepspeed") is not None
            try:
                seen[when + ":version"] = importlib.metadata.version("deepspeed")
            except importlib.metadata.PackageNotFoundError:
                seen[when + ":version"] = None
            try:
                import deepspeed
                seen[when + ":import"] = deepspeed.__file__
            except ModuleNotFoundError:
                seen[when + ":import"] = None
        look("plain")
        import infinity
        look("after import infinity")
        infinity.as_deepspeed()
        infinity.as_deepspeed()  # again: nothing more
        look("after as_deepspeed")
        import sys
        seen["finders"] = sum(type(f).__name__ == "_AliasFinder" for f in sys.meta_path)
        print(json.dumps(seen))
        """))
    for when in ("plain", "after import infinity"):
        assert got[f"{when}:spec"] is False and got[f"{when}:version"] is None and got[f"{when}:import"] is None
    assert got["after as_deepspeed:spec"] is True
    assert got["after as_deepspeed:version"] == "0.19.8"
    assert got["after as_deepspeed:import"] == os.path.join(os.path.dirname(infinity.__file__), "deepspeed",
                                                            "__init__.py")
    assert got["finders"] == 1


def test_turning_it_on_after_deepspeed_was_imported_is_an_error(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    with pytest.raises(RuntimeError, match="the module deepspeed is imported already"):
        infinity.as_deepspeed()
    assert not infinity.deepspeed._alias.is_active()


SURFACES = """
import importlib.metadata, importlib.util, json, logging, sys
import torch
import deepspeed
import deepspeed.comm as dist
import deepspeed.runtime.zero.partition_parameters as pp
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR
from deepspeed.utils import logger, safe_get_full_fp32_param
from deepspeed.utils.logging import log_dist
import infinity, infinity.deepspeed, infinity.optim.lr_schedules, infinity.optim, infinity.deepspeed.utils.full_values
try:
    import deepspeed.inference  # DeepSpeed has it, infinity does not: missing, not faked
    missing = False
except ModuleNotFoundError:
    missing = True
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "missing": missing,
    "one_object": deepspeed is infinity.deepspeed and pp is infinity.deepspeed.runtime.zero.partition_parameters
                  and sys.modules["deepspeed.runtime.zero.partition_parameters"] is pp
                  and deepspeed.zero is deepspeed.runtime.zero,
    "names": [deepspeed.__name__, pp.__name__],
    "version": [deepspeed.__version__, importlib.metadata.version("deepspeed"),
                importlib.metadata.metadata("deepspeed")["Name"],
                str(importlib.metadata.distribution("deepspeed").version)],
    "packages": importlib.metadata.packages_distributions().get("deepspeed"),
    "engine": deepspeed.DeepSpeedEngine is infinity.Engine
              and deepspeed.runtime.engine.DeepSpeedEngine is infinity.Engine,
    # initialize: infinity's, then DeepSpeed's parameter attributes (partition_parameters.mark_partitioned)
    "entry": deepspeed.initialize.__module__ == "infinity.deepspeed"
             and deepspeed.init_distributed is infinity.init_distributed
             and deepspeed.add_config_arguments is infinity.add_config_arguments,
    # Init: infinity's, creating the process group first as DeepSpeed's does
    "zero": issubclass(deepspeed.zero.Init, infinity.Init) and pp.ZeroParamStatus is deepspeed.zero.ZeroParamStatus,
    "ops": DeepSpeedCPUAdam is infinity.optim.DeepSpeedCPUAdam and issubclass(FusedAdam, torch.optim.Adam),
    "lr": WarmupLR is infinity.optim.lr_schedules.WarmupLR and "WarmupLR" in VALID_LR_SCHEDULES,
    "comm": dist.get_rank is torch.distributed.get_rank and dist.all_reduce is torch.distributed.all_reduce
            and dist.init_distributed is infinity.init_distributed,
    "utils": safe_get_full_fp32_param is infinity.deepspeed.utils.full_values.safe_get_full_fp32_param
             and logger is logging.getLogger("infinity") and deepspeed.utils.logging.log_dist is log_dist,
    "accelerator": [get_accelerator() is deepspeed.get_accelerator(), get_accelerator().device_name()],
}))
"""


def test_python_m_infinity_deepspeed_runs_a_script_with_every_surface(tmp_path):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "surfaces.py"
    script.write_text(SURFACES)
    got = _python("-m", "infinity.deepspeed", str(script), "--deepspeed", "ds.json", "-m", cwd=tmp_path)
    assert got["argv"] == [str(script), "--deepspeed", "ds.json", "-m"]
    assert got["path0"] == str(tmp_path / "sub")  # as `python SCRIPT` has it
    assert got["names"] == ["infinity.deepspeed", "infinity.deepspeed.runtime.zero.partition_parameters"]
    assert got["version"] == ["0.19.8"] * 2 + ["deepspeed", "0.19.8"]
    assert got["packages"] == ["deepspeed"]
    for surface in ("missing", "one_object", "engine", "entry", "zero", "ops", "lr", "comm", "utils"):
        assert got[surface] is True, surface
    assert got["accelerator"] == [True, "cpu"]


HF_JOB = """
import copy, importlib.metadata, json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
import deepspeed

out = {"argv": sys.argv[1:], "deepspeed": deepspeed.__name__, "version": importlib.metadata.version("deepspeed")}
import accelerate.utils
import transformers.integrations
from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
out["transformers"] = transformers.integrations.is_deepspeed_available()
out["accelerate"] = accelerate.utils.is_deepspeed_available()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x), y)


data = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 2, i % 3]))
        for i in range(4)]
torch.manual_seed(0)
model = Net()
reference = copy.deepcopy(model)
hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
opt = torch.optim.AdamW(reference.parameters(), **hyper)
out["accelerate_swaps_in"] = type(map_pytorch_optim_to_deepspeed(opt)).__qualname__
ref_losses = []
for x, y in data:
    loss = reference(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ref_losses.append(loss.item())

config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": dict(hyper, betas=list(hyper["betas"]))},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu"}}}
deepspeed.init_distributed()
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
out["is_engine"] = isinstance(engine, deepspeed.DeepSpeedEngine)
losses = []
for x, y in data:
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
state = engine.consolidated_state_dict()
out["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
out["param_diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
engine.destroy()
with open(os.path.join(os.environ["INFINITY_TEST_OUT"], "hf_job.json"), "w") as f:
    json.dump(out, f)
"""


def test_under_infinity_run_hf_sees_deepspeed_and_training_matches_pytorch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: its source tree would shadow the installed package
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    script = tmp_path / "hf_job.py"
    script.write_text(HF_JOB)
    monkeypatch.setenv("INFINITY_TEST_OUT", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert infinity_main(["run", "--num_gpus", "1", "--master_port", str(port), str(script), "--deepspeed",
                          "ds.json"]) == 0
    got = json.loads((tmp_path / "hf_job.json").read_text())
    assert got["argv"] == ["--local_rank=0", "--deepspeed", "ds.json"]
    assert got["deepspeed"] == "infinity.deepspeed" and got["version"] == "0.19.8"
    assert got["transformers"] is True and got["accelerate"] is True
    assert got["accelerate_swaps_in"] == "DeepSpeedCPUAdam"  # accelerate's offload swap, through deepspeed.ops.adam
    assert got["is_engine"] is True
    assert got["loss_diff"] <= 1e-5 and got["param_diff"] <= 1e-5, got


# ---- python -m infinity.deepspeed: bad input --------------------------------------------------------------


@pytest.mark.parametrize("argv,said", [
    ([], "expected SCRIPT (or -m MODULE)"),
    (["--add-local-rank"], "expected SCRIPT"),
    (["/no/such/job.py"], "SCRIPT /no/such/job.py: not a file"),
    (["--add-local-rank", "JOB"], "--add-local-rank: LOCAL_RANK is not set")])
def test_boot_errors_are_one_line_and_status_2(tmp_path, monkeypatch, capsys, argv, said):
    (tmp_path / "job.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        boot([str(tmp_path / "job.py") if a == "JOB" else a for a in argv])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
    assert not infinity.deepspeed._alias.is_active()


# ---- the adapters ------------------------------------------------------------------------------------------


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.square().mean()


def test_param_status_tells_gathered_from_released():
    torch.manual_seed(0)
    model = _Small()
    engine, *_ = infinity.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    try:
        params = list(engine.module.parameters())
        assert {param_status(p) for p in params} == {ZeroParamStatus.NOT_AVAILABLE}
        first = list(engine.module.blocks[0].parameters())
        with GatheredParameters(first):
            assert {param_status(p) for p in first} == {ZeroParamStatus.AVAILABLE}
            assert all(p.numel() == 36 or p.numel() == 6 for p in first)  # full values, not a shard
            assert {param_status(p) for p in engine.module.blocks[1].parameters()} == {ZeroParamStatus.NOT_AVAILABLE}
        assert {param_status(p) for p in first} == {ZeroParamStatus.NOT_AVAILABLE}
        with pytest.raises(ValueError, match="fwd_module: not supported"):
            GatheredParameters(first, fwd_module=engine.module.blocks[0])
    finally:
        engine.destroy()
    assert param_status(torch.nn.Parameter(torch.zeros(2))) is None  # not partitioned by infinity
    with infinity.Init():
        built = nn.Linear(2, 2)
    assert param_status(built.weight) is ZeroParamStatus.NOT_AVAILABLE  # no values before initialize


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_steps_as_torch(adam_w_mode, reference):
    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = FusedAdam(a.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    theirs = reference(b.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, ours), (b, theirs)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None  # set_grad_none
    assert ours.adamw_mode is adam_w_mode  # what the engine reads of a client optimizer
    with pytest.raises(ValueError, match="bias_correction: False is not supported"):
        FusedAdam(a.parameters(), bias_correction=False)


def test_clone_tensors_for_torch_save_owns_its_storage():
    big = torch.arange(100.0)
    state = {"view": big[:3], "nested": [big[10:12], (big[20:21],)], "step": 7}
    cloned = clone_tensors_for_torch_save(state)
    assert cloned["step"] == 7 and isinstance(cloned["nested"][1], tuple)
    pairs = ((cloned["view"], big[:3]), (cloned["nested"][0], big[10:12]), (cloned["nested"][1][0], big[20:21]))
    for got, want in pairs:
        assert torch.equal(got, want)
        assert got.untyped_storage().nbytes() == want.numel() * 4  # not the 100-element storage
    big.zero_()
    assert cloned["view"].tolist() == [0.0, 1.0, 2.0]


def test_accelerator_on_the_cpu():
    acc = get_accelerator()
    assert acc is get_accelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name(), acc.current_device()) == \
        ("cpu", "cpu", "cpu", 0)
    assert acc.communication_backend_name() == "gloo" and acc.device_count() == 1 and acc.is_available()
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and torch.bfloat16 in acc.supported_dtypes()
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0 and acc.memory_stats() == {}
    assert acc.total_memory() >= acc.available_memory() > 0
    acc.manual_seed(123)
    first = torch.rand(3)
    acc.manual_seed_all(123)
    assert torch.equal(torch.rand(3), first)  # the generator torch uses on this device
    assert acc.on_accelerator(torch.zeros(1)) and acc.pin_memory(first) is first


def test_comm_is_torch_distributed(monkeypatch):
    assert comm.get_rank is torch.distributed.get_rank and comm.barrier is torch.distributed.barrier
    assert comm.all_reduce is torch.distributed.all_reduce and comm.ReduceOp is torch.distributed.ReduceOp
    assert comm.init_distributed is infinity.init_distributed
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert comm.get_local_rank() == 3
    assert comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor()


def test_logger_is_the_engines_and_log_dist_names_the_rank(caplog):
    assert logger is logging.getLogger("infinity")
    with caplog.at_level(logging.INFO, logger="infinity"):
        log_dist("hello", ranks=[0])
        log_dist("not here", ranks=[1])
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] hello"]


def test_lr_schedule_names_are_the_classes():
    import infinity.optim.lr_schedules as schedules

    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert all(getattr(schedules, name).__name__ == name for name in VALID_LR_SCHEDULES)


def test_moe_groups_pass_through_without_experts():
    model = nn.Linear(3, 3)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "lr": 0.1})
    assert len(groups) == 1 and groups[0]["lr"] == 0.1 and groups[0]["params"] == list(model.parameters())
    model.weight.allreduce = False  # how DeepSpeed marks an expert's parameter
    with pytest.raises(ValueError, match="infinity has no mixture-of-experts support"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters())}])
