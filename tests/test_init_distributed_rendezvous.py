"""`init_distributed(init_method=..., rank=, world_size=)`: the rendezvous DeepSpeed's own test
harness uses (a file:// store, rank and world size passed, no launcher environment)."""

from __future__ import annotations

import os
import subprocess
import sys

_RANK = """
import sys, torch, torch.distributed as dist, infinity
rank, store = int(sys.argv[1]), sys.argv[2]
infinity.init_distributed(dist_backend="gloo", init_method="file://" + store, rank=rank, world_size=2)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(dist.get_rank(), dist.get_world_size(), value.item())
dist.destroy_process_group()
"""


def test_a_file_store_with_rank_and_world_size_given(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "INFINITY_DEVICE")}
    env["INFINITY_DEVICE"] = "cpu"
    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(store)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=180) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err
    assert [out.split() for out, _ in outs] == [["0", "2", "3.0"], ["1", "2", "3.0"]]
