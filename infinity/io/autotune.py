"""The `aio` setting a disk is measured to want: a short sweep, cached per device.

[Note: the disk tunes itself]
A config without an `aio` section gets the setting this disk runs best with, not DeepSpeed's
1 MiB / queue depth 8 (on this project's development disk 8 MiB / 32 moved 35-60% more). The
first engine that offloads to a device runs `sweep` on its NVMe directory: each setting of
`ENGINE_GRID` reads and writes one file with O_DIRECT (written once first, so writes overwrite
in place as the engine's store does), and `best_setting` keeps the one whose read plus write
time is least, the cost of a step on a half-duplex disk, which moves about as many bytes each
way. The sweep also says from which request size the disk keeps that pace (`least_request`:
the least block size whose best setting is within `PACE` of it), which bounds how small the
optimizer tier cuts the pieces it streams. The choice is cached under `cache_dir()` in one file per device, keyed by the device's
major:minor and the model the kernel reports for it (a different disk behind the same numbers
is measured again), and every later engine on that device reads it: a step never pays for the
sweep twice. A cache file that cannot be read, names an I/O engine this kernel lacks, or
describes another disk is measured again and replaced (written whole, then renamed). Ranks of
one node that start together take a lock on the device's cache file: the first measures, the
others wait and read its result, so no sweep is timed against another.

`aio_bench_sweep` ranks its settings with the same `best_setting`, its `--quick` grid is
`ENGINE_GRID`, and `--remember` stores its choice where the engine looks: the tool and the
engine choose alike. An explicit `aio` section is honoured as given and nothing is measured; a
file system that refuses O_DIRECT (tmpfs) is not measured either (its I/O is page-cache copies,
which no block size changes).

Environment: INFINITY_CACHE_DIR moves the cache (default $XDG_CACHE_HOME/infinity, else
~/.cache/infinity); INFINITY_AIO_TUNE_BYTES sets the bytes per timed transfer (default 256 MiB,
less where memory or disk is short; the tests use a few MiB).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import psutil

from infinity.io.handle import AsyncIOHandle, available_engines
from infinity.io.memory import PAGE_SIZE, aligned_empty

CACHE_VERSION = 2  # 2: the least request that keeps the pace (`least_request`)
DEFAULT_TUNE_BYTES = 256 << 20
PACE = 1.10  # a request size keeps the disk's pace when its best read + write time is within this of the best's
_MIN_TUNE_BYTES = 1 << 20


class Setting(NamedTuple):
    """One point of a sweep: the keys of the config's `aio` section."""

    block_size: int
    queue_depth: int
    thread_count: int
    single_submit: bool
    overlap_events: bool
    engine: str

    def handle(self) -> AsyncIOHandle:
        return AsyncIOHandle(self.block_size, self.queue_depth, self.thread_count, self.single_submit,
                             self.overlap_events, self.engine)

    def aio_block(self) -> dict:
        """The config's `aio` section for this setting (JSON booleans, the keys infinity reads)."""
        return dict(self._asdict())

    def describe(self) -> str:
        return (f"block_size {self.block_size >> 10} KiB, queue_depth {self.queue_depth}, thread_count "
                f"{self.thread_count}, engine {self.engine}")


class Measured(NamedTuple):
    """One timing of a sweep."""

    setting: Setting
    op: str  # "read" or "write"
    gbps: float


class Choice(NamedTuple):
    """What an engine uses on a device, and where it came from (for the line it logs)."""

    setting: Setting
    read_gbps: float
    write_gbps: float
    cache_file: str  # "" when it could not be stored
    from_cache: bool
    seconds: float  # the sweep's duration, or 0.0 from the cache
    min_request: int  # bytes: the least block size that keeps the disk's pace (`least_request`)

    def describe(self) -> str:
        if self.from_cache:
            how = f"from the cache {self.cache_file}"
        else:
            where = f"cached in {self.cache_file}" if self.cache_file else f"not cached ({cache_dir()} not writable)"
            how = f"measured in {self.seconds:.1f} s, {where}"
        return (f"{self.setting.describe()} (read {self.read_gbps:.2f} GB/s, write {self.write_gbps:.2f} GB/s; "
                f"its pace from {self.min_request >> 10} KiB requests; {how})")


