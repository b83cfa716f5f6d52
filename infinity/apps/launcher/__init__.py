"""`infinity run`: DeepSpeed's launcher flags and hostfile, on torch.distributed.run (torchrun).

    infinity run --num_gpus 2 train.py --deepspeed ds.json
    infinity run --hostfile hosts --master_addr 10.0.0.1 --include "w0@w1:0,1" train.py --deepspeed ds.json

[Note: what runs where]
Which hosts and slots are used is worked out by infinity.apps.launcher.hosts ([Note: resources]).
One node: torchrun on this host, as a child process (even when the one host is named in a
hostfile, as DeepSpeed does). Several nodes (or --force_multi): torchrun on every host over ssh
(`$INFINITY_SSH`, a command line, else `ssh`), each as `cd CWD && env VARS python -m
torch.distributed.run --nnodes N --node-rank i ...`, node rank i being the host's place in the
hostfile, all meeting at --master_addr:--master_port (torchrun's static rendezvous; the
address is asked of the first host with `hostname -I` when not given, as DeepSpeed does). With
--no_ssh, only this host's part runs (its --node_rank), as on a cluster that starts `infinity
run` on each node itself. VARS are the variables DeepSpeed's runner exports (NCCL*, PYTHON*,
UCX*, MV2*, MLFLOW*), infinity's own (INFINITY_*), the lines of `.deepspeed_env` (DS_ENV_FILE)
in the home and current directories, PYTHONPATH with the current directory first, and the
node's CUDA_VISIBLE_DEVICES, CROSS_RANK, CROSS_SIZE and LOCAL_SIZE.

Every rank is started as `python -m infinity.deepspeed --add-local-rank SCRIPT ARGS`, so
`deepspeed` means infinity inside it ([Note: the deepspeed alias] in infinity.deepspeed._alias) and the
script gets `--local_rank=<n>` before its own arguments, which pass through untouched
(`--no_local_rank` leaves it out). torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; ranks are numbered node by node.

[Note: devices]
On this host, the slots are the GPUs torch sees (CUDA_VISIBLE_DEVICES respected, as torchrun
does; slot i is the i-th of them), and --num_gpus defaults to all of them. Without a GPU (or
with INFINITY_DEVICE=cpu) the slots are CPU ranks on gloo: --num_gpus N starts N of them
(default 1), so the multi-rank path runs anywhere. A hostfile's slots are the host's GPU
indices, given to its ranks as CUDA_VISIBLE_DEVICES, as DeepSpeed does.

Deliberate differences from DeepSpeed's launcher: a --hostfile that does not exist is an error
(DeepSpeed warns and runs on this host alone), --node_rank without --no_ssh is an error (DeepSpeed
ignores it), counts a host does not have are errors ([Note: resources]); pdsh, MPI, SLURM,
elastic training, autotuning, --no_python and core binding are not provided.

When one node fails, the others are stopped here (their torchrun, or their ssh client; a remote
torchrun whose ssh client is stopped ends when its ranks lose their peers); the exit status is
the failed node's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

from infinity.apps.launcher.hosts import limit, parse_hostfile, select
from infinity.deepspeed._alias import ENV

__all__ = ["add_arguments", "run"]

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's: used when it exists and no --hostfile is given
DEFAULT_MASTER_PORT = 29500
_EXPORTED_PREFIXES = ("NCCL", "PYTHON", "UCX", "MV2", "MLFLOW", "INFINITY_")


class Node(NamedTuple):
    """One torchrun to start: on `host` (None: this host, without ssh)."""

    host: str | None
    argv: list[str]  # python -m torch.distributed.run ... (run on that host)
    env: dict[str, str]  # set for it on top of what it inherits (locally) or of the login shell's (ssh)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags (the subset infinity implements), then SCRIPT and its arguments."""
    parser.add_argument("-H", "--hostfile", help=f"hosts as 'HOST slots=N' lines (default: {DEFAULT_HOSTFILE} when "
                        "it exists, else this host alone)")
    parser.add_argument("-i", "--include", default="", help="use only these: HOST[:SLOT,...]@HOST...")
    parser.add_argument("-e", "--exclude", default="", help="use all but these: HOST[:SLOT,...]@HOST...")
    parser.add_argument("--num_nodes", type=_positive_int, help="use the first N hosts")
    parser.add_argument("--num_gpus", "--num_accelerators", type=_positive_int,
                        help="ranks per host: its first N GPUs (default all); N CPU ranks without a GPU (default 1)")
    parser.add_argument("--master_addr", default="", help="address of node 0 (default: 127.0.0.1 for one node, "
                        "else the first host's `hostname -I`)")
    parser.add_argument("--master_port", type=_port, default=DEFAULT_MASTER_PORT,
                        help=f"port of the rendezvous on node 0 (default {DEFAULT_MASTER_PORT})")
    parser.add_argument("--node_rank", type=_non_negative_int, help="this host's node rank (with --no_ssh)")
    parser.add_argument("--no_ssh", action="store_true", help="start only this host's ranks (each node runs "
                        "`infinity run --no_ssh --node_rank R` itself)")
    parser.add_argument("--force_multi", action="store_true", help="start even one host over ssh")
    parser.add_argument("--ssh_port", type=_port, help="ssh to this port")
    parser.add_argument("--no_local_rank", action="store_true", help="do not give the script --local_rank=<n>")
    parser.add_argument("--module", action="store_true", help="SCRIPT is a module name, run as `python -m` would")
    parser.add_argument("user_script", metavar="SCRIPT", help="the training script")
    parser.add_argument("user_args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments, untouched")


