"""`infinity finetune`: fine-tune a causal language model with parameters and optimizer state
offloaded, from a Hugging Face model directory or a preset architecture, on a text/JSONL file or
the Python standard library's own source, with checkpoints, resume, LoRA and export.

With no arguments it runs the embedded default: a small Llama-architecture model with a byte
tokenizer, parameters and optimizer state on NVMe in a temporary directory, a sample generated
before and after, and a table of what lived where and what moved per step.

The flags are in finetune_args.py, the built-in config in finetune_config.py, the model (LoRA,
the checks its shapes bound, the samples) in finetune_model.py and the export in
finetune_export.py; this module runs the job and reports it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from tqdm import tqdm

from infinity.apps.finetune_args import add_arguments, check_arguments
from infinity.apps.finetune_config import (
    DEFAULT_BATCH,
    BUILTIN_SHARE,
    OPTIMIZER_BUFFERS,
    PARAM_BUFFERS,
    PIECE,
    TILE_SIZE,
    _default_config,
    builtin_budget,
    describe_choices,
    largest_unit_numel,
)
from infinity.apps.finetune_export import export_model
from infinity.apps.finetune_model import (
    DEFAULT_MODEL,
    LORA_TARGETS,
    PROMPT,
    SAMPLE_WINDOW,
    LoRALinear,
    _check_token_ids,
    add_lora,
    build_model,
    check_model_sizes,
    generate,
    read_model,
)

__all__ = [
    "BUILTIN_SHARE", "DEFAULT_BATCH", "DEFAULT_MODEL", "LORA_TARGETS", "OPTIMIZER_BUFFERS", "PARAM_BUFFERS", "PIECE",
    "PROMPT", "SAMPLE_WINDOW", "TILE_SIZE", "LoRALinear", "add_arguments", "add_lora", "build_model",
    "builtin_budget", "check_arguments", "check_model_sizes", "describe_choices", "export_model", "generate",
    "largest_unit_numel", "read_model", "run",
]


def _loss(out):
    return getattr(out, "loss", out)


def _table(engine, steps_s: list[float], moved: list[dict]) -> str:
    from infinity.offload._messages import human_bytes
    device = engine.peak_gathered_bytes()
    host = sum(p.buffer_count * p.buffer_size for p in (getattr(engine.params, "pool", None),
                                                        getattr(engine.optim_state, "pool", None)) if p is not None)
    nvme = 0
    for tier in (engine.params, engine.optim_state):  # the disk the job's store directories take
        store = getattr(tier, "store", None)
        for root, _, files in os.walk(store.directory) if store is not None else ():
            nvme += sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files)
    total = sorted(m["read"] + m["write"] for m in moved)
    last = engine.report.last
    read_gbps = last.get("nvme_read_gbps", 0.0) + last.get("optimizer_nvme_read_gbps", 0.0)
    rows = [("device (gathered units, peak)", human_bytes(device)),
            ("host (pinned pools)", human_bytes(host)),
            ("NVMe (parameter and optimizer files)", human_bytes(nvme)),
            ("moved per step (NVMe read + write, median)", human_bytes(total[len(total) // 2]) if total else "-"),
            ("NVMe read / write GB/s (last step)",
             f"{read_gbps:.2f} / {last.get('optimizer_nvme_write_gbps', 0.0):.2f}"),
            ("I/O hidden behind compute (last step)", f"{last.get('overlap_fraction', 1.0):.0%}"),
            ("step time (median)", f"{sorted(steps_s)[len(steps_s) // 2]:.3f} s" if steps_s else "-")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _moved(last: dict) -> dict:
    """A step's NVMe bytes read and written (parameters and optimizer state) and the seconds the
    compute thread waited on transfers, from the engine's report of it."""
    return {"read": last.get("nvme_read_bytes", 0) + last.get("optimizer_nvme_read_bytes", 0),
            "write": last.get("nvme_write_bytes", 0) + last.get("optimizer_nvme_write_bytes", 0),
            "wait_s": sum(last.get("waits", {}).values())}


def _train(engine, rows: torch.Tensor, start: int, args) -> tuple[list[float], list[float], list[dict]]:
    """Steps `start` to `args.steps`, checkpointing every `--save-every` and after the last step;
    returns per-step losses, seconds and what moved (`_moved`)."""
    from infinity.apps.data import batch

    size = engine.config.batch.train_micro_batch_size_per_gpu * engine.config.batch.gradient_accumulation_steps
    losses, steps_s, moved = [], [], []
    gas = engine.config.batch.gradient_accumulation_steps
    micro = engine.config.batch.train_micro_batch_size_per_gpu
    bar = tqdm(range(start, args.steps), desc="finetune", unit="step", initial=start, total=args.steps)
    for step in bar:
        t0 = time.perf_counter()
        ids = batch(rows, step, size)
        total = 0.0
        for k in range(gas):
            part = ids[k * micro:(k + 1) * micro]
            loss = _loss(engine(input_ids=part, labels=part))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        dt = time.perf_counter() - t0
        losses.append(total)
        steps_s.append(dt)
        moved.append(_moved(engine.report.last))
        bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{ids.numel() / dt:.0f}", step_s=f"{dt:.2f}")
        if args.save and (engine.global_steps % args.save_every == 0 or step == args.steps - 1):
            engine.save_checkpoint(args.save, client_state={"next_step": engine.global_steps})
    bar.close()
    return losses, steps_s, moved


