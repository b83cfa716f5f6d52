"""Other frameworks' protocols turned into engine calls: Lightning (`lightning/`). Hugging Face's
Trainer, accelerate and TRL need none: they run their DeepSpeed path on the `deepspeed` alias."""
