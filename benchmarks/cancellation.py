"""Cancellation latency: from cancelling ``generate()`` to it raising, with every environment closed.

N rollouts are started against an engine whose calls never return; once all N are waiting in
the engine, the clock starts and ``generate()`` is cancelled, by an anyio cancel scope (both
backends) and by ``task.cancel()`` on a plain asyncio task (what asyncio users write). The clock
stops when the cancellation has come out of ``generate()``. Every run then checks that
``generate()`` did not return, that all N environments were closed and all N sessions finished.
With ``max_env_workers=32`` (SkyRL's default), each environment's ``close`` runs in a worker
thread, which is most of the cost at large N.

For reference, the same is timed for N bare tasks asleep in one anyio task group with nothing to
clean up: the floor that any design with one task per rollout pays on this machine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio

from .harness import Context, run_loop, settle, spread, write_json
from .workload import COUNTERS, BlockingEngine, ReplyPool, make_batch, make_generator

TURNS = 3
GOAL_S = 0.050
GOAL_N = 4096
#: With SkyRL's 32 env worker threads every close is a thread hand-off: the goal there is at 1,024 in flight.
GOAL_N_THREADS = 1024


def _plan(ctx: Context) -> list[tuple[int, int]]:
    """(in-flight rollouts, repeats)."""
    if ctx.quick:
        return [(16, 2), (64, 2)]
    return [(16, 7), (256, 5), (1024, 5), (4096, 3)]


async def _floor_run(n: int) -> float:
    """The same cancellation with nothing to clean up: n bare tasks asleep in one task group."""
    waiting = 0
    all_in = anyio.Event()

    async def sleeper() -> None:
        nonlocal waiting
        waiting += 1
        if waiting == n:
            all_in.set()
        await anyio.sleep_forever()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(sleeper)
            await all_in.wait()
            cancelled_at = time.perf_counter()
            scope.cancel()
    return time.perf_counter() - cancelled_at


async def _cancel_scope_run(gen: Any, engine: BlockingEngine, batch: dict[str, Any]) -> tuple[float, float]:
    returned = False
    cancelled_at = cancelled_cpu = 0.0
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_when_all_in() -> None:
                nonlocal cancelled_at, cancelled_cpu
                assert engine.all_in is not None
                await engine.all_in.wait()
                cancelled_at, cancelled_cpu = time.perf_counter(), time.process_time()
                scope.cancel()

            tg.start_soon(cancel_when_all_in)
            await gen.generate(batch, disable_tqdm=True)
            returned = True
    finished, finished_cpu = time.perf_counter(), time.process_time()
    if returned or not scope.cancelled_caught:
        raise AssertionError("generate() returned instead of raising the cancellation")
    return finished - cancelled_at, finished_cpu - cancelled_cpu


async def _asyncio_task_run(gen: Any, engine: BlockingEngine, batch: dict[str, Any]) -> tuple[float, float]:
    task = asyncio.ensure_future(gen.generate(batch, disable_tqdm=True))
    assert engine.all_in is not None
    await engine.all_in.wait()
    cancelled_at, cancelled_cpu = time.perf_counter(), time.process_time()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return time.perf_counter() - cancelled_at, time.process_time() - cancelled_cpu
    raise AssertionError("generate() returned instead of raising CancelledError")


def _once(
    ctx: Context, pool: ReplyPool, *, n: int, backend: str, how: str, max_env_workers: int
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) from the cancellation to ``generate()`` raising it."""
    engine = BlockingEngine(pool, expected=n)
    gen = make_generator(ctx.tokenizer, engine, turns=TURNS, max_env_workers=max_env_workers)
    batch = make_batch(n)
    settle()
    COUNTERS.reset()

    async def main() -> tuple[float, float]:
        engine.all_in = anyio.Event()
        if how == "task.cancel":
            return await _asyncio_task_run(gen, engine, batch)
        return await _cancel_scope_run(gen, engine, batch)

    latency = run_loop(main, backend=backend)
    if not (COUNTERS.opened == COUNTERS.closed == n and COUNTERS.live == 0):
        raise AssertionError(f"{COUNTERS.opened} envs opened, {COUNTERS.closed} closed (expected {n})")
    if engine.finished != n:
        raise AssertionError(f"{engine.finished} sessions finished (expected {n})")
    return latency


def measure(
    ctx: Context, pool: ReplyPool, *, n: int, repeats: int, backend: str, how: str, max_env_workers: int
) -> dict[str, Any]:
    runs = [_once(ctx, pool, n=n, backend=backend, how=how, max_env_workers=max_env_workers) for _ in range(repeats)]
    row: dict[str, Any] = {
        "backend": backend,
        "how": how,
        "in_flight": n,
        "max_env_workers": max_env_workers,
        "latency_s": spread([wall for wall, _ in runs]),
        # Process CPU time over the same span (worker threads included): steadier than wall on a shared machine.
        "cpu_s": spread([cpu for _, cpu in runs]),
    }
    if n == (GOAL_N_THREADS if max_env_workers else GOAL_N):
        row["meets_goal"] = row["latency_s"]["median"] < GOAL_S
    return row


def run(ctx: Context) -> dict[str, Any]:
    pool = ReplyPool.build(ctx.tokenizer)
    plan = _plan(ctx)
    ways = [(b, "cancel scope") for b in ctx.backends]
    if "asyncio" in ctx.backends:
        ways.append(("asyncio", "task.cancel"))
    floor: list[dict[str, Any]] = []
    for backend in ctx.backends:
        for n, repeats in plan:
            latencies = [run_loop(_floor_run, n, backend=backend) for _ in range(repeats)]
            floor.append({"backend": backend, "in_flight": n, "latency_s": spread(latencies)})
            ctx.log(
                f"cancellation floor {backend:7s} {n:>5d} bare tasks: {floor[-1]['latency_s']['median'] * 1e3:.1f} ms"
            )
    rows = []
    for workers in (0, 32):
        for backend, how in ways:
            for n, repeats in plan:
                row = measure(ctx, pool, n=n, repeats=repeats, backend=backend, how=how, max_env_workers=workers)
                rows.append(row)
                ctx.log(
                    f"cancellation {backend:7s} {how:12s} workers={workers:<2d} in-flight={n:<5d} "
                    f"{row['latency_s']['median'] * 1e3:.1f} ms"
                )
    payload = {
        "goal": (
            f"under {GOAL_S * 1e3:.0f} ms at {GOAL_N} in-flight rollouts inline, at {GOAL_N_THREADS} with env threads"
        ),
        "rows": rows,
        "floor": floor,
    }
    write_json(ctx, "cancellation", payload)
    return payload