def engine_grid() -> list[Setting]:
    """The settings an engine tries ([Note: the disk tunes itself]): the block sizes and depths
    that decided this disk's speed, on the best I/O engine the kernel offers, one thread (the
    compute thread and CPU Adam need the cores)."""
    engine = next((e for e in available_engines() if e != "psync"), "psync")
    return [Setting(block, depth, 1, False, True, engine)
            for block in (1 << 20, 4 << 20, 8 << 20) for depth in (8, 32)]


def _costs(results: Iterable[Measured]) -> dict[Setting, float]:
    """Each setting's time to move the same number of bytes each way: the sum over the ops
    measured of 1 / GB/s (a half-duplex disk serves a read and a write one after the other).
    A setting missing an op has none."""
    results = list(results)
    ops = {r.op for r in results}
    cost: dict[Setting, float] = {}
    seen: dict[Setting, set[str]] = {}
    for r in results:
        cost[r.setting] = cost.get(r.setting, 0.0) + 1.0 / max(r.gbps, 1e-12)
        seen.setdefault(r.setting, set()).add(r.op)
    return {s: c for s, c in cost.items() if seen[s] == ops}


def best_setting(results: Iterable[Measured]) -> Setting:
    """The setting that moves the same number of bytes each way in the least time (`_costs`)."""
    cost = _costs(results)
    return min(cost, key=cost.__getitem__)


def least_request(results: Iterable[Measured]) -> int:
    """The least block size of a sweep whose best setting (`_costs`, at any queue depth swept)
    is within `PACE` of the best setting's: requests that small, enough of them in flight, still
    move the disk's bytes at its pace, so a streamed piece need not be larger ([Note: the pool
    is a budget] in infinity/offload/optimizer/sizing.py; the pipeline keeps many pieces' reads
    in flight). Only the block sizes swept count: `aio_bench_sweep --remember` stores the least
    of its own grid's."""
    cost = _costs(results)
    least = min(cost.values())
    return min(s.block_size for s, c in cost.items() if c <= PACE * least)


def sweep(directory: str, grid: list[Setting], io_size: int, *, ops: tuple[str, ...] = ("read", "write"),
          repeat: int = 1, progress: Callable[[list], Iterable] = iter) -> list[Measured]:
    """Times each setting of `grid` on a file of `io_size` bytes in a fresh directory under
    `directory` (removed after, whatever happens); the best of `repeat` timings per op."""
    work = tempfile.mkdtemp(prefix="infinity-aio-sweep-", dir=directory)
    results: list[Measured] = []
    try:
        path = os.path.join(work, "sweep.bin")
        buf = aligned_empty(io_size, pin=False)
        buf.fill_(0x5A)
        grid[0].handle().write(buf, path)  # allocate the extents once; later writes overwrite
        for setting, op in progress([(s, op) for s in grid for op in ops]):
            handle = setting.handle()
            gbps = max(_timed(handle, op == "write", buf, path) for _ in range(repeat))
            results.append(Measured(setting, op, gbps))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _timed(handle: AsyncIOHandle, write: bool, buf, path: str) -> float:
    start = time.perf_counter()
    handle.write(buf, path) if write else handle.read(buf, path)
    return buf.numel() / (time.perf_counter() - start) / 1e9


# ---- the cache ------------------------------------------------------------------------------------

class Device(NamedTuple):
    """The block device a directory is on, as the cache names it."""

    major: int
    minor: int
    model: str

    @property
    def key(self) -> str:
        return f"{self.major}:{self.minor}"


