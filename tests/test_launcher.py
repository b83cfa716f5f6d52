"""`infinity run`: DeepSpeed's hostfile and --include/--exclude rules, the one-line errors, and
real launches through torchrun: two gloo ranks on this host, and two "hosts" reached through a
stand-in for ssh that runs the command here in a fresh environment, as a login would."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections import OrderedDict

import pytest

from infinity.apps.cli import main as infinity_main
from infinity.apps.launcher import _plan, add_arguments
from infinity.apps.launcher.hosts import limit, parse_hostfile, parse_node_specs, select

POOL = OrderedDict(w0=[0, 1, 2, 3], w1=[0, 1, 2, 3])

# Each rank records what it was started with, then checks that it can all_reduce with the others.
WORKER = """
import json, os, sys
import torch, torch.distributed as dist
import deepspeed

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES")
with open(os.path.join(os.environ["INFINITY_TEST_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "sum": total.item(),
               "deepspeed": deepspeed.__file__, "rank_from_comm": deepspeed.comm.get_rank()}, f)
dist.destroy_process_group()
"""

# ssh [-p PORT] HOST COMMAND, run here: only what the command line exports reaches it.
FAKE_SSH = """#!/bin/sh
[ "$1" = "-p" ] && shift 2
echo "$1" >> "$FAKE_SSH_LOG"
shift
exec env -i PATH="$PATH" HOME="$HOME" sh -c "$*"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(out) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    return [json.loads(f.read_text()) for f in files]


# ---- hostfile, --include / --exclude, --num_nodes / --num_gpus --------------------------------------


def test_hostfile_lines_comments_and_order():
    text = "# the cluster\nworker-1 slots=4\n\n   worker-0 slots=2  # two of them\nw2 slots=8 max_slots=8\n"
    assert parse_hostfile(text, "hosts") == OrderedDict([("worker-1", 4), ("worker-0", 2), ("w2", 8)])


@pytest.mark.parametrize("text,said", [
    ("w0 slots=2\nw1 slot=2\n", "--hostfile hosts: line 2: expected 'HOST slots=N', got 'w1 slot=2'"),
    ("w0\n", "line 1: expected 'HOST slots=N'"),
    ("w0 slots=2x\n", "line 1: expected 'HOST slots=N'"),
    ("w0 slots=2\nw0 slots=4\n", "line 2: host 'w0' is listed twice"),
    ("w0 slots=0\n", "line 1: host 'w0' has slots=0, expected at least 1"),
    ("# nothing\n\n", "--hostfile hosts: names no host")])
def test_bad_hostfiles_are_refused_naming_the_line(text, said):
    with pytest.raises(ValueError) as e:
        parse_hostfile(text, "hosts")
    assert said in str(e.value)


def test_include_and_exclude_follow_deepspeed():
    # DeepSpeed's own examples: "worker-0@worker-1:0,2" and "worker-1:0"
    assert select(POOL, include="w0@w1:0,2") == OrderedDict(w0=[0, 1, 2, 3], w1=[0, 2])
    assert select(POOL, exclude="w1:0") == OrderedDict(w0=[0, 1, 2, 3], w1=[1, 2, 3])
    assert select(POOL, exclude="w0") == OrderedDict(w1=[0, 1, 2, 3])
    assert select(POOL, include="w1:3,1@w0:2") == OrderedDict(w0=[2], w1=[1, 3])  # hostfile order, sorted slots
    assert select(POOL, include="w1:1@w1:2") == OrderedDict(w1=[1, 2])  # a host named twice: the union
    assert select(POOL) == POOL
    assert parse_node_specs("a@b:1,0", "--include") == OrderedDict(a=[], b=[0, 1])


@pytest.mark.parametrize("include,exclude,said", [
    ("w9", "", "--include: host 'w9' is not among the hosts (w0, w1)"),
    ("", "w1:7", "--exclude: host 'w1' has no slot 7 (its slots: 0, 1, 2, 3)"),
    ("w0:x", "", "--include w0:x: slot 'x' of host 'w0' is not a number"),
    ("w0@", "", "--include w0@: empty host name"),
    ("w0", "w1", "--include and --exclude: give one of them, not both"),
    ("", "w0@w1", "--exclude w0@w1: leaves no slot to run on")])
def test_bad_include_exclude_name_the_flag(include, exclude, said):
    with pytest.raises(ValueError) as e:
        select(POOL, include, exclude)
    assert said in str(e.value)


def test_num_nodes_and_num_gpus_take_the_first_ones():
    assert limit(POOL, 1, None) == OrderedDict(w0=[0, 1, 2, 3])
    assert limit(POOL, None, 2) == OrderedDict(w0=[0, 1], w1=[0, 1])
    with pytest.raises(ValueError, match="--num_nodes 3: only 2 host"):
        limit(POOL, 3, None)
    with pytest.raises(ValueError, match="--num_gpus 5: host 'w0' has 4 slot"):
        limit(POOL, None, 5)


# ---- errors before anything starts ---------------------------------------------------------------------


@pytest.mark.parametrize("argv,said", [
    (["run", "no_such_script.py"], "infinity run: SCRIPT no_such_script.py: not a file"),
    (["run", "--hostfile", "HOSTS", "SCRIPT"], "infinity run: --hostfile HOSTS: line 2: expected 'HOST slots=N'"),
    (["run", "--hostfile", "/no/such/hosts", "SCRIPT"], "infinity run: --hostfile /no/such/hosts: not a file"),
    (["run", "--hostfile", "HOSTS_OK", "--include", "w9", "SCRIPT"], "--include: host 'w9' is not among the hosts"),
    (["run", "--include", "elsewhere", "SCRIPT"], "--include: host 'elsewhere' is not among the hosts (localhost)"),
    (["run", "--num_gpus", "2", "--exclude", "localhost:1", "SCRIPT"], "--num_nodes / --num_gpus: cannot be combined"),
    (["run", "--num_nodes", "2", "SCRIPT"], "--num_nodes 2: needs a --hostfile"),
    (["run", "--node_rank", "1", "SCRIPT"], "--node_rank: only with --no_ssh"),
    (["run", "--hostfile", "HOSTS_OK", "--no_ssh", "--node_rank", "2", "SCRIPT"], "--no_ssh: needs --node_rank"),
    (["run", "--hostfile", "HOSTS_OK", "--no_ssh", "--node_rank", "1", "SCRIPT"], "--no_ssh: needs --master_addr")])
def test_bad_input_is_one_line_and_status_2(tmp_path, capfd, argv, said):
    (tmp_path / "hosts").write_text("w0 slots=1\nw1\n")
    (tmp_path / "hosts_ok").write_text("w0 slots=1\nw1 slots=1\n")
    (tmp_path / "job.py").write_text("raise SystemExit('must not run')\n")
    names = {"HOSTS": str(tmp_path / "hosts"), "HOSTS_OK": str(tmp_path / "hosts_ok"),
             "SCRIPT": str(tmp_path / "job.py")}
    said = said.replace("HOSTS", names["HOSTS"])
    assert infinity_main([names.get(a, a) for a in argv]) == 2
    err = capfd.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag,value", [("--num_gpus", "0"), ("--num_nodes", "-1"), ("--master_port", "70000")])
def test_bad_numbers_are_refused_by_the_parser(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        infinity_main(["run", flag, value, "job.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and ": expected " in err


def test_the_ranks_get_local_rank_unless_no_local_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for extra, local_rank in (([], ["--add-local-rank"]), (["--no_local_rank"], [])):
        args = parser.parse_args([*extra, "--num_gpus", "3", str(script), "--deepspeed", "ds.json"])
        (node,) = _plan(args)
        assert node.host is None  # this host, no ssh
        assert node.argv[1:] == ["-u", "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0",
                                 "--nproc-per-node=3", "--master-addr=127.0.0.1", "--master-port=29500",
                                 "-m", "infinity.deepspeed", *local_rank, str(script), "--deepspeed", "ds.json"]


class _FourGpus:
    """What get_accelerator() answers on a host with 4 GPUs visible."""

    def device_name(self, index=None):
        return "cuda"

    def device_count(self):
        return 4


@pytest.mark.parametrize("flags,nproc,visible", [
    ([], 4, "3,5,6,7"),
    (["--num_gpus", "2"], 2, "3,5"),
    (["--include", "localhost:1,3"], 2, "5,7"),
    (["--exclude", "localhost:0"], 3, "5,6,7")])
def test_gpu_slots_count_the_visible_gpus(tmp_path, monkeypatch, flags, nproc, visible):
    import infinity.deepspeed.accelerator as accelerator

    monkeypatch.setattr(accelerator, "_accelerator", _FourGpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    script = tmp_path / "job.py"
    script.write_text("")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (node,) = _plan(parser.parse_args([*flags, str(script)]))
    assert f"--nproc-per-node={nproc}" in node.argv
    assert node.env["CUDA_VISIBLE_DEVICES"] == visible and node.env["LOCAL_SIZE"] == str(nproc)
    with pytest.raises(ValueError, match="--num_gpus 5: host 'localhost' has 4 slot"):
        _plan(parser.parse_args(["--num_gpus", "5", str(script)]))


# ---- real launches -------------------------------------------------------------------------------------------


def test_two_cpu_ranks_on_this_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: its source tree would shadow the installed package
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    monkeypatch.setenv("INFINITY_TEST_OUT", str(tmp_path))
    args = ["--foo", "bar baz", "--num_gpus", "9", "--local_rank=7"]  # the script's, untouched
    assert infinity_main(["run", "--num_gpus", "2", "--master_port", str(_free_port()), str(script), *args]) == 0
    ranks = _ranks(tmp_path)
    assert len(ranks) == 2
    for r, got in enumerate(ranks):
        assert got["argv"] == [f"--local_rank={r}", *args]
        assert {k: got["env"][k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} == \
            {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)}
        assert got["sum"] == 3.0  # 1 + 2: the all_reduce went through both ranks
        assert got["rank_from_comm"] == r
        assert got["deepspeed"].startswith(os.path.dirname(os.path.abspath(__import__("infinity").__file__)))
        assert got["env"]["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")  # CPU ranks: untouched


def _ssh_stand_in(tmp_path, monkeypatch, hosts: str) -> None:
    """A hostfile of `hosts` whose every host is this machine, reached through FAKE_SSH (which
    logs the host names to ssh.log)."""
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    (tmp_path / "hosts").write_text(hosts)
    monkeypatch.setenv("INFINITY_SSH", str(ssh))
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))


def test_two_hosts_over_the_ssh_stand_in(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    _ssh_stand_in(tmp_path, monkeypatch, "# both are this machine\nnode-a slots=1\nnode-b slots=4\n")
    monkeypatch.setenv("INFINITY_TEST_OUT", str(tmp_path))  # INFINITY_*: exported to every node
    monkeypatch.chdir(tmp_path)
    rc = infinity_main(["run", "--hostfile", "hosts", "--num_gpus", "1", "--master_addr", "127.0.0.1",
                        "--master_port", str(_free_port()), "job.py", "--deepspeed", "ds config.json"])
    assert rc == 0
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["node-a", "node-b"]  # started together
    ranks = _ranks(tmp_path)
    assert [(g["env"]["RANK"], g["env"]["CROSS_RANK"], g["env"]["LOCAL_RANK"]) for g in ranks] == \
        [("0", "0", "0"), ("1", "1", "0")]
    for got in ranks:
        assert got["argv"] == ["--local_rank=0", "--deepspeed", "ds config.json"]
        assert got["env"]["WORLD_SIZE"] == "2" and got["env"]["CROSS_SIZE"] == "2"
        assert got["env"]["PYTHONPATH"].split(":")[0] == str(tmp_path)
        assert got["env"]["CUDA_VISIBLE_DEVICES"] == "0"  # the host's slot, as DeepSpeed sets it
        assert got["sum"] == 3.0


def test_a_failing_rank_fails_the_launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.exit(3)\n")
    rc = infinity_main(["run", "--num_gpus", "1", "--master_port", str(_free_port()), str(script)])
    assert rc != 0


# ---- two nodes of two slots, simulated on this host ---------------------------------------------------

# ZeRO-3 with parameters and optimizer state on NVMe, clipping 1.0, 3 steps of a small MLP: each rank
# records its losses and, at the end, the full weights.
TRAINER = """
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
import deepspeed

deepspeed.init_distributed()
rank = dist.get_rank()
if os.environ.get("INFINITY_TEST_FAIL_RANK") == str(rank):
    sys.exit(7)  # the other ranks are left waiting for it in their first collective
out, nvme = os.environ["INFINITY_TEST_OUT"], os.path.join(os.environ["INFINITY_TEST_OUT"], f"nvme{rank}")
os.makedirs(nvme, exist_ok=True)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_param": {"device": "nvme", "nvme_path": nvme},
                                "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.GELU(), nn.Linear(8, 2))
engine, _, _, _ = deepspeed.initialize(model=model, config=config)
losses = []
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(2, 8, generator=g), torch.randint(0, 2, (2,), generator=g)
    loss = nn.functional.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    weights = {n: p.detach().cpu().flatten().tolist() for n, p in engine.module.named_parameters()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"losses": losses, "weights": weights, "norm": float(engine.get_global_grad_norm()),
               "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CROSS_RANK")}}, f)
engine.close()
"""


def _two_node_launch(tmp_path, monkeypatch, out, **env) -> int:
    """`infinity run --hostfile` over two hosts of two slots, both this machine (the ssh stand-in)."""
    _ssh_stand_in(tmp_path, monkeypatch, "node-a slots=2\nnode-b slots=2\n")
    monkeypatch.setenv("INFINITY_TEST_OUT", str(out))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return infinity_main(["run", "--hostfile", "hosts", "--master_addr", "127.0.0.1", "--master_port",
                          str(_free_port()), "job.py"])


@pytest.mark.slow
def test_two_nodes_of_two_slots_train_as_one_node_of_four(tmp_path, monkeypatch):
    """The same ZeRO-3 NVMe job on 4 ranks, started as two nodes of two slots (torchrun on each
    over the ssh stand-in, ranks numbered node by node) and as one node of four: every rank's
    losses, gradient norm and final weights are the same, bit for bit."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(TRAINER)
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    two.mkdir()
    one.mkdir()
    assert _two_node_launch(tmp_path, monkeypatch, two) == 0
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["node-a", "node-b"]
    monkeypatch.setenv("INFINITY_TEST_OUT", str(one))
    assert infinity_main(["run", "--num_gpus", "4", "--master_port", str(_free_port()), "job.py"]) == 0
    nodes, single = _ranks(two), _ranks(one)
    assert len(nodes) == len(single) == 4
    assert [(g["env"]["RANK"], g["env"]["CROSS_RANK"], g["env"]["LOCAL_RANK"]) for g in nodes] == \
        [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    for a, b in zip(nodes, single):
        assert a["losses"] == b["losses"] and a["norm"] == b["norm"] and a["weights"] == b["weights"]
    assert nodes[0]["losses"] != nodes[1]["losses"]  # the ranks saw different data


@pytest.mark.slow
def test_a_failed_node_stops_the_other_with_its_status(tmp_path, monkeypatch, capfd):
    """Rank 3 (node-b's second slot) exits with status 7 right after joining: node-b's torchrun
    fails (status 1, torchrun's for a failed rank) and the launch returns that status, naming
    the node, and stops node-a, whose ranks would otherwise wait for rank 3 in initialize."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(TRAINER)
    start = time.monotonic()
    assert _two_node_launch(tmp_path, monkeypatch, tmp_path, INFINITY_TEST_FAIL_RANK="3") == 1
    assert time.monotonic() - start < 120
    err = capfd.readouterr().err
    assert "exitcode: 7" in err and "node 1 (node-b) exited with status 1; stopping the other nodes" in err
    assert not list(tmp_path.glob("rank*.json"))
