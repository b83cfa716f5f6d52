"""The applications built on the engine: the `infinity` command (`cli.py`), its fine-tuning job
(`finetune.py`, `data.py`), the tools (`infinity estimate`, `aio_bench_sweep`), the launcher of
`infinity run`, and the models the job and the benchmarks build."""