def device_of(directory: str) -> Device:
    """The device holding `directory`: its numbers, and the model (or serial) sysfs reports for
    the disk it belongs to ("unknown" where there is none, e.g. an overlay's anonymous device)."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    node = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)  # a partition: the model is the whole disk's
    for name in ("device/model", "serial", "device/serial", "device/modalias"):
        try:
            with open(os.path.join(node, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return Device(major, minor, text)
    return Device(major, minor, "unknown")


def cache_dir() -> str:
    """Where measured settings are kept ([Note: the disk tunes itself])."""
    explicit = os.environ.get("INFINITY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "infinity")


def cache_file(device: Device) -> str:
    return os.path.join(cache_dir(), f"aio-{device.major}-{device.minor}.json")


def _load(path: str, device: Device) -> Choice | None:
    """The cached choice for `device`, or None when there is none usable (missing, unreadable,
    another disk, an I/O engine this kernel lacks)."""
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry["version"] != CACHE_VERSION or entry["device"] != device.key or entry["model"] != device.model:
            return None
        setting = Setting(**entry["aio"])
        if setting.engine not in available_engines():
            return None
        setting.handle()  # the handle's own checks: a hand-edited value is measured again
        min_request = int(entry["min_request"])
        if min_request < PAGE_SIZE or min_request % PAGE_SIZE:
            return None
        return Choice(setting, float(entry["read_gbps"]), float(entry["write_gbps"]), path, True, 0.0, min_request)
    except (OSError, ValueError, KeyError, TypeError):  # a corrupt file is one to measure again
        return None


def remember(device: Device, setting: Setting, read_gbps: float, write_gbps: float, min_request: int, *,
             how: str) -> str:
    """Stores `setting` (and the sweep's `least_request`) as `device`'s choice (written whole,
    then renamed); returns the file."""
    path = cache_file(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    entry = {"version": CACHE_VERSION, "device": device.key, "model": device.model, "aio": setting.aio_block(),
             "read_gbps": read_gbps, "write_gbps": write_gbps, "min_request": min_request, "how": how,
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fd, tmp = tempfile.mkstemp(prefix=".aio-", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def _device_lock(device: Device):
    """Held while a device's cache entry is checked and, if need be, measured ([Note: the disk
    tunes itself]: ranks of a node starting together measure once)."""
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        lock = open(cache_file(device) + ".lock", "a")
    except OSError:  # no cache here (read-only home): measured, not cached, not locked
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def takes_direct_io(directory: str) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs refuses it)."""
    fd, probe = tempfile.mkstemp(prefix=".infinity-direct-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.close(fd)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.unlink(probe)


def tune_bytes(directory: str) -> int:
    """Bytes per timed transfer: INFINITY_AIO_TUNE_BYTES, else 256 MiB, at most an eighth of the
    memory available and of the disk's free space; whole pages."""
    text = os.environ.get("INFINITY_AIO_TUNE_BYTES")
    if text:
        try:
            size = int(text)
        except ValueError:
            size = 0
        if size < PAGE_SIZE or size % PAGE_SIZE:
            raise ValueError(f"INFINITY_AIO_TUNE_BYTES: expected a positive multiple of {PAGE_SIZE} bytes, "
                             f"got {text!r}")
        return size
    room = min(psutil.virtual_memory().available, shutil.disk_usage(directory).free) // 8
    return max(_MIN_TUNE_BYTES, min(DEFAULT_TUNE_BYTES, room) // PAGE_SIZE * PAGE_SIZE)


def choose(directory: str) -> Choice | None:
    """The `aio` setting for the device holding `directory`: cached, or measured now and cached
    ([Note: the disk tunes itself]). None where the file system refuses O_DIRECT."""
    device = device_of(directory)
    with _device_lock(device):
        cached = _load(cache_file(device), device)
        if cached is not None:
            return cached  # nothing is written under `directory`
        if not takes_direct_io(directory):
            return None
        start = time.perf_counter()
        results = sweep(directory, engine_grid(), tune_bytes(directory), repeat=2)
        best, least = best_setting(results), least_request(results)
        gbps = {r.op: r.gbps for r in results if r.setting == best}
        try:
            path = remember(device, best, gbps["read"], gbps["write"], least, how="engine")
        except OSError:
            path = ""
        return Choice(best, gbps["read"], gbps["write"], path, False, time.perf_counter() - start, least)
