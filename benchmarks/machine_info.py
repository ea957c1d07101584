"""The ``machine`` section every benchmark JSON carries (docs/design.md, "Benchmarks")."""

from __future__ import annotations

import os
import platform

import torch


def machine_info() -> dict:
    """Platform, CPU, torch build and threads, and the load average when the run ended (figures
    measured on a busy machine are only comparable as ratios)."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return info
