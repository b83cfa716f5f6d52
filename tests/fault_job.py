"""A clipped training job for tests/test_injected_faults.py, run as its own process so that the
test can make its reads and writes fail from outside (strace's syscall fault injection):

    python fault_job.py NVME_DIR CONTROL_DIR --steps 6

Params and optimizer state on NVMe through the `psync` aio engine (at queue depth 1, one pread /
pwrite thread per handle, so "the Nth read of each I/O thread" names the same reads every run),
gradient_clipping 1.0 (updates wait for the next forward), several pieces per unit.

Rounds: one process imports torch once and trains a new engine per round r = 0, 1, ...: it waits
for CONTROL_DIR/round.r (JSON: queue_depth, tries; or reference; or stop), builds the engine, writes ready.r,
waits for go.r (the tracer attaches in between, after the imports and the build), trains, writes
trained.r, waits for detached.r, then reads the final state back into state.r.pt and writes
result.r.json.

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
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpt import TinyGPT, batches, config  # noqa: E402

import infinity  # noqa: E402

SAVE_AT = 3  # a checkpoint after this many applied steps, as a training job takes them


def build(nvme: str, queue_depth: int):
    cfg = config(3, "nvme", "nvme", clip=1.0)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=nvme, buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=nvme, buffer_count=12)
    z["sub_group_size"] = 8192  # several pieces per block: an update can fail part way through
    cfg["aio"] = {"engine": "psync", "queue_depth": queue_depth, "thread_count": 1, "block_size": 1 << 20}
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


def train(engine, steps: int, tries_left: int, ckpt: str, after_step=None) -> dict:
    data = batches(steps, 4)
    events: list = []
    applied = tries = 0
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
        if applied == SAVE_AT:
            try:
                engine.save_checkpoint(ckpt, tag=f"step{applied}")
                events.append(["saved"])
            except Exception as e:  # noqa: BLE001
                events.append(["save error", *describe(e)])
    return {"events": events, "applied": applied}


def one_round(nvme: str, control: str, r: int, steps: int, settings: dict) -> None:
    os.makedirs(os.path.join(nvme, str(r)))
    engine = build(os.path.join(nvme, str(r)), settings.get("queue_depth", 1))
    path = lambda name: os.path.join(control, f"{name}.{r}")  # noqa: E731
    if settings.get("reference"):  # no failures: the state after every step
        save = lambda k: torch.save(state(engine), path(f"state_{k}") + ".pt")  # noqa: E731
        result = train(engine, steps, steps, os.path.join(control, f"ckpt.{r}"), after_step=save)
        engine.close()
        put(path("result") + ".json", json.dumps(result))
        return
    put(path("ready"), str(os.getpid()))
    wait_for(path("go"))
    result = train(engine, steps, settings["tries"], os.path.join(control, f"ckpt.{r}"))
    put(path("trained"))
    wait_for(path("detached"))
    # Reading the state back may meet a read issued ahead while the faults were on (the pending
    # updates' reads run ahead of them): the error says the next read tries again, so the job
    # goes on as it does after a failed step, trying again (a few times) and reporting each error.
    for _ in range(3):
        try:
            torch.save(state(engine), path("state") + ".pt")
            result["state"] = "read"
            break
        except Exception as e:  # noqa: BLE001 (a refusing engine may refuse this too)
            result["state"] = describe(e)
            result["events"].append(["state error", *describe(e)])
    try:
        engine.close()
    except Exception as e:  # noqa: BLE001
        result["close"] = describe(e)
    # Every pool buffer back once closed: none was kept by a failed transfer or update.
    result["buffers_in_use"] = [engine.params.pool.stats.bytes_in_use, engine.optim_state.pool.stats.bytes_in_use]
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
