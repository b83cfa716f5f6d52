"""The chunked LM head and loss ([Note: the chunked LM loss] in infinity/zero/head_loss.py, [Note:
chunked loss for Hugging Face causal LMs] in infinity/engine/hf_models.py): a Hugging Face
causal LM trained through the engine with labels gets plain Hugging Face's loss and gradients
without the logits, and its peak memory no longer grows with the logits."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import infinity
from gpt import config
from infinity.deepspeed.utils import safe_get_full_grad
from infinity.zero.head_loss import chunked_lm_loss
from infinity.zero.tiling import TiledLinear, tile_names

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
VOCAB, DIM = 300, 32
TILE = DIM * 70  # the 300-row head in 5 tiles


def make_model(family: str, tied: bool, seed: int = 0) -> torch.nn.Module:
    """A two-layer model of the family, fp32; Gemma 2 and 3 with a soft-capping of 3 (it bites)."""
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
               "phi3": "Phi3Config"}
    extra = {"gemma": {"head_dim": 8}, "gemma2": {"head_dim": 8, "final_logit_softcapping": 3.0},
             "gemma3_text": {"head_dim": 8, "final_logit_softcapping": 3.0}, "qwen3": {"head_dim": 8},
             "phi3": {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}}
    cfg = getattr(transformers, classes[family])(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64, **extra.get(family, {}))
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def _batch(seed: int, batch: int = 2, tokens: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt, not scored
    labels[0, 10:12] = -100
    return ids, labels


def _config(stage: int = 3, chunked: dict | None = None, activation_checkpointing: dict | None = None, **kw) -> dict:
    cfg = config(stage, "cpu" if stage == 3 else "none", "cpu", micro=2, tile_size=TILE, **kw)
    if chunked is not None:
        cfg["chunked_loss"] = chunked
    if activation_checkpointing is not None:
        cfg["activation_checkpointing"] = activation_checkpointing
    return cfg


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's gradients under the model's own names (a tiled weight's tiles concatenated)."""
    grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
    for weight, parts in tile_names(engine.module).items():
        if all(k in grads for k, _, _ in parts):
            grads[weight] = torch.cat([grads[k] for k, _, _ in parts])
    return grads


def _compare_grads(engine, reference: torch.nn.Module, scale: float = 1.0) -> None:
    grads = _full_grads(engine)
    for name, p in reference.named_parameters():
        expected = p.grad * scale
        torch.testing.assert_close(grads[name], expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_chunked_loss_and_its_gradients_equal_hugging_faces(family, tied):
    """ZeRO-3, the head in 5 tiles and the tokens in chunks of 16: the loss (with ignore_index
    tokens), and every gradient, equal plain Hugging Face's at 1e-5; the output has no logits."""
    model = make_model(family, tied)
    ids, labels = _batch(1)
    reference = copy.deepcopy(model).train()
    expected = reference(input_ids=ids, labels=labels)
    expected.loss.backward()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(chunked={"chunk_bytes": 16 * 4 * 60}))
    head = engine.module.get_output_embeddings()
    assert isinstance(head, TiledLinear) and len(head.tiles) == 5
    out = engine(input_ids=ids, labels=labels)
    assert out.logits is None and "logits" not in out
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5 * expected.loss.item()
    engine.backward(out.loss)
    _compare_grads(engine, reference)
    engine.close()


@pytest.mark.parametrize("stage,gas", [(3, 2), (2, 1)])
def test_num_items_in_batch_and_accumulation(stage, gas):
    """Micro-batches whose loss is a sum over the tokens of all of them (the Trainer's
    num_items_in_batch): the (accumulated) gradient is plain Hugging Face's. Stage 2 runs the
    whole-weight path: the head untiled, scored in blocks of its rows."""
    model = make_model("llama", tied=False)
    batches = [_batch(2), _batch(3)][:gas]
    items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in batches)
    reference = copy.deepcopy(model).train()
    for ids, labels in batches:
        reference(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items)).loss.backward()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(stage, {"chunk_bytes": 8 * 4 * 60}, gas=gas))
    assert isinstance(engine.module.lm_head, TiledLinear) == (stage == 3)
    for i, (ids, labels) in enumerate(batches):
        out = engine(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items))
        assert out.logits is None
        engine.backward(out.loss)
        if i < gas - 1:
            engine.step()  # DeepSpeed's loop: a step each micro-batch, applied at the boundary
    _compare_grads(engine, reference, scale=1 / gas)  # the engine's gradient is divided by the accumulation steps
    engine.close()


def test_turned_off_eval_and_no_labels_return_the_logits():
    model = make_model("gemma2", tied=True)
    ids, labels = _batch(4)
    expected = copy.deepcopy(model).eval()(input_ids=ids).logits
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config())
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids, labels=labels).logits, expected)  # no grad: whole
    engine.module.eval()
    torch.testing.assert_close(engine(input_ids=ids, labels=labels).logits, expected)  # eval: whole
    engine.module.train()
    engine.close()
    engine, *_ = infinity.initialize(copy.deepcopy(model), config=_config(chunked={"enabled": False}))
    out = engine(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, expected)  # turned off: the model's own forward
    engine.close()


