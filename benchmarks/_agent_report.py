"""The figures :mod:`benchmarks.agents` derives from its batches, its goals, and the lines it prints."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ._agent_calls import TURNS, Batch
from ._agent_probes import Window, load_avg

GOALS = {
    "cpu_added_ms_per_call": 1.5,
    "latency_added_p50_ms": 20.0,
    "latency_added_p99_ms": 100.0,
    # Issue 46: the endpoint's per-call work in worker processes.
    "workers_trainer_cpu_ms_per_call": 0.2,
    "workers_p50_ratio_to_direct": 1.25,
    "workers_p99_ratio_to_direct": 1.5,
}
Runs = dict[str, list[tuple[Window, Batch]]]


def announce(part: str, backend: str, size: str) -> list[float]:
    """Print the load average as a part starts, and return it (stored in the part's row)."""
    load = load_avg()
    print(f"load    {backend:7s} {part} {size}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    return load


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _is_workers(kind: str) -> bool:
    return kind == "workers" or kind.startswith("workers_")


def _common(results: Runs, calls: int) -> dict[str, Any]:
    """Per contender: CPU, wall, calls, loop lag, child CPU; per endpoint contender its checks' counts."""
    row: dict[str, Any] = {}
    for kind, runs in results.items():
        row[f"{kind}_cpu_s"] = _median([w.cpu for w, _ in runs])
        row[f"{kind}_wall_s"] = _median([w.wall for w, _ in runs])
        row[f"{kind}_calls"] = [batch.calls for _, batch in runs]
        row[f"{kind}_lag_max_ms"] = 1e3 * max(w.lag.max for w, _ in runs)
        row[f"{kind}_lag_mean_ms"] = 1e3 * _median([w.lag.mean for w, _ in runs])
        if kind not in ("engine", "direct"):
            row[f"{kind}_extended_calls"] = [batch.extended for _, batch in runs]
            row[f"{kind}_branches"] = [batch.branches for _, batch in runs]
        row[f"{kind}_loop_cpu_s"] = _median([w.loop_cpu for w, _ in runs])
        if "engine" in results:
            row[f"{kind}_trainer_cpu_ms_per_call"] = 1e3 * (row[f"{kind}_cpu_s"] - row["engine_cpu_s"]) / calls
            loop = row[f"{kind}_loop_cpu_s"] - row["engine_loop_cpu_s"]
            row[f"{kind}_trainer_loop_cpu_ms_per_call"] = 1e3 * loop / calls
        if _is_workers(kind):
            row[f"{kind}_start_s"] = [batch.start_s for _, batch in runs]
            row[f"{kind}_proc_cpu_s"] = [dict(sorted(w.children.items())) for w, _ in runs]
            worker_cpu = [sum(w.children.values()) for w, _ in runs]
            row[f"{kind}_worker_cpu_ms_per_call"] = 1e3 * _median(worker_cpu) / calls
    return row


def cpu_row(results: Runs, head: dict[str, Any]) -> dict[str, Any]:
    calls = head["calls"]
    row = _common(results, calls)
    if "direct" in results:
        for kind in results:
            if kind not in ("engine", "direct"):
                row[f"{kind}_cpu_added_ms_per_call"] = 1e3 * (row[f"{kind}_cpu_s"] - row["direct_cpu_s"]) / calls
                row[f"{kind}_cpu_ratio"] = row[f"{kind}_cpu_s"] / row["direct_cpu_s"]
        for key, kind in (("meets_goal", "httpx"), ("remote_meets_goal", "remote")):
            if kind in results:
                row[key] = row[f"{kind}_cpu_added_ms_per_call"] <= GOALS["cpu_added_ms_per_call"]
    if "workers" in results and "engine" in results:
        # The goal is the trainer loop's CPU; the whole process's (its frame threads too) is kept beside it.
        loop = row["workers_trainer_loop_cpu_ms_per_call"]
        row["workers_cpu_meets_goal"] = loop <= GOALS["workers_trainer_cpu_ms_per_call"]
    return row


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": 1e3 * ordered[-1], "n": len(ordered)}


def latency_row(results: Runs, head: dict[str, Any], latency_s: float) -> dict[str, Any]:
    row = _common(results, head["agents"] * TURNS)
    for kind, runs in results.items():
        row[f"{kind}_added"] = percentiles([latency - latency_s for _, batch in runs for latency in batch.latencies])
    for key, kind in (("meets_goal", "httpx"), ("remote_meets_goal", "remote")):
        if kind in results:
            added = row[f"{kind}_added"]
            p50, p99 = added["p50_ms"], added["p99_ms"]
            row[key] = p50 <= GOALS["latency_added_p50_ms"] and p99 <= GOALS["latency_added_p99_ms"]
    if "workers" in results and "direct" in results:
        row.update(_workers_goals(row, head["agents"], head["workers_count"]))
    return row


def _workers_goals(row: dict[str, Any], agents: int, n: int) -> dict[str, Any]:
    """``workers`` against ``direct`` in the same run, and the per-worker scaling model (design46.md, section 5)."""
    workers, direct = row["workers_added"], row["direct_added"]
    # A floor of 1 ms keeps a ratio finite where direct's added latency is about 0 (a toy run).
    p50 = workers["p50_ms"] / max(direct["p50_ms"], 1.0)
    p99 = workers["p99_ms"] / max(direct["p99_ms"], 1.0)
    out: dict[str, Any] = {
        "workers_p50_ratio": p50,
        "workers_p99_ratio": p99,
        "workers_meets_goal": p50 <= GOALS["workers_p50_ratio_to_direct"]
        and p99 <= GOALS["workers_p99_ratio_to_direct"],
        "workers_lag_meets_goal": row["workers_lag_max_ms"] <= row["direct_lag_max_ms"],
    }
    c_w = row["workers_worker_cpu_ms_per_call"]
    c_t = row.get("workers_trainer_cpu_ms_per_call")
    if c_t is not None:
        out["model_workers_p99_ms"] = agents * c_w / n + agents * c_t
        room = GOALS["workers_p99_ratio_to_direct"] * direct["p99_ms"] - agents * c_t
        out["model_workers_needed"] = math.ceil(agents * c_w / room) if room > 0 else None
        out["worker_capacity_calls_per_s"] = 1e3 / c_w if c_w > 0 else None
    return out


def _cpu_line(row: dict[str, Any], kinds: list[str]) -> str:
    parts = [f"engine {row['engine_cpu_s']:.3f} s" if "engine" in kinds else ""]
    parts += [f"direct {row['direct_cpu_s']:.3f} s" if "direct" in kinds else ""]
    for kind in kinds:
        if kind in ("engine", "direct"):
            continue
        text = f"{kind}"
        if f"{kind}_cpu_added_ms_per_call" in row:
            text += f" +{row[f'{kind}_cpu_added_ms_per_call']:.3f} ms/call (x{row[f'{kind}_cpu_ratio']:.2f})"
        if f"{kind}_trainer_cpu_ms_per_call" in row:
            text += f" trainer {row[f'{kind}_trainer_cpu_ms_per_call']:.3f} ms/call"
            text += f" (its loop {row[f'{kind}_trainer_loop_cpu_ms_per_call']:.3f})"
        if f"{kind}_worker_cpu_ms_per_call" in row:
            text += f" workers {row[f'{kind}_worker_cpu_ms_per_call']:.3f} ms/call"
        parts.append(text)
    return "; ".join(part for part in parts if part)


def show(name: str, row: dict[str, Any], kinds: list[str]) -> None:
    """Print a row: its figures, its loop lag, and the ``workers`` goals where they ran."""
    backend = row["backend"]
    if name == "cpu":
        print(
            f"cpu     {backend:7s} {row['rollouts']} rollouts x {TURNS} calls, CPU: {_cpu_line(row, kinds)}", flush=True
        )
    else:
        added = [f"{k} p50 {row[f'{k}_added']['p50_ms']:.1f} p99 {row[f'{k}_added']['p99_ms']:.1f}" for k in kinds]
        print(f"latency {backend:7s} {row['agents']} agents, ms added: " + "; ".join(added), flush=True)
    lag = [f"{k} {row[f'{k}_lag_max_ms']:.0f}/{row[f'{k}_lag_mean_ms']:.1f}" for k in kinds if k != "engine"]
    size = f"{row['rollouts']} rollouts" if name == "cpu" else f"{row['agents']} agents"
    print(f"lag     {backend:7s} {name} {size}, loop lag max/mean ms: " + "; ".join(lag), flush=True)
    if "workers_meets_goal" in row:
        print(
            f"goals   {backend:7s} {row['agents']} agents: workers p50 x{row['workers_p50_ratio']:.2f} "
            f"p99 x{row['workers_p99_ratio']:.2f} of direct's (goal x1.25 / x1.5): {row['workers_meets_goal']}; "
            f"loop lag <= direct's: {row['workers_lag_meets_goal']}; "
            f"model p99 {row.get('model_workers_p99_ms', 0):.0f} ms, workers needed {row.get('model_workers_needed')}",
            flush=True,
        )
    if "workers_cpu_meets_goal" in row:
        print(
            f"goals   {backend:7s} cpu: workers trainer loop {row['workers_trainer_loop_cpu_ms_per_call']:.3f} ms/call "
            f"(goal 0.2): {row['workers_cpu_meets_goal']}; the trainer's whole process "
            f"{row['workers_trainer_cpu_ms_per_call']:.3f} ms/call",
            flush=True,
        )
