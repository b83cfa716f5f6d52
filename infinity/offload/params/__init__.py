"""The parameter tier: compute-dtype shards in device or host memory (`memory.py`) or on NVMe
(`nvme.py`)."""