def run(args: argparse.Namespace) -> int:
    """Starts the job's torchruns and waits for them; bad input is one line and status 2."""
    try:
        nodes = _plan(args)
    except ValueError as e:
        print(f"infinity run: {e}", file=sys.stderr)
        return 2
    return _execute(nodes, args.ssh_port)


# ---- what to start ---------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> list[Node]:
    if not args.module and not os.path.isfile(args.user_script):
        raise ValueError(f"SCRIPT {args.user_script}: not a file")
    if (args.include or args.exclude) and (args.num_nodes is not None or args.num_gpus is not None):
        raise ValueError("--num_nodes / --num_gpus: cannot be combined with --include / --exclude")
    if args.node_rank is not None and not args.no_ssh:
        raise ValueError("--node_rank: only with --no_ssh (with ssh, each host's node rank is its place in the "
                         "hostfile)")
    hostfile = args.hostfile or (DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None)
    if hostfile is None:
        return [_local_node(args)]
    if not os.path.isfile(hostfile):
        raise ValueError(f"--hostfile {hostfile}: not a file")
    with open(hostfile) as f:
        pool = OrderedDict((h, list(range(n))) for h, n in parse_hostfile(f.read(), hostfile).items())
    hosts = limit(select(pool, args.include, args.exclude), args.num_nodes, args.num_gpus)
    if args.no_ssh:
        return [_this_node(args, hosts)]
    if len(hosts) == 1 and not args.force_multi:
        slots = next(iter(hosts.values()))
        return [Node(None, _torchrun(args, 1, 0, len(slots), args.master_addr or "127.0.0.1"),
                     _node_env(0, 1, slots, slots))]
    master_addr = args.master_addr or _ask_address(next(iter(hosts)), args.ssh_port)
    return [Node(host, _torchrun(args, len(hosts), rank, len(slots), master_addr),
                 {**_exports(), **_node_env(rank, len(hosts), slots, slots)})
            for rank, (host, slots) in enumerate(hosts.items())]


def _local_node(args: argparse.Namespace) -> Node:
    """This host alone, without a hostfile ([Note: devices])."""
    from infinity.deepspeed.accelerator import get_accelerator

    if args.num_nodes is not None and args.num_nodes > 1:
        raise ValueError(f"--num_nodes {args.num_nodes}: needs a --hostfile naming the hosts")
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":  # CPU ranks, as many as asked for
        pool = OrderedDict(localhost=list(range(args.num_gpus or 1)))
        slots = select(pool, args.include, args.exclude)["localhost"]
        return Node(None, _torchrun(args, 1, 0, len(slots), args.master_addr or "127.0.0.1"),
                    _node_env(0, 1, slots, None))
    count = accelerator.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",")[:count] if visible else [str(i) for i in range(count)]
    slots = limit(select(OrderedDict(localhost=list(range(count))), args.include, args.exclude), None,
                  args.num_gpus)["localhost"]
    return Node(None, _torchrun(args, 1, 0, len(slots), args.master_addr or "127.0.0.1"),
                _node_env(0, 1, slots, [names[s] for s in slots]))


def _this_node(args: argparse.Namespace, hosts: OrderedDict[str, list[int]]) -> Node:
    """--no_ssh: this host's part of a job over `hosts`."""
    rank = args.node_rank
    if rank is None or rank >= len(hosts):
        raise ValueError(f"--no_ssh: needs --node_rank, this host's place among the {len(hosts)} host(s) "
                         f"({', '.join(hosts)}): 0 to {len(hosts) - 1}, got {rank}")
    if len(hosts) > 1 and not args.master_addr:
        raise ValueError("--no_ssh: needs --master_addr (the address of node 0) with several hosts")
    slots = list(hosts.values())[rank]
    return Node(None, _torchrun(args, len(hosts), rank, len(slots), args.master_addr or "127.0.0.1"),
                _node_env(rank, len(hosts), slots, slots))


