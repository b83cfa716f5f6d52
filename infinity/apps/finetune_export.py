"""`infinity finetune --export`: the trained model written in Hugging Face's layout, with the
LoRA updates merged into their weights."""

from __future__ import annotations


def export_model(engine, directory: str, lora: list[str], tokenizer) -> None:
    """The model's weights in Hugging Face's layout, with each LoRA update merged into its weight,
    and the run's tokenizer when it is a Hugging Face one (so the directory is a --model again)."""
    if not lora:
        engine.save_16bit_model(directory)  # config.json too
    else:
        _export_merged(engine, directory, set(lora))
        if engine.rank == 0:
            from infinity.checkpoint.export import write_model_config
            write_model_config(engine.module, directory)
    if engine.rank == 0 and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def _export_merged(engine, directory: str, lora: set[str]) -> None:
    """Each LoRALinear's `M.base_layer.weight` + B @ A * scale written as `M.weight`, tile by tile
    where the engine tiled it ([Note: tiles in an export] in infinity/checkpoint/export.py), one
    unit in memory at a time. The adapters are taken as their units pass; only those whose unit
    comes after one of their weight's (none in the engine's unit order: layers, then tiles) are
    read ahead."""
    from infinity.checkpoint.export import RowMerger, base_layer_names, untiled_entries
    from infinity.checkpoint.safetensors_io import ShardedWriter
    from infinity.zero.tiling import tiled_weights
    modules = dict(engine.module.named_modules())
    adapters = {f"{m}.lora_{x}" for m in lora for x in "AB"}
    bases = {f"{m}.base_layer.weight": m for m in lora}  # the merged weight's name -> its LoRA module
    entries, tile_of = untiled_entries([(s.name, u.dtype, list(s.shape)) for u in engine.units for s in u.slots
                                        if s.name not in adapters], tiled_weights(engine.module))
    out_name = base_layer_names([n for n, _, _ in entries], lora)
    entries = [(out_name.get(n, n), dtype, shape) for n, dtype, shape in entries]
    unit_of = {s.name: i for i, u in enumerate(engine.units) for s in u.slots}
    first_base: dict[str, int] = {}  # LoRA module -> the first unit holding its weight or a tile of it
    for name, i in unit_of.items():
        if (owner := bases.get(tile_of.get(name, name))) is not None:
            first_base[owner] = min(i, first_base.get(owner, i))
    ahead = {unit_of[a] for a in adapters if unit_of[a] > first_base.get(a.rsplit(".", 1)[0], unit_of[a])}
    factors = {}

    def take_adapters(u, full) -> None:
        factors.update({s.name: u.param_values(full, s).float() for s in u.slots if s.name in adapters})

    for i in sorted(ahead):
        take_adapters(engine.units[i], engine.full_compute_values(engine.units[i]))
    writer = ShardedWriter(directory, "model.safetensors", entries, 5 * 10 ** 9) if engine.rank == 0 else None
    merge = RowMerger()
    try:
        for i, u in enumerate(engine.units):
            if all(s.name in adapters for s in u.slots) and i in ahead:
                continue
            full = engine.full_compute_values(u)
            take_adapters(u, full)
            if writer is None:
                continue
            for s in u.slots:
                if s.name in adapters:
                    continue
                name, value = tile_of.get(s.name, s.name), u.param_values(full, s)
                owner = bases.get(name)
                if owner is not None:  # these rows of the weight, with theirs of B @ A
                    value = merge(name, value, factors[f"{owner}.lora_A"], factors[f"{owner}.lora_B"],
                                  modules[owner].scale).to(value.dtype)
                writer.add(out_name.get(name, name), value)
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()  # what was not published (nothing after close): a failed export leaves no temporaries
