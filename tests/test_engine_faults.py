"""An I/O error in the middle of training is reported once, by name; every error path gives its
buffers back, so the next step fails at once with the original error (a shard whose write failed
is invalid) or works, and never waits for a buffer nobody will release."""

from __future__ import annotations

import time

import pytest
import torch

import infinity
from gpt import TinyGPT, batches, config
from infinity.offload.optimizer import nvme as nvme_optim
from test_tiers_faults import FaultyHandle


@pytest.mark.parametrize("clip", [0.0, 1.0])  # the update inside backward, and after the norm
@pytest.mark.parametrize("op", ["read", "write"])
def test_one_failed_transfer_of_optimizer_state(tmp_path, clip, op, monkeypatch):
    # A pool of 9 buffers of a unit's state, as the knobs read literally: a pool cut for depth
    # ([Note: the pool is a budget]) holds this tiny model's whole state and reads nothing again
    # after the first step, so the failure would never be met.
    monkeypatch.setattr(nvme_optim, "choose_pieces", lambda shards, sgs, count, per_piece, host=None, **_:
                        (int(sgs), max(count, 3 * per_piece)))
    cfg = config(3, "nvme", "nvme", clip=clip)
    z = cfg["zero_optimization"]
    z["offload_param"].update(nvme_path=str(tmp_path), buffer_count=6, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=9)
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(TinyGPT(), config=cfg)
    swapper = engine.optim_state.swapper
    faulty = FaultyHandle()
    if op == "write":
        faulty.inner, swapper.write_handle = swapper.write_handle, faulty
    else:
        faulty.inner, swapper.handle = swapper.handle, faulty
    swapper.timeout = 5.0  # a leaked buffer shows as a TimeoutError here, not after a minute
    data = batches(6, 4)
    engine.backward(engine(*data[0]))
    engine.step()
    faulty.fail(engine.optim_state.store.extent("exp_avg_sq", (0, 0)), op)
    outcomes = []
    for idx, tgt in data[1:]:
        start = time.monotonic()
        try:
            engine.backward(engine(idx, tgt))
            engine.step()
            outcomes.append("ok")
        except (OSError, RuntimeError) as e:  # the error, then (where the engine refuses) why it refuses
            assert "exp_avg_sq" in str(e) and "(0, 0)" in str(e), e  # the shard, by name
            outcomes.append("error")
        assert time.monotonic() - start < 4.0  # at once: nothing waited for a buffer
        assert engine.fetcher.live_numel == 0
    try:
        swapper.flush()
    except OSError:
        pass
    # Nothing leaked: the buffers in use are those of the reads ahead for the updates pending.
    tier = engine.optim_state
    ahead = sum(len(p.handles) for p in tier.pieces.in_memory())
    assert tier.pool.stats.bytes_in_use == ahead * tier.pool.buffer_size
    if op == "read" and clip:  # met by the deferred update, which the next forward resumes: the next steps work
        # (one step later where the read for the pending update was issued before the fault)
        first = outcomes.index("error")
        assert first <= 1 and outcomes == ["ok"] * first + ["error"] + ["ok"] * (4 - first)
    elif op == "read":  # met by an update in backward after other units took the step: half applied, so
        assert outcomes == ["error"] * 5  # every later step refuses ([Note: failed updates] in step_policy.py)
    else:  # met by the next flush (writes drain behind the next step with clipping) or read; the
        # shard is invalid from then on: every later step says so again, never reading its bytes
        first = outcomes.index("error")
        assert first <= 1 and outcomes[first:] == ["error"] * (5 - first)
    engine.close()


@pytest.mark.parametrize("check", [True, False])
def test_a_non_finite_norm_skips_the_step_as_deepspeeds_zero3_does(tmp_path, caplog, check):
    """bf16.check_grad_overflow (default true, as in DeepSpeed 0.19.8): a step whose global
    gradient norm is nan is skipped, in fp32 too; false applies it."""
    from infinity.deepspeed.utils.full_values import safe_get_full_fp32_param, safe_set_full_fp32_param

    torch.manual_seed(0)
    model = TinyGPT()
    weight, shape = model.blocks[0].fc1.weight, model.blocks[0].fc1.weight.shape
    other = model.blocks[1].fc1.weight
    cfg = config(3, "cpu", "cpu")
    if not check:
        cfg["bf16"] = {"enabled": False, "check_grad_overflow": False}
    engine, *_ = infinity.initialize(model, config=cfg)
    before = safe_get_full_fp32_param(other).clone()
    safe_set_full_fp32_param(weight, torch.full(tuple(shape), float("nan")))
    with caplog.at_level("WARNING", logger="infinity"):
        engine.backward(engine(*batches(1, 4)[0]))
        engine.step()
    assert any("a weight it came from" in r.message for r in caplog.records), caplog.text
    assert engine.was_step_applied() is not check and engine.skipped_steps == int(check)
    after = safe_get_full_fp32_param(other)
    assert torch.equal(after, before) if check else not bool(torch.isfinite(after).all())
    engine.close()
