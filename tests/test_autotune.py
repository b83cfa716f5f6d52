"""A config without an `aio` section gets the setting its disk was measured to want, measured
once per device and cached ([Note: the disk tunes itself] in infinity/io/autotune.py); an
explicit section is honoured. The sweeps here time 1 MiB transfers (INFINITY_AIO_TUNE_BYTES)."""

from __future__ import annotations

import argparse
import json
import logging
import os

import pytest

import infinity
from gpt import TinyGPT, batches, config
from infinity.config import AIOConfig, load_config
from infinity.io import autotune
from infinity.io.autotune import Measured, Setting
from infinity.apps.tools import aio_bench_sweep

OLD = 1_000_000_000  # a time stamp (2001) no write made during the test can leave behind


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own, and an NVMe directory on the disk under test."""
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("INFINITY_AIO_TUNE_BYTES", str(1 << 20))
    (tmp_path / "nvme").mkdir()
    return tmp_path / "cache"


def _cache_files(cache) -> list[str]:
    return sorted(n for n in os.listdir(cache) if n.endswith(".json")) if cache.exists() else []


def _age(*paths) -> None:
    for path in paths:
        os.utime(path, (OLD, OLD))


def test_the_choice_is_measured_once_then_read_from_the_cache(tmp_path, cache):
    nvme = str(tmp_path / "nvme")
    first = autotune.choose(nvme)
    assert not first.from_cache and first.setting in autotune.engine_grid()
    assert os.listdir(nvme) == []  # the sweep's file is gone
    (name,) = _cache_files(cache)
    entry = json.loads((cache / name).read_text())
    dev = os.stat(nvme).st_dev
    assert entry["device"] == f"{os.major(dev)}:{os.minor(dev)}" and Setting(**entry["aio"]) == first.setting

    # The second choice writes nothing: neither a sweep's directory under the NVMe path (its
    # mtime would move) nor the cache file.
    _age(nvme, cache / name)
    second = autotune.choose(nvme)
    assert second.from_cache and second.setting == first.setting
    assert os.stat(nvme).st_mtime == OLD and os.stat(cache / name).st_mtime == OLD


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another disk", "a missing engine", "a bad value",
                                    "an older version"])
def test_a_cache_file_that_cannot_be_used_is_measured_again(tmp_path, cache, damage, monkeypatch):
    nvme = str(tmp_path / "nvme")
    autotune.choose(nvme)
    path = cache / _cache_files(cache)[0]
    entry = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "another disk":
        path.write_text(json.dumps({**entry, "model": "some other model"}))
    elif damage == "a missing engine":
        monkeypatch.setattr(autotune, "available_engines", lambda: ["psync"])
    elif damage == "a bad value":
        path.write_text(json.dumps({**entry, "aio": {**entry["aio"], "queue_depth": 0}}))
    else:  # version 1 kept no least request
        path.write_text(json.dumps({k: v for k, v in entry.items() if k != "min_request"} | {"version": 1}))
    _age(nvme)
    again = autotune.choose(nvme)
    assert not again.from_cache and os.stat(nvme).st_mtime != OLD  # swept again under the NVMe path
    stored = json.loads(path.read_text())  # and replaced by a usable entry
    assert Setting(**stored["aio"]) == again.setting and stored["model"] == autotune.device_of(nvme).model
    assert autotune.choose(nvme).from_cache


def _engine(tmp_path, aio: dict | None):
    cfg = config(clip=1.0)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                 "max_in_cpu": 0}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                     "buffer_count": 9}
    if aio is not None:
        cfg["aio"] = aio
    engine, *_ = infinity.initialize(TinyGPT(), config=cfg)
    return engine


def _train_one_step(engine) -> None:
    (idx, targets), = batches(1, 2)
    engine.backward(engine(idx, targets))
    engine.step()


def test_an_engine_without_an_aio_section_uses_the_measured_setting(tmp_path, cache, caplog):
    caplog.set_level(logging.INFO, logger="infinity")
    engine = _engine(tmp_path, None)
    (name,) = _cache_files(cache)
    entry = json.loads((cache / name).read_text())
    chosen = Setting(**entry["aio"])
    measured = AIOConfig(**chosen.aio_block(), min_request=entry["min_request"])
    assert engine.config.aio == measured  # tune is off once resolved
    assert engine.params.handle.get_block_size() == chosen.block_size
    assert engine.optim_state.handle.get_queue_depth() == chosen.queue_depth
    assert "no aio section" in caplog.text and "measured in" in caplog.text
    _train_one_step(engine)
    engine.close()

    caplog.clear()
    _age(cache / name)
    engine = _engine(tmp_path, None)
    assert engine.config.aio == measured
    assert engine.chosen["aio"]["min_request"] == entry["min_request"]
    assert engine.chosen["offload_optimizer"]["least_streamed"] == entry["min_request"] // 4  # its fp32 elements
    assert "from the cache" in caplog.text and os.stat(cache / name).st_mtime == OLD
    engine.close()


def test_the_least_request_at_the_disks_pace_is_the_smallest_block_within_ten_percent():
    """`least_request`: read + write time of each block size's best depth against the best's."""
    def grid(times):  # block KiB -> (read GB/s, write GB/s) at two depths
        return [Measured(Setting(kib << 10, depth, 1, False, True, "psync"), op, gbps * scale)
                for kib, (r, w) in times.items() for depth, scale in ((8, 0.5), (32, 1.0))
                for op, gbps in (("read", r), ("write", w))]
    # 1 MiB at 1.9 / 2.3 GB/s costs 0.961 s a GB each way against 8 MiB's 0.900: within 10%
    assert autotune.least_request(grid({1024: (1.9, 2.3), 4096: (2.0, 2.5), 8192: (2.0, 2.5)})) == 1 << 20
    # 1 MiB at 1.2 / 2.0 (1.333) and 4 MiB at 1.9 / 2.4 (0.943) against 0.900: 4 MiB
    assert autotune.least_request(grid({1024: (1.2, 2.0), 4096: (1.9, 2.4), 8192: (2.0, 2.5)})) == 4 << 20
    # a setting measured one way only is no candidate
    one_way = [m for m in grid({1024: (3.0, 3.0)}) if m.op == "read"] + grid({8192: (2.0, 2.5)})
    assert autotune.least_request(one_way) == 8 << 20


def test_an_explicit_aio_section_wins(tmp_path, cache):
    given = {"block_size": 262144, "queue_depth": 3}
    engine = _engine(tmp_path, given)
    assert (engine.config.aio.block_size, engine.config.aio.queue_depth) == (262144, 3)
    assert engine.params.handle.get_block_size() == 262144 and engine.optim_state.handle.get_queue_depth() == 3
    assert _cache_files(cache) == []  # nothing was measured
    engine.close()
    engine = _engine(tmp_path, {})  # an empty section is DeepSpeed's defaults, given
    assert engine.config.aio == AIOConfig() and _cache_files(cache) == []
    engine.close()


def test_the_config_tells_an_absent_section_from_defaults():
    minimal = {"train_micro_batch_size_per_gpu": 1}
    assert load_config(minimal).aio.tune
    assert not load_config({**minimal, "aio": {}}).aio.tune
    assert load_config({**minimal, "aio": {}}).aio == AIOConfig()
    with pytest.raises(ValueError, match="aio.tune: unknown key"):
        load_config({**minimal, "aio": {"tune": True}})
    with pytest.raises(ValueError, match="aio.min_request: unknown key"):  # measured, never given
        load_config({**minimal, "aio": {"min_request": 1 << 20}})


def test_the_choice_is_the_least_read_plus_write_time():
    fast_reads, even = Setting(8 << 20, 32, 1, False, True, "aio"), Setting(1 << 20, 8, 1, False, True, "aio")
    results = [Measured(fast_reads, "read", 8.0), Measured(fast_reads, "write", 1.0),
               Measured(even, "read", 2.0), Measured(even, "write", 2.0)]
    # 1/8 + 1/1 s against 1/2 + 1/2 s per GB each way: the even setting moves a step's bytes sooner
    assert autotune.best_setting(results) == even
    assert autotune.best_setting(results[:1] + results[2:]) == even  # a setting without a write is no candidate


def test_the_sweep_tool_chooses_as_the_engine_and_can_store_it(tmp_path, cache, capsys):
    quick = argparse.Namespace(quick=True, block_sizes=None, queue_depths=None, threads=None, single_submit=None,
                               overlap_events=None, engines=None)
    assert sorted(aio_bench_sweep._grid(quick)) == sorted(autotune.engine_grid())
    nvme = str(tmp_path / "nvme")
    out = tmp_path / "best.json"
    assert aio_bench_sweep.main(["--nvme-path", nvme, "--quick", "--io-size", "1M", "--remember",
                                 "--output", str(out)]) == 0
    assert "stored for this disk" in capsys.readouterr().out
    best = Setting(**json.loads(out.read_text())["aio"])
    _age(nvme)
    choice = autotune.choose(nvme)
    assert choice.from_cache and choice.setting == best and os.stat(nvme).st_mtime == OLD


def test_a_file_system_without_o_direct_is_not_measured(cache):
    if not os.path.isdir("/dev/shm") or os.access("/dev/shm", os.W_OK) is False:
        pytest.skip("no writable /dev/shm")
    if autotune.takes_direct_io("/dev/shm"):
        pytest.skip("/dev/shm takes O_DIRECT here")
    assert autotune.choose("/dev/shm") is None and _cache_files(cache) == []


def test_a_bad_sweep_size_names_the_variable(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("INFINITY_AIO_TUNE_BYTES", "1000")
    with pytest.raises(ValueError, match="INFINITY_AIO_TUNE_BYTES: expected a positive multiple of 4096"):
        autotune.choose(str(tmp_path / "nvme"))
