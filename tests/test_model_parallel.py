"""Model parallelism through DeepSpeed's mpu ([7/7]; [Note: model parallelism] in
infinity/zero/model_parallel.py), on gloo with 2 or 4 processes of this host.

The reference first: tests/megatron_tp.py's tensor-parallel model and its plain-PyTorch step at
TP x DP equal the single-process model trained on the whole batch, in float64. Then infinity under
that model's mpu (ZeRO over each data-parallel group, the clipping norm over the whole model)
equals the reference, saves one checkpoint per model-parallel rank and resumes from it."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

import infinity

sys.path.insert(0, os.path.dirname(__file__))
import megatron_tp as tp  # noqa: E402

STEPS, ROWS, CLIP = 4, 8, 0.3  # the gradient norm is about 0.6: clipping acts on every step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _joined(rank: int, world: int, tp_size: int, port: int):
    """This spawned process in a gloo job of `world` ranks, with the grid's mpu."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield tp.Mpu(tp_size)
    finally:
        torch.distributed.destroy_process_group()


def _worker(rank: int, world: int, tp_size: int, port: int, results) -> None:
    with _joined(rank, world, tp_size, port) as mpu:
        torch.manual_seed(0)
        model = tp.parallelize(tp.TinyLM().double(), mpu)
        losses = tp.reference_steps(model, mpu, STEPS, ROWS, clip=CLIP)
        weights = tp.full_weights(model, mpu)
        if rank == 0:
            results["losses"], results["weights"] = losses, weights


def _single() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = tp.TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(*tp.batch(step, ROWS))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow  # checks the reference the engine's mpu tests compare against, not the engine
@pytest.mark.parametrize("world,tp_size", [(4, 2), (2, 2), (2, 1)], ids=["tp2xdp2", "tp2xdp1", "tp1xdp2"])
def test_tensor_parallel_reference_equals_the_whole_model(world, tp_size):
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(world, tp_size, _free_port(), results), nprocs=world, start_method="spawn")
    expected_losses, expected = _single()
    # float64: the sums over ranks are in another order than the whole model's, and Adam divides
    # small gradients by their own size, so in float32 a weight can differ by 2e-5 after 4 steps
    torch.testing.assert_close(results["losses"], expected_losses, rtol=1e-12, atol=1e-12)
    assert set(results["weights"]) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(results["weights"][name], value, rtol=1e-10, atol=1e-12, msg=name)


# ---- infinity under an mpu ([Note: model parallelism] in infinity/zero/model_parallel.py) ---------

LR, SCALE, SAVE_AT, ENGINE_STEPS = 1e-3, 4.0, 2, 4  # SCALE: gradient norms of 2-3, so clipping at 1.0 acts


def _engine_worker(rank: int, world: int, tp_size: int, port: int, offload: str, stage: int, root: str,
                   results) -> None:
    with _joined(rank, world, tp_size, port) as mpu:
        torch.manual_seed(0)
        reference = tp.parallelize(tp.TinyLM(), mpu)
        norms: list[float] = []
        expected_losses = tp.reference_steps(reference, mpu, ENGINE_STEPS, ROWS, lr=LR, clip=1.0, loss_scale=SCALE,
                                             norms=norms)
        torch.manual_seed(0)
        config = tp.engine_config(ROWS, mpu, offload, os.path.join(root, "nvme"), LR, 1.0, stage)
        engine, *_ = infinity.initialize(model=tp.parallelize(tp.TinyLM(), mpu), config=config, mpu=mpu)
        losses = tp.engine_steps(engine, mpu, range(SAVE_AT), ROWS, SCALE)
        engine.save_checkpoint(os.path.join(root, "ckpt"))
        losses += tp.engine_steps(engine, mpu, range(SAVE_AT, ENGINE_STEPS), ROWS, SCALE)
        weights, norm = engine.consolidated_state_dict(), engine.get_global_grad_norm()
        torch.manual_seed(1)  # other initial values: the checkpoint must replace them all
        resumed, *_ = infinity.initialize(model=tp.parallelize(tp.TinyLM(), mpu), config=config, mpu=mpu)
        resumed.load_checkpoint(os.path.join(root, "ckpt"))
        resumed_losses = tp.engine_steps(resumed, mpu, range(SAVE_AT, ENGINE_STEPS), ROWS, SCALE)
        if mpu.dp_rank == 0:
            results[mpu.tp_rank] = {
                "expected": {k: v.detach().clone() for k, v in reference.state_dict().items()},
                "expected_losses": expected_losses, "expected_norm": norms[-1],
                "weights": weights, "losses": losses, "norm": norm,
                "resumed": resumed.consolidated_state_dict(), "resumed_losses": resumed_losses}
        else:
            resumed.consolidated_state_dict()  # every rank of the data-parallel group gathers


