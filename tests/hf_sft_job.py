"""TRL's SFTTrainer as its user writes a script: HfArgumentParser over SFTConfig, the tiny model
of hf_trainer_job.py (loaded with from_pretrained), a word-level tokenizer built in memory,
and a pre-tokenized `datasets.Dataset`. tests/test_hf_trainer.py runs it plain and under
`infinity run ... --deepspeed ds.json` and compares the logged steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig, SFTTrainer

from hf_trainer_job import VOCAB, Record, ReferenceTrainer, Tokens


@dataclass
class ScriptArguments:
    init_from: str = "init"
    record: str = "record.json"
    num_samples: int = 48
    seq_len: int = 16
    warmup_lr_reference: bool = False
    """(plain runs) DeepSpeed's WarmupLR, as in hf_trainer_job.py"""
    save_final: str | None = None
    """save_model() into this directory once training is done"""


class ReferenceSFTTrainer(SFTTrainer):
    create_scheduler = ReferenceTrainer.create_scheduler


def tokenizer() -> PreTrainedTokenizerFast:
    words = WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), pad_token="t0", eos_token="t1")


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(script.init_from)
    tokens = Tokens(script.num_samples, script.seq_len)
    data = Dataset.from_dict({"input_ids": [tokens[i]["input_ids"].tolist() for i in range(len(tokens))]})
    record = Record()
    logits = []  # whether each training forward returned logits (none with infinity's chunked loss)
    model.register_forward_hook(lambda m, i, out: logits.append(getattr(out, "logits", None) is not None) if m.training else None)
    trainer_class = ReferenceSFTTrainer if script.warmup_lr_reference else SFTTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer(),
                            callbacks=[record])
    trainer.train()
    if script.save_final:
        trainer.save_model(script.save_final)
    if trainer.is_world_process_zero():
        with open(script.record, "w") as f:
            json.dump({"steps": record.steps, "deepspeed": args.deepspeed is not None,
                       "world_size": args.world_size, "engine": type(trainer.model_wrapped).__module__,
                       "logits_in_training": sorted(set(logits))}, f)


if __name__ == "__main__":
    main()