def _gradient_checkpointing(model) -> None:
    """--gradient-checkpointing: infinity's Llama checkpoints each layer itself; a Hugging Face
    model takes its own switch, which the engine routes through infinity's checkpoint ([Note:
    Hugging Face's gradient checkpointing] in infinity/engine/hf_models.py)."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing = True


def run(args) -> int:
    import infinity
    from infinity.apps.data import pack, read_texts, stdlib_corpus

    check_arguments(args)
    torch.manual_seed(args.seed)
    model_config, tokenizer, pretrained = read_model(args)
    check_model_sizes(args, model_config, tokenizer)
    texts = read_texts(args.data) if args.data else stdlib_corpus(4 << 20)
    rows = pack(texts, tokenizer, args.seq_len)
    _check_token_ids(args, model_config, tokenizer, rows)
    model = build_model(model_config)
    if args.gradient_checkpointing:
        _gradient_checkpointing(model)
    lora = add_lora(model, args.lora) if args.lora else []
    lr = args.lr if args.lr is not None else (1e-4 if pretrained else 3e-3)
    engine, *_ = infinity.initialize(model=model, config=_engine_config(args, model, lr))
    if engine.chosen:
        print("the engine chose: " + describe_choices(engine.chosen))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if pretrained:
            infinity.load_pretrained(engine, pretrained, missing_ok=lambda name: ".lora_" in name)
        print(f"model: {engine.trainable_numel / 1e6:.2f}M trainable and {engine.frozen_numel / 1e6:.2f}M frozen "
              f"parameters in {len(engine.units)} units; offload param={engine.config.zero.offload_param.device}, "
              f"optimizer={engine.config.zero.offload_optimizer.device}; data: {rows.numel() / 1e6:.2f}M tokens")
        start = _resume(engine, args) if args.resume else 0
        if args.save:
            signal.signal(signal.SIGTERM, _save_and_exit(engine, args.save))
        if args.sample_tokens:
            print(f"sample before: {generate(engine, tokenizer, PROMPT, args.sample_tokens)!r}")
        losses, steps_s, moved = _train(engine, rows, start, args) if start < args.steps else ([], [], [])
        if losses:
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {start}-{args.steps - 1}")
        if args.sample_tokens:
            print(f"sample after:  {generate(engine, tokenizer, PROMPT, args.sample_tokens)!r}")
        if args.save and losses:  # _train saved after the last step
            ck = engine.last_checkpoint
            print(f"checkpoint {ck['path']}: {ck['bytes'] / 1e6:.1f} MB in {ck['seconds']:.2f} s")
        print("what lived where and what moved:")
        print(_table(engine, steps_s, moved))
        if args.plot and losses:
            _plot(args.plot, list(range(start, start + len(losses))), losses, moved)
        if args.metrics:
            _write_metrics(args.metrics, engine, start, losses, steps_s, moved)
        if args.export:
            export_model(engine, args.export, lora, tokenizer)
            print(f"exported to {args.export}")
    finally:
        if args.save:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)  # None: not set from Python
        engine.close()
    return 0


def _engine_config(args, model, lr: float) -> dict | str:
    """The config the engine gets: --config as given, else the built-in one for this model (its
    choices printed), with --trace and --save-total-limit added. The stores go straight under
    --nvme-path, where the next run and `infinity clean` look for what a killed run left ([Note:
    cleanup on exit] in infinity/offload/store.py)."""
    config = args.config
    if config is None:
        config, chose = _default_config(args.nvme_path, args.offload or "nvme", args.batch or DEFAULT_BATCH, lr,
                                        model, checkpointing=args.gradient_checkpointing)
        if args.moment_format:
            config["optimizer"]["params"]["moment_format"] = args.moment_format
            chose += f"; {args.moment_format} moments"
        print(chose)
    if (args.trace or args.save_total_limit) and not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if args.trace:
        config = {**config, "trace": {**config.get("trace", {}), "path": args.trace}}
    if args.save_total_limit:
        config = {**config, "checkpoint": {**config.get("checkpoint", {}), "save_total_limit": args.save_total_limit}}
    return config


def _resume(engine, args) -> int:
    """--resume: loads the checkpoint; returns the step to go on from."""
    _, client = engine.load_checkpoint(args.resume)
    start = client.get("next_step", engine.global_steps)  # saved through the API: its step count
    print(f"resumed from {args.resume} at step {start}")
    if start >= args.steps:
        print(f"--steps {args.steps}: the checkpoint is at step {start} already; nothing to train")
    return start


def _save_and_exit(engine, save_dir: str):
    """The SIGTERM handler of a run that saves: a checkpoint at the end of the step the signal
    arrived in, then exit 128 + the signal."""
    def preempted(signum, frame):
        engine.save_checkpoint(save_dir, client_state={"next_step": engine.global_steps})
        print(f"\nsignal {signum}: saved {engine.last_checkpoint['path']}; exiting", flush=True)
        engine.close()
        sys.exit(128 + signum)
    return preempted


def _write_metrics(path: str, engine, start: int, losses: list[float], steps_s: list[float],
                   moved: list[dict]) -> None:
    """--metrics: each step's loss, time and NVMe traffic, the optimizer and the peak RSS, as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"steps": list(range(start, start + len(losses))), "loss": losses, "step_s": steps_s,
                   "nvme_bytes": [m["read"] + m["write"] for m in moved],
                   "nvme_read_bytes": [m["read"] for m in moved],
                   "nvme_write_bytes": [m["write"] for m in moved],
                   "io_wait_s": [m["wait_s"] for m in moved], "optimizer": engine.optimizer.rule.describe(),
                   "peak_rss_bytes": _peak_rss()}, f)


def _peak_rss() -> int:
    """This process's peak resident set so far (bytes)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _plot(path: str, steps: list[int], losses: list[float], moved: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: needs matplotlib (pip install 'infinity[plot]'); skipped", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, losses)
    a.set_ylabel("loss")
    b.bar(steps, [(m["read"] + m["write"]) / 2 ** 20 for m in moved])
    b.set_ylabel("NVMe MiB per step")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
