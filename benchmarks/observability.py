"""What seeing costs: the generator with nothing watching, with the event-loop lag monitor, with a ``TraceRecorder``.

``python -m benchmarks.observability [--n 1024] [--repeats 7] [--backend asyncio,trio]``

The overhead benchmark's unique workload (no observation text ever repeats, so the chat-template
memo never helps), inline env calls, three turns, the instant engine: the generator's own work is
all there is to measure. Three contenders run in rotation in this one process, each on a fresh
batch after a garbage collection, timed inside the event loop:

- ``plain``: ``event_loop_lag_interval_s=0`` and no observer beyond the (disabled) progress bar;
- ``lag``: the default, the lag monitor sampling every 0.05 s;
- ``traced``: the default plus a fresh :class:`~skyrl_structured.observe.TraceRecorder` per batch.

Ratios are median against median of ``plain``, wall time and process CPU time (the latter less
disturbed by other processes on a shared machine). Goals: ``lag`` ≤ 1.01, ``traced`` ≤ 1.05.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from skyrl_structured.observe import TraceRecorder

from .harness import median, settle
from .overhead import TURNS, _timed
from .tokenizer import load_tokenizer
from .workload import InstantEngine, ReplyPool, make_batch, make_generator

GOALS = {"lag": 1.01, "traced": 1.05}
_nonces = iter(range(1 << 40, 1 << 62))


def measure(tokenizer: Any, *, n: int, repeats: int, backend: str, workers: int = 0) -> dict[str, Any]:
    """One row: the three contenders' medians and their ratios to ``plain``."""
    engine = InstantEngine(ReplyPool.build(tokenizer))
    plain = make_generator(tokenizer, engine, turns=TURNS, max_env_workers=workers)
    plain.event_loop_lag_interval_s = 0
    lagged = make_generator(tokenizer, engine, turns=TURNS, max_env_workers=workers)
    traced = make_generator(tokenizer, engine, turns=TURNS, max_env_workers=workers)

    def run_traced(batch: Any) -> tuple[float, float, Any]:
        traced.observers[:] = [TraceRecorder()]
        return _timed(partial(traced.generate, batch, disable_tqdm=True), backend)

    runners: dict[str, Callable[[Any], tuple[float, float, Any]]] = {
        "plain": lambda b: _timed(partial(plain.generate, b, disable_tqdm=True), backend),
        "lag": lambda b: _timed(partial(lagged.generate, b, disable_tqdm=True), backend),
        "traced": run_traced,
    }
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        nonce = next(_nonces)
        for which in order:
            batch = make_batch(n, nonce=nonce)
            settle()
            seconds, cpu_s, _ = runners[which](batch)
            wall[which].append(seconds)
            cpu[which].append(cpu_s)
            del batch
    row: dict[str, Any] = {"backend": backend, "n": n, "turns": TURNS, "repeats": repeats, "max_env_workers": workers}
    for name in names:
        row[f"{name}_s"] = median(wall[name])
        row[f"{name}_cpu_s"] = median(cpu[name])
    for name, goal in GOALS.items():
        row[f"{name}_ratio"] = median(wall[name]) / median(wall["plain"])
        row[f"{name}_cpu_ratio"] = median(cpu[name]) / median(cpu["plain"])
        row[f"{name}_meets_goal"] = row[f"{name}_cpu_ratio"] <= goal or row[f"{name}_ratio"] <= goal
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.observability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="rollouts per batch (default: 1024)")
    parser.add_argument("--repeats", type=int, default=7, help="batches per contender (default: 7)")
    parser.add_argument("--backend", default="asyncio,trio", help="comma-separated backends (default: both)")
    parser.add_argument("--tokenizer", default="auto", help="qwen, tiny or auto (qwen when installed; the default)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--workers", type=int, default=0, help="max_env_workers (default: 0, inline)")
    args = parser.parse_args(argv)
    # The inline workload keeps the loop busy from start to end: its lag warning is expected here.
    logging.getLogger("skyrl_structured._runtime.loop_lag").setLevel(logging.ERROR)
    tokenizer, _ = load_tokenizer(args.tokenizer)
    rows = []
    for backend in args.backend.split(","):
        started = time.perf_counter()
        row = measure(tokenizer, n=args.n, repeats=args.repeats, backend=backend, workers=args.workers)
        rows.append(row)
        print(
            f"{backend:7s} N={args.n} workers={args.workers}: plain {row['plain_s']:.3f}s; "
            f"lag monitor x{row['lag_ratio']:.3f} wall, "
            f"x{row['lag_cpu_ratio']:.3f} CPU; TraceRecorder x{row['traced_ratio']:.3f} wall, "
            f"x{row['traced_cpu_ratio']:.3f} CPU ({time.perf_counter() - started:.0f}s)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"goals": GOALS, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
