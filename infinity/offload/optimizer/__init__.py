"""The optimizer tier: fp32 masters, moments and gradient accumulators in host memory
(`memory.py`), on NVMe (`nvme.py`), or split between the two by a budget (`split.py`)."""
