"""The command-line tools: the main job, the estimate, and the aio sweep's output."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from infinity.apps.cli import main as infinity_main
from infinity.config import load_config
from infinity.apps.tools.aio_bench_sweep import main as sweep_main
from infinity.apps.tools.aio_bench_sweep import parse_size


def test_finetune_a_preset_on_nvme_runs_and_cleans_up(tmp_path, capsys):
    rc = infinity_main(["finetune", "--model", "llama-tiny", "--steps", "2", "--seq-len", "16", "--sample-tokens", "0",
                        "--nvme-path", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "offload param=nvme, optimizer=nvme" in out
    assert "moved per step" in out and "loss" in out
    assert os.listdir(tmp_path) == []  # the job's NVMe files are gone


def test_finetune_save_total_limit_keeps_the_newest_checkpoints(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    rc = infinity_main(["finetune", "--model", "llama-tiny", "--steps", "4", "--seq-len", "16", "--sample-tokens", "0",
                        "--nvme-path", str(tmp_path), "--save", str(ckpt), "--save-every", "1",
                        "--save-total-limit", "2"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(os.listdir(ckpt)) == ["global_step3", "global_step4", "latest"]


def test_finetune_names_an_unknown_preset(tmp_path, capsys):
    assert infinity_main(["finetune", "--model", "no-such-model", "--nvme-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown model preset 'no-such-model'" in err and "llama-tiny" in err and "Traceback" not in err


@pytest.mark.parametrize("extra,said", [
    (["--data", "/no/such.txt"], "--data /no/such.txt: not a file"),
    (["--config", "/no/such.json"], "--config /no/such.json: not a file"),
    (["--config", "BIN"], "not a JSON file"),  # a model's weights given as the config
    (["--config", "BAD"], "--config"),
    (["--model", "/no/such/model"], "--model /no/such/model: not a directory"),
    (["--config", "CFG", "--lr", "1e-3", "--batch", "2"], "--lr, --batch: only set the built-in config"),
    (["--lr", "-1"], "argument --lr: expected a positive number, got -1"),
    (["--save-total-limit", "2"], "--save-total-limit: keeps the newest checkpoints under --save"),
    (["--save", "CKPT", "--save-total-limit", "0"], "argument --save-total-limit: expected a positive integer")])
def test_finetune_bad_paths_and_conflicts_are_refused_before_any_work(tmp_path, capsys, extra, said):
    (tmp_path / "ds.json").write_text("{}")
    (tmp_path / "model.pt").write_bytes(b"\x80\x02PK" + bytes(range(256)))
    (tmp_path / "bad.json").write_text('{"train_batch_size": 4,')
    named = {"CFG": str(tmp_path / "ds.json"), "CKPT": str(tmp_path / "ckpt"), "BIN": str(tmp_path / "model.pt"),
             "BAD": str(tmp_path / "bad.json")}
    argv = ["finetune", "--nvme-path", str(tmp_path)] + [named.get(a, a) for a in extra]
    with pytest.raises(SystemExit) as exit_:
        infinity_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "codec" not in err.split(":")[0]
    if "BIN" in extra or "BAD" in extra:  # the option and the file named
        assert f"--config {named[extra[-1]]}: not a JSON file" in err


def test_finetune_data_shorter_than_a_sequence_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("a few words")
    rc = infinity_main(["finetune", "--model", "llama-tiny", "--data", str(tmp_path / "tiny.txt"), "--seq-len", "64",
                        "--steps", "1", "--sample-tokens", "0", "--nvme-path", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--data:" in err and "fewer than one sequence of 64" in err
    assert os.listdir(tmp_path) == ["tiny.txt"]  # nothing left on disk


def test_estimate(capsys):
    assert infinity_main(["estimate", "--params", "7e9"]) == 0  # this machine's memory and disk
    out = capsys.readouterr().out
    assert "nvme" in out and "7.00B parameters" in out and "host memory read here" in out
    # --world-size, the older name of --gpus: every tier is sharded over the ranks
    assert infinity_main(["estimate", "--params", "7e9", "--world-size", "4", "--gpu-mem", "80G", "--cpu-mem", "1T",
                          "--nvme-free", "4T"]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs of 80.0 GiB, a rank each" in out and "world size 4" in out and "read here" not in out


def test_sweep_writes_a_config_block_the_engine_reads(tmp_path, capsys):
    best = tmp_path / "best.json"
    rc = sweep_main(["--nvme-path", str(tmp_path), "--quick", "--io-size", "8M", "--block-sizes", "1M",
                     "--queue-depths", "4", "--output", str(best)])
    assert rc == 0
    block = json.loads(best.read_text())
    assert set(block) == {"aio"} and isinstance(block["aio"]["single_submit"], bool)
    config = load_config({"train_micro_batch_size_per_gpu": 1, **block})
    assert config.aio.block_size == block["aio"]["block_size"]
    assert [p for p in os.listdir(tmp_path) if p != "best.json"] == []  # its data file is removed
    assert "GB/s" in capsys.readouterr().out


def _read_only_mount(tmp_path) -> str | None:
    """A read-only file system at tmp_path/ro (root alone passes os.access there), or None."""
    target = tmp_path / "ro"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
    return str(target) if done.returncode == 0 else None


def test_sweep_refuses_a_bad_directory_or_size_as_a_bad_value(tmp_path, capsys):
    """Exit 2 and one line naming the flag, as for every other bad value (these exited 1)."""
    (tmp_path / "file").write_text("x")
    cases = [(str(tmp_path / "missing"), [], "--nvme-path", "not a directory"),
             (str(tmp_path / "file"), [], "--nvme-path", "not a directory"),
             (str(tmp_path), ["--io-size", "1T"], "--io-size", "GiB free")]
    read_only = _read_only_mount(tmp_path)
    if read_only is not None:
        cases.append((read_only, [], "--nvme-path", "cannot create a file there"))
    try:
        for path, extra, flag, said in cases:
            with pytest.raises(SystemExit) as exit_:
                sweep_main(["--nvme-path", path, "--quick", *extra])
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and flag in err and said in err and len(err.strip().splitlines()) == 1, err
    finally:
        if read_only is not None:
            subprocess.run(["umount", read_only], check=True)


@pytest.mark.parametrize("argv, named", [
    (["--repeat", "0"], "--repeat"),  # max() of nothing, after the file was written
    (["--queue-depths", "0"], "--queue-depths"),
    (["--threads", "-2"], "--threads"),
    (["--single-submit", "maybe"], "--single-submit"),  # was taken as false
    (["--output", "/nonexistent/best.json"], "--output"),  # was a traceback after the whole sweep
])
def test_sweep_refuses_bad_values_before_any_work(tmp_path, argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep_main(["--nvme-path", str(tmp_path), "--quick", "--io-size", "8M", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_parse_size():
    assert parse_size("1G") == 1 << 30 and parse_size("512K") == 512 << 10 and parse_size("4096") == 4096


@pytest.mark.parametrize("argv", [["finetune", "--steps", "0"], ["estimate", "--params", "-5"],
                                  ["estimate", "--params", "nan"], ["estimate", "--params", "1e9", "--world-size", "0"]])
def test_bad_arguments_are_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        infinity_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert argv[-2] in err and "expected" in err


def test_clean_lists_and_removes_what_a_killed_run_left(tmp_path, capsys):
    import signal
    import subprocess
    import sys

    body = ("import sys, time; from infinity.offload.store import NvmeStore; "
            "s = NvmeStore(sys.argv[1], {'param': {0: 1 << 20}}, job_id='killed'); print(s.directory, flush=True); "
            "time.sleep(60)")
    from infinity.offload.store import NvmeStore

    def killed_run() -> str:
        with subprocess.Popen([sys.executable, "-c", body, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path) as child:  # outside the source tree, which would shadow the package
            directory = child.stdout.readline().strip()
            child.send_signal(signal.SIGKILL)
        return directory

    live = NvmeStore(tmp_path, {"param": {0: 4096}}, job_id="live", keep=False)
    try:
        directory = killed_run()
        assert infinity_main(["clean", str(tmp_path), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "stale" in out and directory in out and "in use" in out and "1.0 MiB" in out
        assert os.path.isdir(directory)  # a dry run removes nothing
        assert infinity_main(["clean", str(tmp_path)]) == 0
        assert "removed 1 stale" in capsys.readouterr().out
        assert not os.path.exists(directory) and os.path.isdir(live.directory)  # the live one stays
    finally:
        live.close()
