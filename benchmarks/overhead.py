"""Overhead against the bare work: ``StructuredGymGenerator.generate`` vs. the same calls in a plain loop.

For each backend and N, the contenders run in rotation in this one process, each on a fresh batch
after a garbage collection, timed inside the event loop (loop start-up is not charged). The ratio
is median(generator) / median(bare) of wall time; the ratio of process CPU time is recorded too,
as it is less disturbed by other processes on a shared machine. The first repeat also checks that
all contenders produced the same tokens. ``max_env_workers=0`` (env calls inline, as the bare loop
makes them) is the headline; ``max_env_workers=32`` (SkyRL's default: every ``init``/``step``/
``close`` in a worker thread) is reported alongside, against the same inline bare loop, to show
what the threads cost.

When SkyRL is installed (the parity tests' oracle, ``skyrl==0.3.0``), its own ``SkyRLGymGenerator``
runs the same batches on asyncio in the same rotation, so the table also says what the generator
being replaced costs on the same work.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from .bare import BareWork, check_same_tokens
from .harness import Context, median, run_loop, settle, spread, write_json
from .workload import InstantEngine, ReplyPool, make_batch, make_generator, make_skyrl_generator

TURNS = 3
GOAL = 1.10


def _sizes(ctx: Context) -> list[tuple[int, int]]:
    """(N, repeats) pairs."""
    if ctx.quick:
        return [(16, 2), (64, 2)]
    return [(64, 21), (1024, 7), (16384, 3)]


def _thread_sizes(ctx: Context) -> list[tuple[int, int]]:
    if ctx.quick:
        return [(16, 1)]
    return [(64, 11), (1024, 5), (16384, 1)]


#: "repeating": observations drawn from a few texts (the memo's best case); "unique": none ever repeats.
WORKLOADS = ("repeating", "unique")
_nonces = iter(range(1, 1 << 62))


def _timed(work: Callable[[], Awaitable[Any]], backend: str) -> tuple[float, float, Any]:
    """(wall seconds, process CPU seconds, result) of ``await work()``, timed inside the event loop."""

    async def main() -> tuple[float, float, Any]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = await work()
        return time.perf_counter() - wall, time.process_time() - cpu, out

    return run_loop(main, backend=backend)


def run_generator(gen: Any, batch: dict[str, Any], backend: str) -> tuple[float, Any]:
    wall, _, out = _timed(partial(gen.generate, batch, disable_tqdm=True), backend)
    return wall, out


def run_bare(work: BareWork, batch: dict[str, Any], backend: str) -> tuple[float, Any]:
    wall, _, out = _timed(partial(work.run, batch), backend)
    return wall, out


def measure(
    ctx: Context,
    *,
    n: int,
    repeats: int,
    backend: str,
    max_env_workers: int,
    pool: ReplyPool,
    with_skyrl: bool = False,
    workload: str = "repeating",
) -> dict[str, Any]:
    engine = InstantEngine(pool)
    gen = make_generator(ctx.tokenizer, engine, turns=TURNS, max_env_workers=max_env_workers)
    work = BareWork(ctx.tokenizer, engine, turns=TURNS)
    runners: dict[str, Callable[[Any], tuple[float, float, Any]]] = {
        "generator": lambda b: _timed(partial(gen.generate, b, disable_tqdm=True), backend),
        "bare": lambda b: _timed(partial(work.run, b), backend),
    }
    skyrl = None
    if with_skyrl and backend == "asyncio":  # SkyRL's generator is asyncio-only
        skyrl = make_skyrl_generator(ctx.tokenizer, engine, turns=TURNS, max_env_workers=max_env_workers)
    if skyrl is not None:
        runners["skyrl"] = lambda b: _timed(partial(skyrl.generate, b, disable_tqdm=True), backend)
    times: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        # Rotate the order so that no contender always runs first (or right after a big collection).
        order = names[r % len(names) :] + names[: r % len(names)]
        outputs: dict[str, Any] = {}
        # Same texts for every contender of this repeat (tokens are compared), new ones each repeat.
        nonce = next(_nonces) if workload == "unique" else None
        for which in order:
            batch = make_batch(n, nonce=nonce)
            settle()
            wall, cpu_s, outputs[which] = runners[which](batch)
            times[which].append(wall)
            cpu[which].append(cpu_s)
            del batch
        if r == 0:
            for which in names:
                if which != "bare":
                    check_same_tokens(outputs[which], outputs["bare"])
        del outputs
    a, b = median(times["generator"]), median(times["bare"])
    row: dict[str, Any] = {
        "backend": backend,
        "workload": workload,
        "n": n,
        "turns": TURNS,
        "max_env_workers": max_env_workers,
        "generator_s": spread(times["generator"]),
        "bare_s": spread(times["bare"]),
        "ratio": a / b,
        "per_rollout_extra_us": (a - b) / n * 1e6,
        "generator_per_rollout_us": a / n * 1e6,
        "bare_per_rollout_us": b / n * 1e6,
        "meets_goal": a / b <= GOAL,
        # CPU time of the process: less disturbed by other processes on a shared machine than wall time.
        "generator_cpu_s": spread(cpu["generator"]),
        "bare_cpu_s": spread(cpu["bare"]),
        "cpu_ratio": median(cpu["generator"]) / median(cpu["bare"]),
    }
    if "skyrl" in times:
        s = median(times["skyrl"])
        row["skyrl_s"] = spread(times["skyrl"])
        row["skyrl_ratio"] = s / b
        row["generator_over_skyrl"] = a / s
        row["skyrl_cpu_ratio"] = median(cpu["skyrl"]) / median(cpu["bare"])
        # Process CPU time, all threads, measured in this one process: steadier than wall on a loaded machine.
        row["generator_over_skyrl_cpu"] = median(cpu["generator"]) / median(cpu["skyrl"])
    return row


def run(ctx: Context) -> dict[str, Any]:
    pool = ReplyPool.build(ctx.tokenizer)
    rows: list[dict[str, Any]] = []
    plan = [
        (variant, workload, sizes, workers)
        for variant, sizes, workers in (("inline", _sizes(ctx), 0), ("threads", _thread_sizes(ctx), 32))
        for workload in WORKLOADS
    ]
    for variant, workload, sizes, workers in plan:
        for backend in ctx.backends:
            for n, repeats in sizes:
                if workload == "unique" and n > 1024 and not ctx.quick:
                    continue  # the large point is about scale, measured on the repeating workload
                row = measure(
                    ctx,
                    n=n,
                    repeats=repeats,
                    backend=backend,
                    max_env_workers=workers,
                    pool=pool,
                    with_skyrl=True,
                    workload=workload,
                )
                row["variant"] = variant
                rows.append(row)
                skyrl = (
                    f", vs SkyRL's generator wall {row['generator_over_skyrl']:.3f} CPU "
                    f"{row['generator_over_skyrl_cpu']:.3f}"
                    if "skyrl_ratio" in row
                    else ""
                )
                ctx.log(
                    f"overhead {variant:7s} {workload:9s} {backend:7s} N={n:<6d} "
                    f"generator {row['generator_s']['median']:.3f}s "
                    f"bare {row['bare_s']['median']:.3f}s ratio {row['ratio']:.3f} "
                    f"(+{row['per_rollout_extra_us']:.0f} us/rollout), CPU-time ratio {row['cpu_ratio']:.3f}{skyrl}"
                )
    payload = {
        "goal": f"ratio generator/bare <= {GOAL} at every N (inline variant)",
        "turns": TURNS,
        "rows": rows,
    }
    write_json(ctx, "overhead", payload)
    return payload
