"""Concurrency with latency: wall time against the slowest rollout, and the price of bounding concurrency.

The engine answers each call after a seeded latency drawn from U(50 ms, 500 ms) and serves at
most ``capacity`` requests at once (an ``anyio.CapacityLimiter`` inside it). With ample capacity
and no bound on rollouts, a batch should take as long as its slowest rollout (the sum of that
rollout's call latencies), not the sum over rollouts. With ``max_concurrent_rollouts=L``, wall
time grows and the number of live environments is capped at L. Each run is compared with the
ideal schedule for the same latencies (a discrete-event simulation of FIFO slots with zero CPU
cost), so the table shows how close to the ideal the generator gets.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Any

from .harness import Context, run_loop, settle, write_json
from .workload import COUNTERS, LatencyEngine, ReplyPool, make_batch, make_generator

TURNS = 3


def _plan(ctx: Context) -> dict[str, Any]:
    if ctx.quick:
        # Same shape, latencies scaled down 50x so the smoke run takes well under a second.
        return {"n": 16, "low": 0.001, "high": 0.010, "limits": [None, 8, 4], "capacity": 1024, "tight_capacity": 4}
    return {
        "n": 128,
        "low": 0.050,
        "high": 0.500,
        "limits": [None, 64, 32, 16, 8],
        "capacity": 1024,
        "tight_capacity": 32,
    }


def simulate(latencies: list[list[float]], *, limit: int | None, capacity: int) -> float:
    """Makespan of rollouts (chains of calls) on ``capacity`` FIFO engine slots, ``limit`` rollouts at once."""
    n = len(latencies)
    limit = n if limit is None else limit
    queue: deque[tuple[int, int]] = deque((i, 0) for i in range(min(limit, n)))
    next_rollout = min(limit, n)
    running: list[tuple[float, int, int]] = []
    now = 0.0
    done = 0
    while done < n:
        while queue and len(running) < capacity:
            i, turn = queue.popleft()
            heapq.heappush(running, (now + latencies[i][turn], i, turn))
        now, i, turn = heapq.heappop(running)
        if turn + 1 < len(latencies[i]):
            queue.append((i, turn + 1))
        else:
            done += 1
            if next_rollout < n:
                queue.append((next_rollout, 0))
                next_rollout += 1
    return now


def _session_ids(batch: dict[str, Any]) -> list[str]:
    return [f"{t.instance_id}_{t.repetition_id}" for t in batch["trajectory_ids"]]


def measure(
    ctx: Context, pool: ReplyPool, plan: dict[str, Any], *, backend: str, limit: int | None, capacity: int
) -> dict[str, Any]:
    engine = LatencyEngine(pool, low=plan["low"], high=plan["high"], capacity=capacity, seed=1)
    gen = make_generator(ctx.tokenizer, engine, turns=TURNS, max_concurrent_rollouts=limit)
    batch = make_batch(plan["n"])
    latencies = [[engine.latency(s, t) for t in range(TURNS)] for s in _session_ids(batch)]
    per_rollout = [sum(x) for x in latencies]
    settle()
    COUNTERS.reset()

    async def main() -> float:
        started = time.perf_counter()
        await gen.generate(batch, disable_tqdm=True)
        return time.perf_counter() - started

    wall = run_loop(main, backend=backend)
    assert COUNTERS.opened == COUNTERS.closed == plan["n"], "every environment must be closed"
    ideal = simulate(latencies, limit=limit, capacity=capacity)
    return {
        "backend": backend,
        "n": plan["n"],
        "turns": TURNS,
        "max_concurrent_rollouts": limit,
        "engine_capacity": capacity,
        "wall_s": wall,
        "slowest_rollout_s": max(per_rollout),
        "sum_of_rollouts_s": sum(per_rollout),
        "ideal_s": ideal,
        "wall_over_ideal": wall / ideal,
        "peak_live_envs": COUNTERS.peak_live,
    }


def run(ctx: Context) -> dict[str, Any]:
    pool = ReplyPool.build(ctx.tokenizer)
    plan = _plan(ctx)
    rows = []
    for backend in ctx.backends:
        for limit in plan["limits"]:
            rows.append(measure(ctx, pool, plan, backend=backend, limit=limit, capacity=plan["capacity"]))
        rows.append(measure(ctx, pool, plan, backend=backend, limit=None, capacity=plan["tight_capacity"]))
        for row in rows[-len(plan["limits"]) - 1 :]:
            ctx.log(
                f"concurrency {backend:7s} limit={row['max_concurrent_rollouts']!s:5s} "
                f"capacity={row['engine_capacity']:<5d} wall {row['wall_s']:.2f}s ideal {row['ideal_s']:.2f}s "
                f"slowest {row['slowest_rollout_s']:.2f}s sum {row['sum_of_rollouts_s']:.0f}s "
                f"peak live envs {row['peak_live_envs']}"
            )
    payload = {
        "latency_s": [plan["low"], plan["high"]],
        "goal": "wall time tracks the slowest rollout (unbounded) / the ideal schedule (bounded), not the sum",
        "rows": rows,
    }
    write_json(ctx, "concurrency", payload)
    return payload
