"""Goodput under faults: with ``skip_failed_rollouts``, every rollout that did not fail reaches the output.

Faults come from the test kit's chaos wrappers (:mod:`skyrl_structured.testing.chaos`): one
:class:`ChaosPolicy` with ``stage="any"`` disturbs the engine (``generate``, ``finish_session``)
and the environment (``create``, ``init``, ``step``, ``close``). The per-call failure rate is set
so that the expected share of failed rollouts is 1%, 5% or 20% (a rollout makes 8 calls whose
failure kills it; ``close`` and ``finish_session`` failures are logged and counted, and the
trajectory is kept). The policy records every fault it injected, so the number of rollouts that
must fail is known exactly; every other rollout must appear in the output with exactly the tokens
it has in a fault-free run of the same batch.

Wall time is compared with the same batch through the same wrappers at a zero failure rate, in
the same process, runs alternating. A failed rollout stops early, so the faulty batch does less
work: the table gives the raw ratio and the ratio per engine call actually served.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

from skyrl_structured.testing.chaos import ChaosEngine, ChaosPolicy, register_chaos_env

from .harness import Context, median, run_loop, settle, spread, write_json
from .workload import BENCH_ENV, InstantEngine, ReplyPool, make_batch, make_generator, register_bench_env

TURNS = 3
FATAL_STAGES = ("create", "init", "generate", "step")
FATAL_CALLS_PER_ROLLOUT = 2 + 2 * TURNS
TIME_GOAL = 1.05


def _plan(ctx: Context) -> tuple[int, int, list[float]]:
    if ctx.quick:
        return 64, 1, [0.05, 0.20]
    return 1024, 7, [0.01, 0.05, 0.20]


def per_call_rate(rollout_rate: float) -> float:
    """The per-call failure probability that fails ``rollout_rate`` of rollouts on average."""
    return 1.0 - float((1.0 - rollout_rate) ** (1.0 / FATAL_CALLS_PER_ROLLOUT))


def _run_once(ctx: Context, pool: ReplyPool, *, n: int, backend: str, rate: float, seed: int) -> dict[str, Any]:
    policy = ChaosPolicy(failure_rate=rate, stage="any", seed=seed)
    env_id = register_chaos_env(BENCH_ENV, policy)
    engine = InstantEngine(pool)
    gen = make_generator(ctx.tokenizer, ChaosEngine(engine, policy), turns=TURNS, skip_failed_rollouts=True)
    batch = make_batch(n)
    batch["env_classes"] = [env_id] * n
    settle()

    async def main() -> tuple[float, float, Any]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = await gen.generate(batch, disable_tqdm=True)
        return time.perf_counter() - wall, time.process_time() - cpu, out

    elapsed, cpu, out = run_loop(main, backend=backend)
    fatal = sum(1 for e in policy.events if e.stage in FATAL_STAGES and e.kind == "failure")
    return {"elapsed": elapsed, "cpu": cpu, "output": out, "fatal": fatal, "served": engine.calls}


def _check_goodput(out: dict[str, Any], clean: dict[str, Any], fatal: int) -> dict[str, int]:
    failed = [i for i, reason in enumerate(out["stop_reasons"]) if reason == "rollout_error"]
    n = len(out["stop_reasons"])
    kept = 0
    for i in range(n):
        if out["stop_reasons"][i] == "rollout_error":
            continue
        same = all(
            out[key][i] == clean[key][i] for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards")
        )
        kept += same
    return {"expected_successes": n - fatal, "placeholders": len(failed), "successes_in_output": kept}


def run(ctx: Context) -> dict[str, Any]:
    register_bench_env()
    pool = ReplyPool.build(ctx.tokenizer)
    n, repeats, rates = _plan(ctx)
    # One WARNING line per failed rollout is part of the cost; send it to a buffer, not the terminal.
    sink = logging.StreamHandler(io.StringIO())
    package_logger = logging.getLogger("skyrl_structured")
    package_logger.addHandler(sink)
    previous_propagate = package_logger.propagate
    package_logger.propagate = False
    rows = []
    try:
        for backend in ctx.backends:
            for target in rates:
                clean_times, fault_times, clean_served, fault_served = [], [], [], []
                clean_cpu, fault_cpu = [], []
                checks = []
                realized = []
                for r in range(repeats):
                    seed = 1000 + r
                    order = ("clean", "faulty") if r % 2 == 0 else ("faulty", "clean")
                    results = {}
                    for which in order:
                        rate = 0.0 if which == "clean" else per_call_rate(target)
                        results[which] = _run_once(ctx, pool, n=n, backend=backend, rate=rate, seed=seed)
                    clean, faulty = results["clean"], results["faulty"]
                    clean_times.append(clean["elapsed"])
                    fault_times.append(faulty["elapsed"])
                    clean_cpu.append(clean["cpu"])
                    fault_cpu.append(faulty["cpu"])
                    clean_served.append(clean["served"])
                    fault_served.append(faulty["served"])
                    checks.append(_check_goodput(faulty["output"], clean["output"], faulty["fatal"]))
                    realized.append(faulty["fatal"] / n)
                    del results, clean, faulty
                expected = sum(c["expected_successes"] for c in checks)
                kept = sum(c["successes_in_output"] for c in checks)
                raw = median(fault_times) / median(clean_times)
                per_call = (median(fault_times) / median(fault_served)) / (median(clean_times) / median(clean_served))
                row = {
                    "backend": backend,
                    "n": n,
                    "target_failed_fraction": target,
                    "per_call_failure_rate": per_call_rate(target),
                    "realized_failed_fraction": median(realized),
                    "goodput": kept / expected,
                    "placeholders_match_faults": all(c["placeholders"] == n - c["expected_successes"] for c in checks),
                    "checks": checks,
                    "clean_s": spread(clean_times),
                    "faulty_s": spread(fault_times),
                    "wall_ratio": raw,
                    "wall_ratio_per_engine_call": per_call,
                    "cpu_ratio": median(fault_cpu) / median(clean_cpu),
                    "meets_goal": kept == expected and raw <= TIME_GOAL,
                }
                rows.append(row)
                ctx.log(
                    f"goodput {backend:7s} target {target:.0%} realized {row['realized_failed_fraction']:.1%} "
                    f"goodput {row['goodput']:.2%} wall ratio {raw:.3f} (per engine call {per_call:.3f}, "
                    f"CPU-time ratio {row['cpu_ratio']:.3f})"
                )
    finally:
        package_logger.removeHandler(sink)
        package_logger.propagate = previous_propagate
    payload = {
        "goal": f"goodput 100% and wall time within {TIME_GOAL - 1:.0%} of the fault-free batch",
        "turns": TURNS,
        "rows": rows,
    }
    write_json(ctx, "goodput", payload)
    return payload
