"""A clipped training job for tests/test_injected_faults.py, run as its own process so that the
test can make its reads and writes fail from outside (strace's syscall fault injection):

    python fault_job.py NVME_DIR CONTROL_DIR --steps 6

Params and optimizer state on NVMe through the `psync` aio engine by default (at queue depth 1,
one pread / pwrite thread per handle, so "the Nth read of each I/O thread" names the same reads
every run; a round may name io_uring or kernel AIO instead), gradient_clipping 1.0 (updates wait
for the next forward), several pieces per unit, every unit fetched through the store
(stage3_param_persistence_threshold 0) unless the round asks for the default threshold, under
which this model's units all stay gathered and are updated inside `step()`.

Rounds: one process imports torch once and trains a new engine per round r = 0, 1, ...: it waits
for CONTROL_DIR/round.r (JSON: queue_depth, tries, engine, persistence, phase; or reference; or
stop), builds the engine, writes ready.r, waits for go.r (the tracer attaches in between, after the
imports and the build), runs the round's phase under the tracer, writes trained.r, waits for
detached.r, finishes, reads the final state back into state.r.pt and writes result.r.json.
The phase is what runs while the tracer injects: "train" (the whole training, the default),
"save" (one save_checkpoint after SAVE_AT steps trained without the tracer; the rest trains once
it left), "load" (loading the checkpoint of step SAVE_AT, again once the tracer left if that
failed, then the rest of the training), "state" (reading the state back after training without it), "export"
(`save_16bit_model` and `infinity.consolidate` of the step-SAVE_AT checkpoint, then the same once
the tracer left: export.r.json says whether the files written under the fault were whole); the
last two end with a save, which tells whether the engine goes on or refuses.

A round trains until --steps steps are applied, each on its own batch (a failed step is tried
again on the same batch), at most `tries` tries. After every error it tries to save a checkpoint,
and it saves one after step 3. result.r.json has what happened (`events`), the steps applied,
whether the state could be read (tried again after an error, up to three times, each error an
event), and the bytes of pool buffers still in use once the engine is closed; state.r.pt the fp32 masters and moments of every unit after the last applied step.

A reference round trains without failures and without waiting, and writes the state after
every step k (state_k.r.pt) and result.r.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpt import TinyGPT, batches, config  # noqa: E402

import infinity  # noqa: E402

SAVE_AT = 3  # a checkpoint after this many applied steps, as a training job takes them


class Warnings(logging.Handler):
    """The engine's warnings of a round (a failed update that resumes later says so there)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARNINGS = Warnings()
logging.getLogger("infinity").addHandler(WARNINGS)


def build(nvme: str, queue_depth: int, engine: str = "psync", persistence: str | int = 0):
    cfg = config(3, "nvme", "nvme", clip=1.0)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=nvme, buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=nvme, buffer_count=12)
    z["sub_group_size"] = 8192  # several pieces per block: an update can fail part way through
    if persistence == "default":
        del z["stage3_param_persistence_threshold"]
    else:
        z["stage3_param_persistence_threshold"] = persistence
    cfg["aio"] = {"engine": engine, "queue_depth": queue_depth, "thread_count": 1, "block_size": 1 << 20}
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(layers=4, d=64), config=cfg)
    # A buffer that never comes back shows as an error within seconds, not after a minute.
    engine.params.swapper.timeout = engine.optim_state.swapper.timeout = 10.0
    return engine


def state(engine) -> dict[str, torch.Tensor]:
    """Every unit's fp32 master and moments (the values `safe_get_full_*` cut parameters from)."""
    out = {f"{u.index}/{kind}": engine.full_optimizer_values(u, kind)
           for u in engine.units if u.trainable for kind in ("master", "exp_avg", "exp_avg_sq")}
    out["step_count"] = torch.tensor(engine.optimizer.step_count)
    return out