def _torchrun(args: argparse.Namespace, num_nodes: int, node_rank: int, num_procs: int, master_addr: str) -> list[str]:
    """torchrun for one node; its ranks run the script through the alias ([Note: what runs where])."""
    argv = [sys.executable, "-u", "-m", "torch.distributed.run", f"--nnodes={num_nodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={num_procs}", f"--master-addr={master_addr}", f"--master-port={args.master_port}",
            "-m", "infinity.deepspeed"]
    if not args.no_local_rank:
        argv.append("--add-local-rank")
    if args.module:
        argv.append("-m")
    return argv + [args.user_script, *args.user_args]


def _node_env(node_rank: int, num_nodes: int, slots: list[int], visible: list | None) -> dict[str, str]:
    """The variables DeepSpeed's launcher sets per node; CUDA_VISIBLE_DEVICES unless `visible` is None."""
    env = {"CROSS_RANK": str(node_rank), "CROSS_SIZE": str(num_nodes), "LOCAL_SIZE": str(len(slots)),
           ENV: "1"}  # [Note: the alias from the environment]: in everything the ranks start too
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible))
    return env


def _exports() -> dict[str, str]:
    """What a remote node gets of this environment ([Note: what runs where])."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_EXPORTED_PREFIXES) and k != "INFINITY_SSH"}
    cwd = os.path.abspath(".")
    env["PYTHONPATH"] = cwd + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    for directory in (os.path.expanduser("~"), "."):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            env.update(_read_env_file(path))
    return env


def _read_env_file(path: str) -> dict[str, str]:
    env = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, eq, value = line.partition("=")
            if not eq or not key:
                raise ValueError(f"{path}: line {number}: expected KEY=VALUE, got {line!r}")
            env[key.strip()] = value.strip()
    return env


# ---- ssh --------------------------------------------------------------------------------------------


def _ssh(host: str, command: str, ssh_port: int | None) -> list[str]:
    ssh = shlex.split(os.environ.get("INFINITY_SSH") or "ssh")
    return [*ssh, *(["-p", str(ssh_port)] if ssh_port else []), host, command]


def _remote_command(node: Node) -> str:
    assignments = [f"{k}={v}" for k, v in node.env.items()]
    return f"cd {shlex.quote(os.path.abspath('.'))} && " + shlex.join(["env", *assignments, *node.argv])


def _ask_address(host: str, ssh_port: int | None) -> str:
    """The first address `hostname -I` gives on `host` (DeepSpeed's choice of master_addr)."""
    try:
        out = subprocess.run(_ssh(host, "hostname -I", ssh_port), capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--master_addr: not given, and asking {host} for its address over ssh failed ({e}); "
                         "give --master_addr") from None
    words = out.stdout.split()
    if out.returncode != 0 or not words:
        raise ValueError(f"--master_addr: not given, and `hostname -I` on {host} over ssh gave no address "
                         f"(status {out.returncode}: {out.stderr.strip()[-200:]}); give --master_addr")
    return words[0]


# ---- running ----------------------------------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def _start(node: Node, ssh_port: int | None) -> subprocess.Popen:
    if node.host is None:
        return subprocess.Popen(node.argv, env={**os.environ, **node.env})
    # stdin from /dev/null: several ssh clients must not read this terminal
    return subprocess.Popen(_ssh(node.host, _remote_command(node), ssh_port), stdin=subprocess.DEVNULL)


def _status(returncode: int) -> int:
    """A shell's exit status for a child's returncode (-N, killed by signal N, is 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def _stop(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM to every node still running (torchrun passes it to its ranks), SIGKILL after the grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(nodes: list[Node], procs: list[subprocess.Popen]) -> int:
    while True:
        running = False
        for rank, (node, p) in enumerate(zip(nodes, procs)):
            returncode = p.poll()
            if returncode is None:
                running = True
            elif returncode != 0:
                if len(procs) > 1:
                    print(f"infinity run: node {rank} ({node.host}) exited with status "
                          f"{_status(returncode)}; stopping the other nodes", file=sys.stderr)
                _stop(procs)
                return _status(returncode)
        if not running:
            return 0
        time.sleep(0.2)


def _execute(nodes: list[Node], ssh_port: int | None) -> int:
    """Starts every node, waits for all; SIGINT / SIGTERM stop them all."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    procs: list[subprocess.Popen] = []
    try:
        for node in nodes:
            procs.append(_start(node, ssh_port))
        return _wait(nodes, procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 128 + signal.SIGINT
    except _Terminated:
        _stop(procs)
        return 128 + signal.SIGTERM
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
