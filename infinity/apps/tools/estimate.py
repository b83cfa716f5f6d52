"""`infinity estimate`: what fits where, before a job is started.

    infinity estimate --params 70B --gpus 8 --gpu-mem 80G --cpu-mem 1T --nvme-free 8T --nvme-gbps 12
    infinity estimate --model llama-3b                 # this machine's memory and disk
    infinity estimate --model /models/Llama-3.1-8B --lora 16

For each offload choice (offload_param x offload_optimizer in {none, cpu, nvme}, all ZeRO stage
3, bf16, Adam) it prints the bytes one rank keeps on the device, in host memory and on NVMe,
whether that fits the machine, the NVMe bandwidth that keeps a step compute-bound, and the
`zero_optimization` block of the cheapest placement that fits, ready to paste.

The parts: the model's units (estimate_model.py), the machine (estimate_machine.py), what each
tier holds, what fits and the NVMe bandwidth a step needs (estimate_placement.py:
[Note: byte accounting], [Note: FLOP model], [Note: preference order]), and the host peak of
`infinity finetune` (estimate_finetune.py: [Note: the peak of a finetune step]); the report and
the command line are here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

from infinity.apps.tools.estimate_finetune import SEQ_LEN, activation_parts, finetune_host_peak
from infinity.apps.tools.estimate_machine import DEFAULT_GPU_TFLOPS, Machine, machine_from_args, measure_cpu_tflops
from infinity.apps.tools.estimate_model import (
    DEFAULT_UNITS,
    ModelSize,
    UnitSize,
    load_architecture,
    lora_param_count,
    model_from_config,
    model_from_count,
)
from infinity.apps.tools.estimate_placement import (
    FP32,
    HALF,
    TIERS,
    Item,
    Placement,
    config_block,
    nvme_gbps_needed,
    placements,
    recommend,
    shortfalls,
    step_flops,
)
from infinity.offload._messages import human_bytes

__all__ = [
    "DEFAULT_GPU_TFLOPS", "DEFAULT_UNITS", "FP32", "HALF", "MAX_PARAMS", "NOTES", "TIERS", "TOKENS_PER_RANK", "Item",
    "Machine", "ModelSize", "Placement", "UnitSize", "activation_parts", "add_arguments", "config_block",
    "finetune_host_peak", "load_architecture", "lora_param_count", "machine_from_args", "measure_cpu_tflops",
    "model_from_args", "model_from_config", "model_from_count", "nvme_gbps_needed", "parse_bytes", "parse_count",
    "parse_params", "placements", "recommend", "report", "run", "shortfalls", "step_flops",
]

TOKENS_PER_RANK = 16384  # default tokens per step and rank: 8 sequences of 2048
_COUNT_SUFFIXES = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


# ---- the report ---------------------------------------------------------------------------------


def _count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def _describe_model(model: ModelSize) -> str:
    what = (f"{model.name + ': ' if model.name else ''}{_count(model.numel)} parameters "
            f"({_count(model.trainable)} trainable, {_count(model.frozen)} frozen)")
    layer = _count(model.layer.numel)
    if model.exact:
        tiles = (f" + {len(model.tiles)} tiles of at most {_count(max(t.numel for t in model.tiles))}"
                 if model.tiles else "")
        return f"{what}; units: {model.num_layers} layers of {layer} + root {_count(model.root.numel)}{tiles}"
    return f"{what}; units assumed: {model.num_layers} of {layer} (--largest-unit; --model knows them)"


def _describe_machine(m: Machine) -> str:
    if m.gpus == 0:
        device = "CPU only: the CPU computes, device and host share"
        memory = f"{human_bytes(m.cpu_bytes)} of memory"
    else:
        gpu = human_bytes(m.gpu_bytes) if m.gpu_bytes is not None else "unknown memory (not checked: --gpu-mem)"
        device = f"1 GPU of {gpu};" if m.gpus == 1 else f"{m.gpus} GPUs of {gpu}, a rank each;"
        memory = f"host memory {human_bytes(m.cpu_bytes)}"
    gbps = f", {m.nvme_gbps:g} GB/s" if m.nvme_gbps else ""
    return f"machine: {device} {memory}; NVMe {human_bytes(m.nvme_free)} free under {m.nvme_path}{gbps}"


def _table(options: list[Placement], model: ModelSize, machine: Machine, tokens: int) -> list[str]:
    head = (f"{'offload_param':<14} {'offload_optimizer':<18}{'device':>11}{'host':>11}{'NVMe':>11}  "
            f"{'fits':<16}{'NVMe GB/s for compute-bound':>28}")
    lines = [head, "-" * len(head)]
    for p in options:
        short = shortfalls(p, machine)
        fits = "yes" if not short else "no: " + ", ".join(short)
        need = ""
        if p.step_nvme_bytes and model.numel:
            gbps = nvme_gbps_needed(p, model, machine, tokens)
            need = f"{gbps:.3g}"
            if machine.nvme_gbps:
                need += " (ok)" if gbps <= machine.nvme_gbps else f" (I/O-bound x{gbps / machine.nvme_gbps:.3g})"
        lines.append(f"{p.param:<14} {p.optimizer:<18}{human_bytes(p.device):>11}{human_bytes(p.host):>11}"
                     f"{human_bytes(p.nvme):>11}  {fits:<16}{need:>28}".rstrip())
    return lines


NOTES = (
    ("device: the gathered units (root + 2 layers) and their bf16 gradients, plus what the row places there; "
     "activations come on top"),
    ("host and NVMe are the node's, shared by its ranks: a row fits when ranks x per-rank bytes fit; no headroom "
     "is kept"),
    "host includes the pinned pools of NVMe placements, sized as the recommended block sizes them",
    ("offload_optimizer nvme: gradient accumulators (for clipping, fp16 or accumulation; bf16 with one pass a "
     "step, fp32 when passes accumulate) stay in host memory up to max_grad_in_cpu elements, the rest spill to "
     "NVMe; its pool holds 9 (12 with spills) pieces of about "
     "sub_group_size fp32 elements: a smaller sub_group_size shrinks it"),
)


def _formats(model: ModelSize, machine: Machine, shown: str) -> list[str]:
    """Which placement each moment format would take first ([Note: moment formats] in
    infinity/optim/formats.py): the bytes of optimizer state differ, the numerics are the user's call."""
    lines = ["", "moment formats (optimizer.params.moment_format; their numerics differ, the choice is yours):"]
    for fmt, per in (("fp32", "12"), ("bf16", "8"), ("8bit", "about 6")):
        best = recommend(placements(model, machine.world, machine.nvme_path, fmt), machine)
        where = ("nothing fits" if best is None else
                 f"offload_param {best.param}, offload_optimizer {best.optimizer} fits (NVMe {human_bytes(best.nvme)}, "
                 f"host {human_bytes(best.host)})")
        mark = " (the table above)" if fmt == shown else ""
        lines.append(f"  {fmt:<5} {per} bytes of master and moments a trainable parameter: {where}{mark}")
    return lines


