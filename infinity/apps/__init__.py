"""The applications built on the engine: the `infinity` command (`cli.py`); its fine-tuning job
(`finetune.py` trains, over `finetune_args.py`, `finetune_config.py` (the built-in config),
`finetune_model.py`, `finetune_export.py` and `data.py`); the tools (`tools/`: `infinity
estimate`, `aio_bench_sweep`); the launcher of `infinity run` (`launcher/`); and the models the
job and the benchmarks build (`models/`)."""
