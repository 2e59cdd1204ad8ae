"""Scale: wall time and peak memory of one ``generate()`` against N, per rollout.

Time: median of repeated untraced runs per backend, with the garbage collector's pauses during
those runs (``gc.callbacks``), which explain most of the growth at large N. Memory, in a separate
run (tracing slows Python down): the ``tracemalloc`` peak during ``generate()`` above what was
allocated before it started (the batch itself is built first and not counted), and the memory
still held by the returned output. The bare loop's peak is measured the same way (on asyncio) for
reference. RSS is not reported: in a process that has already run larger batches, the allocator
keeps freed memory, so RSS deltas say more about history than about the call.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from functools import partial
from typing import Any

from .bare import BareWork
from .harness import Context, median, settle, spread, write_json
from .overhead import TURNS, run_bare, run_generator
from .workload import InstantEngine, ReplyPool, make_batch, make_generator

FLATNESS_GOAL = 0.20


def _sizes(ctx: Context) -> list[tuple[int, int]]:
    if ctx.quick:
        return [(16, 1), (64, 1)]
    return [(64, 15), (256, 7), (1024, 5), (4096, 3), (16384, 1)]


def _traced(fn: Any, batch: dict[str, Any]) -> dict[str, int]:
    settle()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        _, output = fn(batch)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del output
    return {"peak_bytes": peak - before, "retained_bytes": after - before}


class _GCPauses:
    """Total time the garbage collector ran, and how many full (generation 2) collections."""

    def __init__(self) -> None:
        self.total = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._started
            self.full += info["generation"] == 2

    def __enter__(self) -> _GCPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _flatness(values: list[float]) -> float:
    """(max - min) / min over the per-rollout figures."""
    return (max(values) - min(values)) / min(values)


def run(ctx: Context) -> dict[str, Any]:
    pool = ReplyPool.build(ctx.tokenizer)
    rows: list[dict[str, Any]] = []
    bare_peaks: dict[int, float] = {}
    for backend in ctx.backends:
        engine = InstantEngine(pool)
        gen = make_generator(ctx.tokenizer, engine, turns=TURNS)
        work = BareWork(ctx.tokenizer, engine, turns=TURNS)
        for n, repeats in _sizes(ctx):
            times, gc_times, gc_full = [], [], []
            for _ in range(repeats):
                batch = make_batch(n)
                settle()
                with _GCPauses() as pauses:
                    elapsed, output = run_generator(gen, batch, backend)
                del output, batch
                times.append(elapsed)
                gc_times.append(pauses.total)
                gc_full.append(pauses.full)
            mem = _traced(partial(run_generator, gen, backend=backend), make_batch(n))
            row: dict[str, Any] = {
                "backend": backend,
                "n": n,
                "turns": TURNS,
                "wall_s": spread(times),
                "per_rollout_us": median(times) / n * 1e6,
                "gc_pause_s": median(gc_times),
                "gc_full_collections": median(gc_full),
                "peak_traced_bytes": mem["peak_bytes"],
                "retained_output_bytes": mem["retained_bytes"],
                "peak_traced_per_rollout_bytes": mem["peak_bytes"] / n,
            }
            if backend == ctx.backends[0]:
                bare_mem = _traced(partial(run_bare, work, backend=backend), make_batch(n))
                bare_peaks[n] = bare_mem["peak_bytes"] / n
            row["bare_peak_traced_per_rollout_bytes"] = bare_peaks[n]
            rows.append(row)
            ctx.log(
                f"scale {backend:7s} N={n:<6d} {row['wall_s']['median']:.3f}s "
                f"{row['per_rollout_us']:.0f} us/rollout (GC {row['gc_pause_s'] * 1e3:.0f} ms, "
                f"{row['gc_full_collections']:.0f} full), peak {row['peak_traced_per_rollout_bytes'] / 1024:.1f} "
                f"KiB/rollout (bare {row['bare_peak_traced_per_rollout_bytes'] / 1024:.1f})"
            )
    summary = {}
    for backend in ctx.backends:
        mine = [r for r in rows if r["backend"] == backend]
        summary[backend] = {
            "time_per_rollout_spread": _flatness([r["per_rollout_us"] for r in mine]),
            "memory_per_rollout_spread": _flatness([r["peak_traced_per_rollout_bytes"] for r in mine]),
        }
        summary[backend]["meets_goal"] = all(v <= FLATNESS_GOAL for v in summary[backend].values())
    payload = {
        "goal": f"per-rollout time and peak memory flat within {FLATNESS_GOAL:.0%} across N",
        "rows": rows,
        "summary": summary,
    }
    write_json(ctx, "scale", payload)
    return payload