def report(model: ModelSize, machine: Machine, tokens: int, finetune: list[tuple[str, int]] | None = None,
           fmt: str = "fp32", checkpointing: bool = False) -> str:
    """The whole printout: header, table, recommendation (a JSON block), `infinity finetune`'s
    peak (`finetune_host_peak`, where given), notes."""
    options = placements(model, machine.world, machine.nvme_path, fmt)
    flops = step_flops(model, tokens)
    unit = "GPU" if machine.gpus else "CPU"
    lines = [f"model: {_describe_model(model)}", _describe_machine(machine)]
    if machine.described:
        lines.append("  figures not given: " + "; ".join(machine.described))
    seconds = flops / (machine.world * machine.tflops * 1e12)
    lines.append(f"step: {tokens:,} tokens x (6 x trainable + 4 x frozen) = {flops:.3g} FLOPs; at "
                 f"{machine.tflops:.3g} TFLOP/s per {unit}: {seconds:.3g} s of compute")
    lines += [f"bytes per rank (world size {machine.world}), ZeRO stage 3, bf16, Adam with {fmt} moments; activations "
              "not counted:", ""]
    lines += _table(options, model, machine, tokens)
    best = recommend(options, machine)
    lines.append("")
    if best is None:
        lines.append("nothing fits this machine: more GPUs (--gpus) shard every tier, --lora or --frozen-fraction "
                     "leave fewer parameters with optimizer state, a smaller sub_group_size shrinks the host pools")
    else:
        lines.append(f"recommended: offload_param {best.param}, offload_optimizer {best.optimizer} "
                     "(the first row that fits; rows in order of preference)")
        lines.append(json.dumps(config_block(best), indent=2))
    lines += _formats(model, machine, fmt)
    if finetune:
        total = sum(n for _, n in finetune)
        fits = "fits" if total <= machine.cpu_bytes else "does not fit"
        flag = " --gradient-checkpointing" if checkpointing else ""
        lines += ["", f"infinity finetune{flag} with its built-in config (params and optimizer on NVMe), {tokens:,} "
                      f"tokens a step: peak host memory about {human_bytes(total)} ({fits} in {human_bytes(machine.cpu_bytes)}):"]
        lines += [f"  {human_bytes(n):>10}  {what}" for what, n in finetune]
    lines += ["", "notes:", *(f"  {note}" for note in NOTES)]
    return "\n".join(lines)


