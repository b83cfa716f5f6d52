"""`data_types.grad_accum_dtype`: every value DeepSpeed takes is accepted, and gradients
accumulate in fp32 whichever it is ([Note: gradient accumulation dtype] in
infinity/config/sections.py), which "fp16" and "bf16" say once in the log."""

from __future__ import annotations

import pytest
import torch
from gpt import TinyGPT, batches, config, engine_run

import infinity
from infinity.config import load_config
from infinity.config.sections import _log_fp32_accumulation

MINIMAL = {"train_micro_batch_size_per_gpu": 1}


@pytest.fixture(autouse=True)
def _fresh_log_once():
    _log_fp32_accumulation.cache_clear()
    yield
    _log_fp32_accumulation.cache_clear()


@pytest.mark.parametrize(("given", "kept"), [
    (None, None), ("fp32", "fp32"), ("float32", "fp32"), ("torch.float32", "fp32"),
    ("fp16", "fp16"), ("half", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16"),
])
def test_deepspeeds_spellings_are_accepted(given, kept) -> None:
    config = load_config({**MINIMAL, "data_types": {"grad_accum_dtype": given}})
    assert config.data_types.grad_accum_dtype == kept


def test_no_section_means_the_models_dtype() -> None:
    assert load_config(MINIMAL).data_types.grad_accum_dtype is None


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_16_bit_accumulation_is_logged_once_as_fp32(dtype, caplog) -> None:
    with caplog.at_level("WARNING", logger="infinity"):
        for _ in range(3):  # frameworks load a config more than once
            load_config({**MINIMAL, "data_types": {"grad_accum_dtype": dtype}})
    records = [r for r in caplog.records if "grad_accum_dtype" in r.getMessage()]
    assert len(records) == 1
    assert f'"{dtype}" accepted; infinity accumulates gradients in fp32' in records[0].getMessage()


def test_fp32_accumulation_logs_nothing(caplog) -> None:
    with caplog.at_level("WARNING", logger="infinity"):
        load_config({**MINIMAL, "data_types": {"grad_accum_dtype": "fp32"}})
        load_config({**MINIMAL, "data_types": {"grad_accum_dtype": None}})
    assert "grad_accum_dtype" not in caplog.text


@pytest.mark.parametrize(("section", "error", "message"), [
    ({"grad_accum_dtype": "int8"}, ValueError,
     'data_types.grad_accum_dtype: expected one of "fp32", "fp16", "bf16" (or null for the model\'s dtype), '
     'got "int8"'),
    ({"grad_accum_dtype": 16}, ValueError, "data_types.grad_accum_dtype: expected one of"),
    ({"grad_acum_dtype": "fp32"}, ValueError, "data_types.grad_acum_dtype: unknown key; did you mean "
                                              "data_types.grad_accum_dtype?"),
])
def test_bad_values_name_the_key(section, error, message) -> None:
    with pytest.raises(error) as caught:
        load_config({**MINIMAL, "data_types": section})
    assert message in str(caught.value)


def _trained(grad_accum_dtype: str | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = {**config(gas=2, micro=2), "bf16": {"enabled": True},
           "data_types": {"grad_accum_dtype": grad_accum_dtype}}
    engine, *_ = infinity.initialize(model=model, config=cfg)
    try:
        engine_run(engine, batches(4, 2), gas=2)
        return {name: value.float().clone() for name, value in engine.consolidated_state_dict().items()}
    finally:
        engine.close()


def test_bf16_accumulation_trains_exactly_as_fp32_accumulation() -> None:
    # A bf16 model accumulating 2 micro-batches: the gradients are summed in fp32 on the host
    # whatever grad_accum_dtype says, so "bf16" gives the very same weights as "fp32".
    as_fp32 = _trained("fp32")
    as_bf16 = _trained("bf16")
    assert as_fp32.keys() == as_bf16.keys()
    for name in as_fp32:
        assert torch.equal(as_fp32[name], as_bf16[name]), name
