"""The streaming step with its optimizer pool cut for different depths, in one process, rounds
interleaved: how `STREAM_DEPTH` ([Note: the pool is a budget] in
infinity/offload/optimizer/sizing.py) was chosen.

    python bench/bench_stream_depth.py --depths 16 8 4 [--base stream-96m] [--clip 0] --rounds 5 --nvme-path DIR

Each depth is bench_streaming.py's `--base` case with `STREAM_DEPTH` set to it while its engine is
built (the cut is chosen then); bench_streaming.py's options pass through.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_streaming as streaming  # noqa: E402
import bench_user_configs as user  # noqa: E402

import infinity.offload.optimizer.sizing as sizing  # noqa: E402


def at_depth(base, depth: int):
    def config(work: str):
        sizing.STREAM_DEPTH = depth  # read by choose_pieces when the engine is built, right after this
        return base(work)
    return config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=[16, 8])
    p.add_argument("--base", choices=list(streaming.STREAMING), default="stream-96m")
    args, rest = p.parse_known_args()
    for depth in args.depths:
        case = at_depth(streaming.STREAMING[args.base], depth)
        streaming.STREAMING[f"depth-{depth}"] = user.CASES[f"depth-{depth}"] = case
    sys.argv = [sys.argv[0], *rest, "--cases", *[f"depth-{d}" for d in args.depths]]
    return streaming.main()


if __name__ == "__main__":
    sys.exit(main())
