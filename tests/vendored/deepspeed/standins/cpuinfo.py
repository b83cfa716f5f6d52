"""Stand-in for py-cpuinfo's `get_cpu_info()`, which DeepSpeed's test_cpu_adam.py imports to
read the CPU's vendor: the fields it reads, from /proc/cpuinfo (not a dependency of infinity)."""

from __future__ import annotations

import platform


def get_cpu_info() -> dict:
    info = {"arch": platform.machine().upper(), "vendor_id_raw": "", "flags": []}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "vendor_id" and not info["vendor_id_raw"]:
                    info["vendor_id_raw"] = value
                elif key == "flags" and not info["flags"]:
                    info["flags"] = value.split()
    except OSError:
        pass
    return info