@pytest.mark.parametrize("world,tp_size,offload,stage", [
    (4, 2, "nvme", 3),
    pytest.param(4, 2, "cpu", 3, marks=pytest.mark.slow),
    pytest.param(4, 2, "none", 2, marks=pytest.mark.slow),
    pytest.param(4, 2, "none", 1, marks=pytest.mark.slow),
    pytest.param(2, 2, "nvme", 3, marks=pytest.mark.slow),
    pytest.param(2, 1, "cpu", 3, marks=pytest.mark.slow),
], ids=["tp2xdp2-nvme", "tp2xdp2-cpu", "tp2xdp2-stage2", "tp2xdp2-stage1", "tp2xdp1-nvme", "tp1xdp2-cpu"])
def test_zero_under_an_mpu_equals_plain_torch_and_resumes(tmp_path, world, tp_size, offload, stage):
    """ZeRO (stage 3 with parameters and optimizer state on NVMe or in CPU memory, stages 2 and 1
    on the device) over each model-parallel rank's data-parallel group, clipping at 1.0 by the norm of
    the whole model, equals plain PyTorch at TP x DP (tests/megatron_tp.py) at 1e-5, weights
    included; a save, then a load into fresh engines and the remaining steps, equals the run that
    went on."""
    (tmp_path / "nvme").mkdir()
    results = mp.Manager().dict()
    mp.start_processes(_engine_worker, args=(world, tp_size, _free_port(), offload, stage, str(tmp_path), results),
                       nprocs=world, start_method="spawn")
    assert sorted(results.keys()) == list(range(tp_size))
    for tp_rank in range(tp_size):
        r = results[tp_rank]
        assert r["expected_norm"] > 1.5  # clipping at 1.0 acted
        torch.testing.assert_close(r["norm"], r["expected_norm"], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["losses"], r["expected_losses"], rtol=1e-5, atol=1e-6)
        assert set(r["weights"]) == set(r["expected"])
        for name, value in r["expected"].items():
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-5, msg=name)
            assert torch.equal(r["resumed"][name], r["weights"][name]), name
        assert r["resumed_losses"] == r["losses"][SAVE_AT:]
    tag = tmp_path / "ckpt" / f"global_step{SAVE_AT}"
    assert sorted(p.name for p in tag.iterdir()) == ["manifest.json"] + [f"mp_rank_{r:02d}" for r in range(tp_size)]
    from infinity.checkpoint.export import consolidate
    from infinity.checkpoint.layout import CheckpointError

    refused = [(tag, f"model-parallel checkpoint of {tp_size} slices")]
    if tp_size > 1:  # at model-parallel size 1 the one slice is the whole model
        refused.append((tag / "mp_rank_00", f"rank 0's slice of {tp_size}"))
    for path, said in refused:
        with pytest.raises(CheckpointError, match=said):
            consolidate(str(path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    plain, *_ = infinity.initialize(model=tp.TinyLM(), config=tp.engine_config(ROWS, _NoMpu(), "none", "", LR, 1.0))
    with pytest.raises(CheckpointError, match=f"holds {tp_size} model-parallel slices .* these engines have no mpu"):
        plain.load_checkpoint(str(tmp_path / "ckpt"))


class _NoMpu:
    dp = 1


def test_an_mpu_missing_its_methods_or_a_mesh_is_refused_by_name():
    class Half:
        def get_model_parallel_rank(self):
            return 0

    with pytest.raises(TypeError, match="mpu: expected DeepSpeed's model-parallel unit.*Half lacks "
                                        "get_model_parallel_world_size"):
        infinity.initialize(model=tp.TinyLM(), config=tp.engine_config(ROWS, _NoMpu(), "none", "", LR, 1.0),
                            mpu=Half())
    with pytest.raises(ValueError, match="mesh_param: DeepSpeed's device mesh"):
        infinity.initialize(model=tp.TinyLM(), config=tp.engine_config(ROWS, _NoMpu(), "none", "", LR, 1.0),
                            mesh_param=(2, 2))


def _resume_worker(rank: int, world: int, tp_size: int, port: int, root: str, results) -> None:
    with _joined(rank, world, tp_size, port) as mpu:
        config = tp.engine_config(ROWS, mpu, "nvme", os.path.join(root, "nvme"), LR, 1.0)
        engine, *_ = infinity.initialize(model=tp.parallelize(tp.TinyLM(), mpu), config=config, mpu=mpu)
        engine.load_checkpoint(os.path.join(root, "ckpt"))
        tp.engine_steps(engine, mpu, range(SAVE_AT, ENGINE_STEPS), ROWS, SCALE)
        weights = engine.consolidated_state_dict()
        if mpu.dp_rank == 0:
            results[mpu.tp_rank] = weights


@pytest.mark.slow
def test_a_model_parallel_checkpoint_resumes_on_another_data_parallel_size(tmp_path):
    """Saved at TP 2 x DP 2, loaded at TP 2 x DP 1: each slice re-sharded over its new group, and
    the remaining steps equal the uninterrupted run (to 1e-5: the gradients are averaged in
    another order)."""
    (tmp_path / "nvme").mkdir()
    first, resumed = mp.Manager().dict(), mp.Manager().dict()
    mp.start_processes(_engine_worker, args=(4, 2, _free_port(), "nvme", 3, str(tmp_path), first),
                       nprocs=4, start_method="spawn")
    mp.start_processes(_resume_worker, args=(2, 2, _free_port(), str(tmp_path), resumed), nprocs=2,
                       start_method="spawn")
    for tp_rank in range(2):
        for name, value in first[tp_rank]["weights"].items():
            torch.testing.assert_close(resumed[tp_rank][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _mixing_worker(rank: int, world: int, tp_size: int, port: int, root: str, results) -> None:
    with _joined(rank, world, tp_size, port) as mpu:
        config = tp.engine_config(ROWS, mpu, "none", "", LR, 1.0)
        engine, *_ = infinity.initialize(model=tp.parallelize(tp.TinyLM(), mpu), config=config, mpu=mpu)
        try:
            infinity.initialize(model=tp.TinyLM(), config=config)
        except ValueError as e:
            results[rank] = str(e)
        engine.close()
        plain, *_ = infinity.initialize(model=tp.TinyLM(), config=config)  # once the other is closed
        plain.close()


@pytest.mark.slow
def test_an_engine_without_the_mpu_beside_an_open_one_with_it_is_refused(tmp_path):
    """The data-parallel group is the process's ([Note: the data-parallel group] in zero/dist.py):
    a second engine over the whole job would move the first one's collectives."""
    results = mp.Manager().dict()
    mp.start_processes(_mixing_worker, args=(2, 2, _free_port(), str(tmp_path), results), nprocs=2,
                       start_method="spawn")
    assert len(results) == 2
    assert all("this process has an open engine over another data-parallel group" in r for r in results.values())