def test_the_function_alone_matches_cross_entropy_with_softcapping_and_bf16():
    """`chunked_lm_loss` over an nn.Linear (no engine) in bf16 with soft-capping: Hugging Face's
    loss function of the same logits, and the same gradients to bf16 rounding."""
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, VOCAB, bias=False).bfloat16()
    h = torch.randn(3, 17, DIM, dtype=torch.bfloat16, requires_grad=True)
    ids, labels = _batch(5, batch=3, tokens=17)
    from transformers.loss.loss_utils import ForCausalLMLoss

    z = head(h)
    z = torch.tanh(z / 3.0) * 3.0
    expected = ForCausalLMLoss(z, labels, VOCAB)
    expected.backward()
    grads = h.grad.clone(), head.weight.grad.clone()
    h.grad = head.weight.grad = None
    loss = chunked_lm_loss(head, h, labels, chunk_bytes=5 * 4 * VOCAB, softcap=3.0)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    for got, want in zip((h.grad, head.weight.grad), grads):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_blocks_of_rows_and_chunks_of_tokens_give_the_plain_loss_and_gradients():
    """A 2500-row head in fp32 with `chunk_bytes` small enough that each pass runs over three
    blocks of rows (1024, 1024, 452) and token chunks of 8: the plain head's loss and gradients."""
    torch.manual_seed(0)
    vocab = 2500
    head = torch.nn.Linear(DIM, vocab, bias=False)
    h = torch.randn(3, 17, DIM, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 17), generator=torch.Generator().manual_seed(1))
    labels[:, :3] = -100
    from transformers.loss.loss_utils import ForCausalLMLoss

    expected = ForCausalLMLoss(head(h), labels, vocab)
    expected.backward()
    grads = h.grad.clone(), head.weight.grad.clone()
    h.grad = head.weight.grad = None
    loss = chunked_lm_loss(head, h, labels, chunk_bytes=4 * 1024 * 8)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    for got, want in zip((h.grad, head.weight.grad), grads):
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_labels_out_of_range_are_refused_by_name():
    head = torch.nn.Linear(DIM, VOCAB, bias=False)
    labels = torch.full((1, 5), 7)
    labels[0, 3] = VOCAB
    with pytest.raises(IndexError, match=r"labels: every label must be in \[0, 300\)"):
        chunked_lm_loss(head, torch.randn(1, 5, DIM), labels, chunk_bytes=1 << 20)


# ---- memory ---------------------------------------------------------------------------------

# The child of bench/bench_long_sequence.py: one step, then its VmHWM.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_long_sequence import CHILD as _CHILD  # noqa: E402


def peak_rss(tmp_path, tokens: int, chunked: bool = True) -> dict:
    """VmHWM of a child that builds the 128k-vocabulary Llama under infinity.Init, all its state on
    NVMe, and trains one step of `tokens` tokens."""
    nvme = tmp_path / f"nvme-{tokens}-{int(chunked)}"
    nvme.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "INFINITY_DEVICE": "cpu", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tokens), str(int(chunked)), str(nvme)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two 139M-parameter engines in children: about a minute and a half here
def test_peak_rss_grows_by_less_than_three_quarters_of_a_gib_from_1k_to_8k_tokens(tmp_path):
    """An HF Llama with a 128k vocabulary (dim 512, 2 layers, all state on NVMe): whole logits grew
    its peak by 11 GiB from 1k to 8k tokens (38733f9); chunked, by less than 0.75 GiB."""
    small, big = peak_rss(tmp_path, 1024), peak_rss(tmp_path, 8192)
    assert big["peak_rss"] - small["peak_rss"] < 0.75 * (1 << 30), (small, big)


# ---- Hugging Face's gradient checkpointing ---------------------------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_enable_runs_through_infinity_checkpointing(tmp_path, when):
    """`model.gradient_checkpointing_enable()`, before or after `initialize`: the layers'
    checkpointed inputs go where `activation_checkpointing.nvme_path` says (files there after
    forward, none without it), and the gradients are plain Hugging Face's."""
    model = make_model("qwen2", tied=False)
    ids, labels = _batch(6, batch=2, tokens=24)
    reference = copy.deepcopy(model).train()
    reference(input_ids=ids, labels=labels).loss.backward()
    user = copy.deepcopy(model)
    if when == "before":
        user.gradient_checkpointing_enable()
    cfg = _config(activation_checkpointing={"nvme_path": str(tmp_path), "nvme_min_bytes": 1})
    engine, *_ = infinity.initialize(user, config=cfg)
    if when == "after":
        engine.module.gradient_checkpointing_enable()
    out = engine(input_ids=ids, labels=labels, use_cache=False)
    spilled = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert spilled >= 2 * 2 * 24 * DIM * 4, spilled  # each layer's input, at least, is in a file there
    engine.backward(out.loss)
    _compare_grads(engine, reference)
    engine.close()


@pytest.mark.parametrize("enabled", [True, False])
def test_infinitys_own_llama_computes_whole_logits_when_the_chunked_loss_is_off(enabled):
    """`infinity finetune`'s Llama computes its loss itself; `"chunked_loss": {"enabled": false}`
    must give it whole logits too (the head called once on every token), as the key promises,
    and the same loss to fp32 rounding."""
    from infinity.apps.models.llama import Llama

    torch.manual_seed(0)
    model = Llama({"vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                   "tie_word_embeddings": False})
    ids, labels = _batch(6)
    expected = torch.nn.functional.cross_entropy(copy.deepcopy(model)(ids)[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))
    engine, *_ = infinity.initialize(model, config=_config(chunked={"enabled": enabled}))
    shapes = []
    handle = engine.module.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    loss = engine(ids, labels)
    handle.remove()
    torch.testing.assert_close(loss, expected)
    assert ((2, 20, VOCAB) in shapes) is not enabled  # whole logits exactly when the chunked loss is off
    engine.close()