# ---- the command line ---------------------------------------------------------------------------


def _parse_scaled(text: str, suffixes: dict[str, int], expected: str) -> int:
    """A number with an optional one-letter scale from `suffixes`, at least 1."""
    t = text.strip().upper()
    suffix = t[-1] if t and t[-1] in suffixes and not t[-1].isdigit() else ""
    try:
        value = float(t[:len(t) - len(suffix)]) * suffixes[suffix]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return int(value)


def parse_count(text: str) -> int:
    """'70B' -> 70_000_000_000; '1.5B', '125M', '7e9', '16K'. Decimal units, as model sizes are."""
    return _parse_scaled(text, _COUNT_SUFFIXES, "a count of at least 1 such as 70B, 1.5B, 125M or 7e9")


MAX_PARAMS = 10**15  # far past any model; the plan's pieces grow with the count


def parse_params(text: str) -> int:
    """`parse_count`, at most MAX_PARAMS."""
    count = parse_count(text)
    if count > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"expected at most 1000T parameters, got {text!r}")
    return count


def parse_bytes(text: str) -> int:
    """'80G' -> 80 GiB; '512G', '3.6T', '1048576'. Binary units (a drive sold as 4 TB is 3.6T)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return _parse_scaled(t, _SIZE_SUFFIXES, "")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a size such as 80G, 512G or 4T, got {text!r}") from None


def _number(low: float, high: float | None = None, integer: bool = False, what: str = "a number"):
    def parse(text: str) -> float | int:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= low and (high is None or value < high)):
            bounds = f"at least {low:g}" + (f" and below {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `infinity estimate`."""
    parser.description = ("Bytes per rank on the device, in host memory and on NVMe for each offload choice "
                          "(ZeRO stage 3, bf16, Adam), which fit the machine, the NVMe bandwidth a step needs, "
                          "and the config block of the cheapest one that fits. Machine figures not given are read "
                          "from this machine.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="COUNT", type=parse_params, help="number of parameters: 70B, 1.5B, 125M, 7e9")
    what.add_argument("--model", metavar="PRESET_OR_DIR",
                      help="a preset (llama-tiny ... llama-70b) or a Hugging Face model directory with config.json "
                           "(Llama-style shapes)")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--gpus", metavar="N", type=_number(0, integer=True, what="a whole number of GPUs"),
                       help="GPUs on the node, one rank each; 0: CPU only (default: this machine's)")
    ranks.add_argument("--world-size", dest="gpus", metavar="N",
                       type=_number(1, integer=True, what="a whole number of ranks"),
                       help="the same as --gpus, for one or more ranks")
    parser.add_argument("--gpu-mem", metavar="SIZE", type=parse_bytes,
                        help="memory of each GPU, e.g. 80G (default: this machine's)")
    parser.add_argument("--cpu-mem", metavar="SIZE", type=parse_bytes,
                        help="host memory of the node, e.g. 512G (default: this machine's)")
    parser.add_argument("--nvme-free", metavar="SIZE", type=parse_bytes,
                        help="free space for the offload files, e.g. 4T (default: what --nvme-path has free)")
    parser.add_argument("--nvme-gbps", metavar="GBPS", type=_number(1e-3, what="GB/s"),
                        help="sustained NVMe bandwidth of the node (aio_bench_sweep measures it)")
    parser.add_argument("--nvme-path", metavar="DIR", default=tempfile.gettempdir(),
                        help="the offload directory (default: %(default)s)")
    parser.add_argument("--tokens-per-step", metavar="COUNT", type=parse_count,
                        help=f"tokens per optimizer step over all ranks (default {TOKENS_PER_RANK} per rank)")
    parser.add_argument("--seq-len", metavar="TOKENS", type=_number(1, integer=True, what="a sequence length"),
                        default=SEQ_LEN, help="with --model on a CPU-only machine: the sequences a step's tokens "
                                              "come in, for the activations (default %(default)s)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="with --model on a CPU-only machine: count the activations of `infinity finetune "
                             "--gradient-checkpointing` (layer inputs on NVMe, one layer recomputed)")
    parser.add_argument("--tflops", metavar="TFLOPS", type=_number(1e-6, what="TFLOP/s"),
                        help=f"achieved TFLOP/s of one device (default {DEFAULT_GPU_TFLOPS:g} for a GPU, measured "
                             "for a CPU)")
    parser.add_argument("--lora", metavar="RANK", type=_number(1, integer=True, what="a LoRA rank"),
                        help="train only LoRA adapters of this rank on q,k,v,o,gate,up,down (needs --model)")
    parser.add_argument("--frozen-fraction", metavar="F", type=_number(0, 1, what="a fraction"),
                        help="freeze this fraction of every unit's parameters")
    parser.add_argument("--largest-unit", metavar="COUNT", type=parse_params,
                        help="with --params: parameters of the largest unit (default params/32)")
    parser.add_argument("--moment-format", choices=("fp32", "bf16", "8bit"), default="fp32",
                        help="the optimizer's moments in the table (optimizer.params.moment_format; default fp32)")


def model_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSize:
    """The model the arguments describe; a bad combination is an argparse error naming the argument."""
    if args.lora and args.frozen_fraction is not None:
        parser.error("--frozen-fraction: not with --lora, which freezes the whole base model")
    fraction = args.frozen_fraction or 0.0
    if args.model is None:
        if args.lora:
            parser.error("--lora: needs --model (the adapters' size depends on the layer shapes)")
        if args.largest_unit is not None and args.largest_unit > args.params:
            parser.error(f"--largest-unit: {args.largest_unit} is more than --params {args.params}")
        return model_from_count(args.params, args.largest_unit, fraction)
    if args.largest_unit is not None:
        parser.error("--largest-unit: only with --params (--model knows its units)")
    try:
        name, cfg = load_architecture(args.model)
    except (OSError, ValueError) as e:
        parser.error(f"--model: {e}")
    return model_from_config(name, cfg, args.lora, fraction)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`infinity estimate`: prints the report."""
    model = model_from_args(args, parser)
    if args.gpus == 0 and args.gpu_mem is not None:
        parser.error("--gpu-mem: given with --gpus 0 (a CPU-only machine)")
    if args.nvme_free is None and not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path}: not a directory (or give --nvme-free)")
    machine = machine_from_args(args)
    tokens = args.tokens_per_step or TOKENS_PER_RANK * machine.world
    finetune = None
    if args.model is not None and machine.gpus == 0:  # the device is the host: the whole step is host memory
        finetune = finetune_host_peak(model, load_architecture(args.model)[1], machine.cpu_bytes, tokens, args.lora,
                                      args.seq_len, args.gradient_checkpointing)
    print(report(model, machine, tokens, finetune, args.moment_format, args.gradient_checkpointing))
    return 0