def wait_for(path: str) -> str:
    while not os.path.exists(path):
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def put(path: str, text: str = "") -> None:
    """Writes a control file whole: the other side sees it only once it has its contents."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def describe(e: BaseException) -> list[str]:
    return [type(e).__name__, str(e).splitlines()[0] if str(e) else ""]


def train(engine, steps: int, tries_left: int, ckpt: str, after_step=None, applied: int = 0,
          events: list | None = None, save_at: int | None = SAVE_AT) -> dict:
    """Trains from `applied` steps to `steps`; `save_at`: the step after which it saves."""
    data = batches(steps, 4)
    events = [] if events is None else events
    tries = 0
    while applied < steps and tries < tries_left:
        tries += 1
        idx, tgt = data[applied]
        try:
            engine.backward(engine(idx, tgt))
            engine.step()
        except Exception as e:  # noqa: BLE001 (every error is reported to the test)
            events.append(["step error", *describe(e)])
            try:
                engine.save_checkpoint(ckpt, tag=f"after_error_{tries}")
                events.append(["saved"])
            except Exception as e2:  # noqa: BLE001
                events.append(["save error", *describe(e2)])
            continue
        applied += 1
        events.append(["ok"])
        if after_step is not None:
            after_step(applied)
        if applied == save_at:
            try:
                engine.save_checkpoint(ckpt, tag=f"step{applied}")
                events.append(["saved"])
            except Exception as e:  # noqa: BLE001
                events.append(["save error", *describe(e)])
    return {"events": events, "applied": applied}


def read_state(engine, result: dict, out: str | None) -> None:
    """Reads the state back (into `out`), as a job does after training. It may meet a read issued
    ahead while the faults were on (the pending updates' reads run ahead of them): the error says
    the next read tries again, so the job goes on as it does after a failed step, trying again
    (a few times) and reporting each error."""
    for _ in range(3):
        try:
            values = state(engine)
            if out is not None:
                torch.save(values, out)
            result["state"] = "read"
            return
        except Exception as e:  # noqa: BLE001 (a refusing engine may refuse this too)
            result["state"] = describe(e)
            result["events"].append(["state error", *describe(e)])


def export(engine, ckpt: str, out: str, events: list) -> dict:
    """save_16bit_model and consolidate (of the checkpoint saved at SAVE_AT) into `out`; each
    error an event. Returns what each wrote: its file's tensors, or None."""
    from safetensors.torch import load_file

    from infinity.checkpoint.export import consolidate

    written: dict = {}
    for what, run in (("16bit", lambda d: engine.save_16bit_model(d)),
                      ("consolidate", lambda d: consolidate(ckpt, d, tag=f"step{SAVE_AT}"))):
        target = os.path.join(out, what)
        try:
            run(target)
            written[what] = {k: v.float() for k, v in load_file(os.path.join(target, "model.safetensors")).items()}
        except Exception as e:  # noqa: BLE001
            events.append([f"{what} error", *describe(e)])
            files = os.listdir(target) if os.path.isdir(target) else []
            written[what] = None
            if "model.safetensors" in files:  # a failed export must not leave a file that reads as whole
                events.append([f"{what} left", "model.safetensors", ""])
    return written


def one_round(nvme: str, control: str, r: int, steps: int, settings: dict) -> None:
    os.makedirs(os.path.join(nvme, str(r)))
    engine = build(os.path.join(nvme, str(r)), settings.get("queue_depth", 1), settings.get("engine", "psync"),
                   settings.get("persistence", 0))
    path = lambda name: os.path.join(control, f"{name}.{r}")  # noqa: E731
    ckpt = os.path.join(control, f"ckpt.{r}")
    if settings.get("reference"):  # no failures: the state after every step
        save = lambda k: torch.save(state(engine), path(f"state_{k}") + ".pt")  # noqa: E731
        result = train(engine, steps, steps, ckpt, after_step=save)
        engine.close()
        put(path("result") + ".json", json.dumps(result))
        return
    WARNINGS.messages.clear()
    phase = settings.get("phase", "train")
    result: dict = {"events": [], "applied": 0}
    if phase in ("save", "state", "export", "load"):  # trained without the tracer first
        result = train(engine, SAVE_AT if phase in ("save", "load") else steps, steps, ckpt,
                       save_at=None if phase == "save" else SAVE_AT)
    put(path("ready"), str(os.getpid()))
    wait_for(path("go"))
    if phase == "train":
        result = train(engine, steps, settings["tries"], ckpt)
    elif phase == "save":
        try:
            engine.save_checkpoint(ckpt, tag=f"step{SAVE_AT}")
            result["events"].append(["saved"])
        except Exception as e:  # noqa: BLE001
            result["events"].append(["save error", *describe(e)])
    elif phase == "load":
        try:
            engine.load_checkpoint(ckpt, tag=f"step{SAVE_AT}")
            result["events"].append(["loaded"])
        except Exception as e:  # noqa: BLE001
            result["events"].append(["load error", *describe(e)])
    else:
        if phase == "state":
            read_state(engine, result, None)
        else:
            first = export(engine, ckpt, path("export_faulted"), result["events"])
        try:  # then a save, which says whether the engine goes on or refuses
            engine.save_checkpoint(ckpt, tag="after")
            result["events"].append(["saved"])
        except Exception as e:  # noqa: BLE001
            result["events"].append(["save error", *describe(e)])
    put(path("trained"))
    wait_for(path("detached"))
    if phase == "load" and result["events"][-1][0] == "load error":  # a job loads again, then goes on
        engine.load_checkpoint(ckpt, tag=f"step{SAVE_AT}")
    if phase in ("save", "load"):  # the rest of the training, as a job goes on after a failed save
        result = train(engine, steps, settings["tries"], ckpt, applied=result["applied"], events=result["events"],
                       save_at=None)
    if phase == "export":  # the same again without faults: what a whole export holds
        again = export(engine, ckpt, path("export_clean"), result["events"])
        with open(path("export") + ".json", "w") as f:
            json.dump({what: None if first[what] is None else
                       all(torch.equal(first[what][k], again[what][k]) for k in again[what])
                       for what in first}, f)
    read_state(engine, result, path("state") + ".pt")
    result["warnings"] = list(WARNINGS.messages)
    try:
        engine.close()
    except Exception as e:  # noqa: BLE001
        result["close"] = describe(e)
    # Every pool buffer back once closed: none was kept by a failed transfer or update; no file left.
    result["buffers_in_use"] = [engine.params.pool.stats.bytes_in_use, engine.optim_state.pool.stats.bytes_in_use]
    result["files_left"] = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(nvme, str(r))) for f in files]
    put(path("result") + ".json", json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nvme")
    ap.add_argument("control")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    for r in range(1 << 30):
        settings = json.loads(wait_for(os.path.join(args.control, f"round.{r}")))
        if settings.get("stop"):
            return
        one_round(args.nvme, args.control, r, args.steps, settings)


if __name__ == "__main__":
    main()
