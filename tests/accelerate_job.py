"""An accelerate training loop as its documentation writes one: `Accelerator()`, a Hugging Face
causal LM from `from_pretrained`, torch's AdamW, `accelerator.prepare`, `accelerator.backward`.

tests/test_accelerate.py runs it under `accelerate launch` twice: plain (`--cpu`) and with
DeepSpeed (`--use_deepspeed --deepspeed_config_file ds.json`, or an accelerate config file with
`distributed_type: DEEPSPEED`) where `INFINITY_AS_DEEPSPEED=1` makes `deepspeed` infinity, and
compares the losses it prints.

    accelerate launch job.py MODEL_DIR RECORD_JSON
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed


def main() -> None:
    model_dir, record = sys.argv[1], sys.argv[2]
    accelerator = Accelerator()
    set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (2, 16), generator=g) for _ in range(4)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    deepspeed = sys.modules.get("deepspeed")  # which one this process used, if any
    with open(record, "w") as f:
        json.dump({"losses": losses, "model": type(model).__module__,
                   "deepspeed": getattr(deepspeed, "__name__", None)}, f)


if __name__ == "__main__":
    main()
