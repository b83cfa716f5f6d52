"""aio_bench_sweep: find the `aio` settings that move the most bytes on a disk.

    aio_bench_sweep --nvme-path /local_nvme --io-size 1G --output best.json

Sweeps block size x queue depth x threads x single_submit x overlap_events x engine, timing
reads and writes of one file under --nvme-path with O_DIRECT, prints the table sorted by GB/s
and writes the best setting as a ready-to-paste `{"aio": {...}}` block for the config.
The file is written once before timing, so writes measure overwriting in place (as the
engine's store does; on ext4 writing fresh extents runs at about half speed).

The best setting is the one that reads and writes the same bytes in the least total time (a
half-duplex disk serves them one after the other), chosen by the code the engine uses on a config
without an `aio` section; `--quick`'s grid is the engine's, and `--remember` stores the choice
where the engine looks for it ([Note: the disk tunes itself] in infinity/io/autotune.py).

[Note: sweep values checked first]
Every value is checked before the file is written, and a bad one is one line naming its flag
(exit 2), not a traceback part way through the grid. The ranges of block size, queue depth and
threads are the handle's own (a throwaway `AsyncIOHandle` is asked, so there is one rule). Block
and I/O sizes must also be whole pages: the engine cuts O_DIRECT pieces at page boundaries, so a
block of 6000 bytes would be timed as 8K and written into the config as 6000, and an I/O size
with a partial page would time some page-cache copies.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile

import psutil
from tqdm import tqdm

from infinity.io import AsyncIOHandle, autotune, available_engines
from infinity.io.autotune import Measured, Setting, best_setting

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_size(text: str) -> int:
    """'1G' -> 1073741824, '512K', '1048576', '8M'. Binary units."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (expected e.g. 1G, 512M, 1048576)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole number of bytes: {text!r}")
    return int(value)


def _grid(args: argparse.Namespace) -> list[Setting]:
    if args.quick:  # the engine's own grid, unless a flag narrows it
        base = autotune.engine_grid()
        defaults = dict(block_sizes=sorted({s.block_size for s in base}),
                        queue_depths=sorted({s.queue_depth for s in base}), threads=[1], single_submit=[False],
                        overlap_events=[True], engines=[base[0].engine])
    else:
        defaults = dict(block_sizes=[128 << 10, 1 << 20, 4 << 20, 8 << 20], queue_depths=[4, 8, 16, 32, 64],
                        threads=[1, 2], single_submit=[False, True], overlap_events=[True, False],
                        engines=[e for e in available_engines() if e != "psync"] or ["psync"])
    pick = {k: getattr(args, k) or v for k, v in defaults.items()}
    return [Setting(*combo) for combo in itertools.product(
        pick["block_sizes"], pick["queue_depths"], pick["threads"], pick["single_submit"],
        pick["overlap_events"], pick["engines"])]


def _check_target(parser: argparse.ArgumentParser, directory: str, io_size: int) -> None:
    """Before any work: a bad --nvme-path, or an --io-size its disk cannot hold, is a bad value
    (exit 2, one line), as every other flag's is."""
    if not os.path.isdir(directory):
        parser.error(f"argument --nvme-path {directory}: not a directory")
    try:  # a try, not os.access: root passes that on a read-only mount
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        parser.error(f"argument --nvme-path {directory}: cannot create a file there ({e.strerror})")
    free = shutil.disk_usage(directory).free
    if free < io_size + (64 << 20):
        parser.error(f"argument --io-size: {directory} needs {io_size / 2**30:.2f} GiB for it plus 64 MiB "
                     f"headroom, and has {free / 2**30:.2f} GiB free")


def _plot(results: list[Measured], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("aio_bench_sweep: --plot needs matplotlib (pip install 'infinity[plot]')") from None
    ops = sorted({op for _, op, _ in results})
    blocks = sorted({s.block_size for s, _, _ in results})
    depths = sorted({s.queue_depth for s, _, _ in results})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        grid = [[max((g for s, o, g in results if o == op and s.block_size == b and s.queue_depth == q), default=0.0)
                 for q in depths] for b in blocks]
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(depths)), [str(q) for q in depths])
        ax.set_yticks(range(len(blocks)), [f"{b >> 10}K" for b in blocks])
        ax.set_xlabel("queue_depth")
        ax.set_ylabel("block_size")
        ax.set_title(f"{op} GB/s (best over other knobs)")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def _handle_accepts(**setting: int) -> None:
    """Raises ArgumentTypeError with the handle's own message when it refuses `setting`
    ([Note: sweep values checked first])."""
    try:
        AsyncIOHandle(engine="psync", **setting)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _block_size(text: str) -> int:
    value = parse_size(text)
    if value % _PAGE:
        raise argparse.ArgumentTypeError(f"expected a multiple of {_PAGE} bytes (the page size, where the engine "
                                         f"cuts its pieces), got {text!r}")
    _handle_accepts(block_size=value)
    return value


def _queue_depth(text: str) -> int:
    value = _positive(text)
    _handle_accepts(queue_depth=value)
    return value


def _thread_count(text: str) -> int:
    value = _positive(text)
    _handle_accepts(thread_count=value)
    return value


def _memory_available() -> int:
    return psutil.virtual_memory().available


