"""How many cores this process may use: its CPU affinity, lowered by a cgroup's CPU quota."""

from __future__ import annotations

import math
import os

__all__ = ["auto_endpoint_workers", "usable_cores"]

#: The most capture endpoint workers ``auto`` starts: each holds a tokenizer and a template engine.
MAX_AUTO_WORKERS = 8
_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def _quota(path: str = _CPU_MAX) -> int | None:
    """The cgroup v2 CPU quota in whole cores (rounded up), or None where there is none."""
    try:
        with open(path, encoding="ascii") as limits:
            quota, period = limits.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """The cores this process may run on: ``sched_getaffinity``, lowered by a cgroup ``cpu.max`` quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def auto_endpoint_workers(cores: int) -> int:
    """``agent_endpoint_workers="auto"``: one worker per core beyond the trainer's, at most 8 (1 core: 0)."""
    return max(0, min(cores - 1, MAX_AUTO_WORKERS))
