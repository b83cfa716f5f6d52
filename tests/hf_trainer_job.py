"""A Hugging Face Trainer script as a user writes one: HfArgumentParser over TrainingArguments
and the script's own arguments, a tiny causal LM built from its config (or loaded with
`from_pretrained`), synthetic token data.

tests/test_hf_trainer.py copies it into a temporary directory and runs it twice: as
`python hf_trainer_job.py ARGS` (plain PyTorch) and as `infinity run hf_trainer_job.py ARGS
--deepspeed ds.json`, and compares what it records (`--record`): the loss, learning rate and
gradient norm the Trainer logs at every step. The weights are compared through `save_model`.

`--warmup_lr_reference` (plain runs only) gives the Trainer DeepSpeed's WarmupLR as a LambdaLR,
written here from DeepSpeed's documented formula, so the plain run follows the schedule that
the DeepSpeed config's WarmupLR section asks for.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, HfArgumentParser, LlamaConfig, Trainer,
                          TrainerCallback, TrainingArguments, set_seed)

VOCAB = 64


@dataclass
class ScriptArguments:
    model: str = "llama"
    """llama or gpt2: the architecture of the tiny model built from its config"""
    init_from: str | None = None
    """a directory written by save_pretrained: the model is loaded from it with from_pretrained"""
    record: str = "record.json"
    """where the logged steps go (rank 0 writes)"""
    num_samples: int = 48
    seq_len: int = 16
    warmup_lr_reference: bool = False
    """(plain runs) DeepSpeed's WarmupLR: log warmup from 0 to learning_rate over warmup_steps"""
    save_final: str | None = None
    """save_model() into this directory once training is done"""
    evaluate_first: bool = False
    """evaluate() on held-out sequences before train() (a baseline), and again after it"""
    evaluate_after: bool = False
    """held-out sequences as the eval set, and evaluate() after train() (with --eval_on_start: a baseline)"""


class Tokens(torch.utils.data.Dataset):
    """Sequences that follow a rule (each token from the one before), so the loss can fall."""

    def __init__(self, num_samples: int, seq_len: int, first: int = 0):
        self.num_samples, self.seq_len, self.first = num_samples, seq_len, first

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.first + i)
        ids = torch.empty(self.seq_len, dtype=torch.long)
        ids[0] = torch.randint(0, VOCAB, (1,), generator=g)
        step = int(torch.randint(1, 5, (1,), generator=g))
        for t in range(1, self.seq_len):
            ids[t] = (ids[t - 1] * 3 + step) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def build_model(script: ScriptArguments):
    if script.init_from:
        return AutoModelForCausalLM.from_pretrained(script.init_from, dtype=torch.float32)
    if script.model == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
    elif script.model == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        raise ValueError(f"--model: expected llama or gpt2, got {script.model}")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def warmup_lr(step: int, warmup_steps: int) -> float:
    """DeepSpeed's WarmupLR factor for update `step` (0-based; warmup_type "log", warmup_min_lr
    0). DeepSpeed's scheduler sets warmup_min_lr when built and its first step() moves to
    iteration 0, whose factor log(0 + 1) / log(W) is 0 too: update s >= 1 runs at
    log(s) / log(W) until iteration s - 1 reaches W (DeepSpeed takes W as at least 2), then 1."""
    w = max(2, warmup_steps)
    if step == 0:
        return 0.0
    return math.log(step) / math.log(w) if step - 1 < w else 1.0


class ReferenceTrainer(Trainer):
    """The Trainer with DeepSpeed's WarmupLR instead of its own schedule (plain runs)."""

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            warmup = max(1, self.args.get_warmup_steps(num_training_steps))
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer,
                                                                  lambda step: warmup_lr(step, warmup))
        return self.lr_scheduler


class Record(TrainerCallback):
    def __init__(self):
        self.steps, self.evaluations = [], []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append(metrics["eval_loss"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"step": state.global_step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                               "grad_norm": logs.get("grad_norm")})


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(args.seed)
    model = build_model(script)
    record = Record()
    logits = []  # whether each training forward returned logits (none with infinity's chunked loss)
    model.register_forward_hook(lambda m, i, out: logits.append(getattr(out, "logits", None) is not None) if m.training else None)
    trainer_class = ReferenceTrainer if script.warmup_lr_reference else Trainer
    held_out = Tokens(8, script.seq_len, first=10_000) if script.evaluate_first or script.evaluate_after else None
    trainer = trainer_class(model=model, args=args, train_dataset=Tokens(script.num_samples, script.seq_len),
                            eval_dataset=held_out, callbacks=[record])
    if script.evaluate_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if held_out is not None:
        trainer.evaluate()
    if script.save_final:
        trainer.save_model(script.save_final)
    if trainer.is_world_process_zero():
        out = {"steps": record.steps, "deepspeed": args.deepspeed is not None,
               "world_size": args.world_size, "engine": type(trainer.model_wrapped).__module__,
               "logits_in_training": sorted(set(logits)), "eval_loss": record.evaluations}
        with open(script.record, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