def _flag(text: str) -> bool:
    word = text.lower()
    if word not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return word in ("1", "true", "yes")


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any work: where --output and --plot go, and that --plot can be drawn."""
    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"{flag} {path}: cannot write a file there")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot: needs matplotlib (pip install 'infinity[plot]')")


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, io_size: int) -> None:
    """Before any work: the I/O buffer is whole pages and fits in memory, the engines exist here."""
    if io_size % _PAGE:
        parser.error(f"argument --io-size: expected a multiple of {_PAGE} bytes (the page size; a partial page "
                     f"goes through the page cache), got {io_size}")
    free = _memory_available()
    if io_size > free:
        parser.error(f"argument --io-size: {io_size / 2**30:.2f} GiB is the size of the buffer held in memory, "
                     f"and {free / 2**30:.2f} GiB of memory is available")
    missing = [e for e in args.engines or () if e not in available_engines()]
    if missing:
        parser.error(f"argument --engines {' '.join(missing)}: not offered by this kernel "
                     f"(available: {', '.join(available_engines())})")


class _OneLineParser(argparse.ArgumentParser):
    """argparse's `prog: error: message` without the usage block above it, so that a bad value
    reads as one line (--help still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _OneLineParser:
    p = _OneLineParser(prog="aio_bench_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True, help="directory on the disk to measure")
    p.add_argument("--io-size", type=parse_size, default=None, help="bytes per transfer (default 1G, 256M with --quick)")
    p.add_argument("--read", action="store_true", help="measure reads (default: reads and writes)")
    p.add_argument("--write", action="store_true", help="measure writes (default: reads and writes)")
    p.add_argument("--block-sizes", type=_block_size, nargs="+", help=f"multiples of the page size ({_PAGE})")
    p.add_argument("--queue-depths", type=_queue_depth, nargs="+")
    p.add_argument("--threads", type=_thread_count, nargs="+")
    p.add_argument("--single-submit", type=_flag, nargs="+")
    p.add_argument("--overlap-events", type=_flag, nargs="+")
    p.add_argument("--engines", nargs="+", choices=["io_uring", "aio", "psync"])
    p.add_argument("--quick", action="store_true", help="a small grid on 256M: a minute, not an hour")
    p.add_argument("--repeat", type=_positive, default=None,
                   help="timings per setting and op, the best kept (default 1, 2 with --quick as the engine)")
    p.add_argument("--output", help="write the best setting here as {\"aio\": {...}}")
    p.add_argument("--remember", action="store_true",
                   help="store the best setting as this disk's, for engines whose config has no aio section")
    p.add_argument("--plot", help="save a block_size x queue_depth heat map (needs matplotlib)")
    return p


def _report(results: list) -> Setting:
    """Prints every timing, fastest first, and the best setting as a config's aio section;
    returns it."""
    print(f"\n{'op':<6}{'GB/s':>7}  {'engine':<9}{'block':>8}{'qd':>5}{'thr':>5}  single  overlap")
    for setting, op, gbps in sorted(results, key=lambda r: -r[2]):
        print(f"{op:<6}{gbps:7.2f}  {setting.engine:<9}{setting.block_size >> 10:>7}K{setting.queue_depth:>5}"
              f"{setting.thread_count:>5}  {str(setting.single_submit):<7} {setting.overlap_events}")
    best = best_setting(results)
    figures = ", ".join(f"{op} {g:.2f} GB/s" for s, op, g in results if s == best)
    print(f"\nbest ({figures}; least read + write time):\n{json.dumps({'aio': best.aio_block()}, indent=2)}")
    return best


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _check_outputs(p, args)

    io_size = args.io_size or (autotune.DEFAULT_TUNE_BYTES if args.quick else (1 << 30))
    ops = [op for op, on in (("read", args.read), ("write", args.write)) if on] or ["read", "write"]
    if args.remember and len(ops) < 2:
        p.error("--remember: the engine's choice needs reads and writes measured (leave out --read / --write)")
    _check_target(p, args.nvme_path, io_size)
    _check_sizes(p, args, io_size)
    grid = _grid(args)

    # SIGTERM takes the same way out as Ctrl-C, so the sweep's file is removed either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    repeat = args.repeat or (2 if args.quick else 1)
    try:
        results = autotune.sweep(args.nvme_path, grid, io_size, ops=tuple(ops), repeat=repeat,
                                 progress=lambda runs: tqdm(runs, desc="aio sweep", unit="run"))
    except KeyboardInterrupt:
        print("aio_bench_sweep: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"aio_bench_sweep: {e}", file=sys.stderr)
        return 1

    best = _report(results)
    if args.remember:
        gbps = {r.op: r.gbps for r in results if r.setting == best}
        try:
            path = autotune.remember(autotune.device_of(args.nvme_path), best, gbps["read"], gbps["write"],
                                     autotune.least_request(results), how="aio_bench_sweep")
        except OSError as e:
            print(f"aio_bench_sweep: --remember: cannot store it in {autotune.cache_dir()}: {e}", file=sys.stderr)
            return 1
        print(f"stored for this disk in {path}: engines whose config has no aio section use it")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"aio": best.aio_block()}, f, indent=2)
            f.write("\n")
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
