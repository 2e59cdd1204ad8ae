"""The capture endpoint's cost: CPU per call, added latency and loop lag, against calling the engine directly.

    python -m benchmarks.agents                          # both parts, asyncio and trio, 256 and 1,024 agents
    python -m benchmarks.agents --quick                  # toy sizes (the smoke test)
    python -m benchmarks.agents --only cpu --backends trio --json out.json
    python -m benchmarks.agents --only latency --agents 1024 --contenders engine,direct,workers --workers 1,2

An agent here is a three-call chat loop: it sends the conversation, appends the reply and a user
observation, and sends it again. The contenders run the same agents, in rotation, each batch after
a garbage collection, in a fresh event loop with a fresh engine:

- ``engine``: the floor. Every call's prompt is rendered and tokenized before the timed region, and
  the batch makes the engine calls alone, so that ``cpu(contender) - cpu(engine)`` is what the
  trainer's process spends per call beyond the engine's own work;
- ``direct``: the agent renders the conversation with the chat template, tokenizes it and calls the
  ``InferenceClient`` itself (what an agent without an endpoint would have to do; no HTTP);
- ``httpx``: each rollout opens a capture session (:func:`serve_capture`, :meth:`CaptureServer.session`)
  and its agent POSTs raw JSON to the session's ``/chat/completions`` with its own
  ``httpx.AsyncClient`` (one keep-alive connection), as a light Python agent would;
- ``openai``: the same with the official ``openai.AsyncOpenAI`` client (one per agent, over the
  agent's ``httpx`` client, whose TLS context is the process's one);
- ``openai_shared``: one ``AsyncOpenAI`` base client for the whole batch over one HTTP client, and
  per rollout ``base.with_options(base_url=..., api_key=...)``, which reuses that HTTP client (its
  connection pool shared by every agent);
- ``openai_own``: one ``openai.AsyncOpenAI(base_url=..., api_key=...)`` per agent left to build its own
  HTTP client, so a TLS context per agent (about 30 ms of CPU each, on the loop): what docs/agents.md
  and the default agent did before issue 34, kept so that the cost stays visible;
- ``remote``: the ``httpx`` agents in a child process (:mod:`benchmarks._agent_process`, one event
  loop on the same backend), as agents run as commands are: this process then runs the endpoint and
  the engine alone, so its CPU is the endpoint's side of each exchange, and the latency is still
  what the agents observe (their own client's work included, on the machine's other core);
- ``workers`` (and ``workers_N`` for each further ``--workers`` count): the ``remote`` agents against
  ``serve_capture(..., workers=N)``, the endpoint's per-call work in N worker processes; only where
  ``serve_capture`` takes ``workers`` (otherwise one line says it is skipped). Each worker's CPU is
  read from ``/proc/<pid>/stat`` before and after the batch.

The timed region starts once the endpoint serves and ends once every session has closed, so a
pool's start is not charged to the calls (its time is kept as ``<kind>_start_s``). During it the
event loop's lag is sampled (the generator's ``LoopLag``: how late a 50 ms sleep wakes).

(a) ``cpu``: 1,024 rollouts x 3 calls, all at once, against an engine that answers at once. Process
    CPU time (``time.process_time``) of the whole batch; ``<kind>_cpu_added_ms_per_call`` is
    ``(median(kind) - median(direct)) / calls`` (the CPU the endpoint adds over an agent that renders
    itself) and ``<kind>_trainer_cpu_ms_per_call`` is ``(median(kind) - median(engine)) / calls``
    (what the trainer's process spends per call beyond the engine), and ``<kind>_trainer_loop_cpu_ms_per_call``
    the same for the event loop's thread alone (``time.thread_time``: the process less its other
    threads, such as the endpoint workers' frame readers and writers). For ``httpx``, ``openai*`` it
    includes both ends of the HTTP exchange (the agents' client runs in the same process); for
    ``remote`` and ``workers`` the server's end in this process alone. Goals: ``httpx`` and ``remote``
    at most 1.5 ms added per call (``meets_goal``, ``remote_meets_goal``); ``workers`` at most
    0.2 ms of the trainer loop's CPU per call (``workers_cpu_meets_goal``; the issue's measure).
(b) ``latency``: for each ``--agents`` count (256 and 1,024), that many agents at once x 3 calls
    against an engine that answers every request after 200 ms (no batch limit). Per call, the
    latency the agent observes minus 200 ms: p50, p90, p99 and max over every call of every repeat,
    and the loop's lag (max and mean). Goals: ``httpx`` / ``remote`` p50 at most 20 ms and p99 at
    most 100 ms (``meets_goal``, ``remote_meets_goal``); ``workers`` p50 at most 1.25x and p99 at most
    1.5x ``direct``'s in the same run (``workers_meets_goal``), and its loop lag no worse than
    ``direct``'s (``workers_lag_meets_goal``).

Every batch is checked: each rollout made its three calls, and on the endpoint each call after the
first extended its session's one branch (the ids reused, not re-rendered). The load average is
printed at the start of each part and stored in each row. Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from skyrl_structured.agents import CaptureServer, CaptureSession, serve_capture

from . import _agent_report as report
from ._agent_calls import (
    TURNS,
    Batch,
    agent,
    completions_call,
    first_messages,
    http_client,
    httpx_call,
    next_messages,
    openai_client,
    shared_base,
)
from ._agent_probes import Window, auto_workers, load_avg, workers_unsupported
from .harness import run_loop, settle
from .tokenizer import load_tokenizer
from .workload import InstantEngine, LatencyEngine, ReplyPool

LATENCY_S = 0.2
GOALS = report.GOALS
#: Every contender but ``workers`` (which runs only where ``serve_capture`` takes ``workers``).
CONTENDERS = ("engine", "direct", "httpx", "openai", "openai_shared", "openai_own", "remote")
#: The contenders whose agents go through the in-loop endpoint.
ENDPOINT_CONTENDERS = CONTENDERS[2:]
#: Where ``python -m benchmarks._agent_process`` runs (the repository root).
_ROOT = Path(__file__).resolve().parent.parent
#: The worker count of each ``workers`` contender of this run (set by :func:`main` from ``--workers``).
_WORKER_COUNTS: dict[str, int] = {}


#: One prompt's token ids per row and turn, rendered before the timed region (the ``engine`` floor).
Prompts = list[list[list[int]]]


def is_workers(kind: str) -> bool:
    return kind == "workers" or kind.startswith("workers_")


def is_endpoint(kind: str) -> bool:
    return kind in ENDPOINT_CONTENDERS or is_workers(kind)


class _TurnPool(ReplyPool):
    """Replies chosen by the turn alone, so that every contender gets the very same texts."""

    def pick(self, session_id: object, turn: int) -> int:
        return turn % len(self.texts)


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def engine_prompts(tokenizer: Any, pool: ReplyPool, rows: int) -> Prompts:
    """Every call's prompt ids, as the ``direct`` agent renders them (the replies are the turn's pool text)."""
    prompts: Prompts = []
    for row in range(rows):
        messages, calls = first_messages(row), []
        for turn in range(TURNS):
            calls.append(_render(tokenizer, messages))
            messages = next_messages(messages, pool.texts[turn % len(pool.texts)], row, turn)
        prompts.append(calls)
    return prompts


async def _engine_rollout(engine: Any, prompts: list[list[int]], row: int, batch: Batch) -> None:
    """The floor: the row's engine calls with their prompts ready, nothing else."""
    session = f"engine-{row}"
    try:
        for turn, ids in enumerate(prompts):
            started = time.perf_counter()
            out = await engine.generate({"prompt_token_ids": [ids], "sampling_params": {}, "session_ids": [session]})
            batch.latencies.append(time.perf_counter() - started)
            batch.calls += 1
            expected = engine.pool.texts[turn % len(engine.pool.texts)]
            if out["responses"][0] != expected:
                raise AssertionError(f"engine: row {row} turn {turn} got another reply than its prompt assumed")
    finally:
        await engine.finish_session(session)


async def _direct_rollout(engine: Any, tokenizer: Any, row: int, batch: Batch) -> None:
    session = f"direct-{row}"

    async def call(messages: list[dict[str, Any]]) -> str:
        ids = _render(tokenizer, messages)
        out = await engine.generate({"prompt_token_ids": [ids], "sampling_params": {}, "session_ids": [session]})
        batch.calls += 1
        return str(out["responses"][0])

    try:
        await agent(call, row, batch)
    finally:
        await engine.finish_session(session)


def _tally(batch: Batch, session: CaptureSession) -> None:
    """Add a finished session's captured calls, extended calls and branches to ``batch``."""
    calls, capture = getattr(session, "calls", None), getattr(session, "capture", None)
    if calls is None or capture is None:
        raise AssertionError(f"{type(session).__name__} has no `calls` or `capture`: the batch cannot be checked")
    batch.calls += len(calls)
    batch.extended += sum(1 for c in calls if c.extended)
    batch.branches += len(capture.branches)


async def _endpoint_rollout(server: CaptureServer, kind: str, row: int, batch: Batch, base: Any) -> None:
    async with server.session(f"r{row}") as session:
        if kind == "openai_own":
            async with openai_client(session.base_url, session.api_key, None) as client:
                await agent(completions_call(client), row, batch)
        elif kind == "openai_shared":
            # Not closed here: closing a copy closes the HTTP client it shares with every other rollout.
            client = base.with_options(base_url=session.base_url, api_key=session.api_key)
            await agent(completions_call(client), row, batch)
        else:
            async with http_client() as http:
                call = (
                    completions_call(openai_client(session.base_url, session.api_key, http))
                    if kind == "openai"
                    else httpx_call(http, session.base_url)
                )
                await agent(call, row, batch)
        _tally(batch, session)


async def _child_rollouts(server: CaptureServer, rows: int, batch: Batch, backend: str) -> None:
    """Every row's session open here, its agent in the child process (:mod:`benchmarks._agent_process`)."""
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(server.session(f"r{row}")) for row in range(rows)]
        done = await anyio.run_process(
            [sys.executable, "-m", "benchmarks._agent_process", backend],
            input=json.dumps([session.base_url for session in sessions]).encode(),
            cwd=_ROOT,
            stderr=subprocess.PIPE,
            check=False,
        )
        if done.returncode:
            tail = done.stderr.decode()[-2000:]
            raise RuntimeError(f"remote: the agents' process exited with {done.returncode}: {tail}")
        batch.latencies = json.loads(done.stdout)  # one per call the agents made (_check counts them)
    for session in sessions:
        _tally(batch, session)


async def _serve_batch(kind: str, engine: Any, tokenizer: Any, rows: int, backend: str, window: Window) -> Batch:
    """An endpoint contender's batch, timed from the endpoint serving to every session closed."""
    batch = Batch()
    options: dict[str, Any] = {"workers": _WORKER_COUNTS[kind]} if is_workers(kind) else {}
    started = time.perf_counter()
    async with serve_capture(engine, tokenizer, model="bench", **options) as server:
        batch.start_s = time.perf_counter() - started
        await window.open()
        if kind == "remote" or is_workers(kind):
            await _child_rollouts(server, rows, batch, backend)
        else:
            base = shared_base() if kind == "openai_shared" else None
            async with anyio.create_task_group() as group:
                for row in range(rows):
                    group.start_soon(_endpoint_rollout, server, kind, row, batch, base)
            if base is not None:
                await base.close()
        window.close()
    return batch


async def _run_batch(
    kind: str, engine: Any, tokenizer: Any, rows: int, backend: str, prompts: Prompts, window: Window
) -> Batch:
    if is_endpoint(kind):
        batch = await _serve_batch(kind, engine, tokenizer, rows, backend, window)
    else:
        batch = Batch()
        await window.open()
        async with anyio.create_task_group() as group:
            for row in range(rows):
                if kind == "engine":
                    group.start_soon(_engine_rollout, engine, prompts[row], row, batch)
                else:
                    group.start_soon(_direct_rollout, engine, tokenizer, row, batch)
        window.close()
    _check(kind, batch, rows, engine)
    return batch


def _check(kind: str, batch: Batch, rows: int, engine: Any) -> None:
    """Every rollout made its calls; on the endpoint, every call after a session's first extended its branch."""
    calls = rows * TURNS
    if batch.calls != calls or len(batch.latencies) != calls or engine.turns:
        raise AssertionError(f"{kind}: {batch.calls} calls recorded, {len(batch.latencies)} timed; expected {calls}")
    if is_endpoint(kind) and (batch.extended != rows * (TURNS - 1) or batch.branches != rows):
        raise AssertionError(f"{kind}: {batch.extended} calls extended a branch, {batch.branches} branches")


async def _measure(
    kind: str, engine: Any, tokenizer: Any, rows: int, backend: str, prompts: Prompts
) -> tuple[Window, Batch]:
    """One batch and its timed window (wall, CPU, loop lag, child processes' CPU)."""
    async with anyio.create_task_group() as group:
        window = Window(group)
        batch = await _run_batch(kind, engine, tokenizer, rows, backend, prompts, window)
    return window, batch


def _rotate(
    make_engine: Callable[[], Any], tokenizer: Any, rows: int, args: argparse.Namespace, backend: str
) -> dict[str, list[tuple[Window, Batch]]]:
    """Every contender ``args.repeats`` times in rotation, each batch in a fresh event loop with a fresh engine.

    One warm-up batch each comes first, not counted (imports, template compilation, lazy client set-up),
    except with ``--quick``. The ``engine`` floor's prompts are rendered once, before any batch.
    """
    kinds: list[str] = args.contenders
    results: dict[str, list[tuple[Window, Batch]]] = {kind: [] for kind in kinds}
    prompts = engine_prompts(tokenizer, make_engine().pool, rows) if "engine" in kinds else []

    def run(kind: str) -> tuple[Window, Batch]:
        settle()
        return run_loop(_measure, kind, make_engine(), tokenizer, rows, backend, prompts, backend=backend)

    for kind in kinds if not args.quick else ():
        run(kind)
    for r in range(args.repeats):
        for kind in [*kinds[r % len(kinds) :], *kinds[: r % len(kinds)]]:
            results[kind].append(run(kind))
    return results


def bench_cpu(tokenizer: Any, args: argparse.Namespace, backend: str) -> Iterator[dict[str, Any]]:
    rows = args.cpu_rollouts
    pool = _TurnPool.build(tokenizer)
    row: dict[str, Any] = {"backend": backend, "rollouts": rows, "calls": rows * TURNS, "repeats": args.repeats}
    row["workers_count"] = _WORKER_COUNTS.get("workers")
    row["load_avg"] = report.announce("cpu", backend, f"{rows} rollouts")
    row.update(report.cpu_row(_rotate(lambda: InstantEngine(pool), tokenizer, rows, args, backend), row))
    yield row


def bench_latency(tokenizer: Any, args: argparse.Namespace, backend: str) -> Iterator[dict[str, Any]]:
    """One row per ``--agents`` count, each yielded (and so printed) as soon as it is measured."""
    pool = _TurnPool.build(tokenizer)
    for agents in args.agents:
        row: dict[str, Any] = {"backend": backend, "agents": agents, "engine_latency_s": LATENCY_S}
        row["workers_count"] = _WORKER_COUNTS.get("workers")
        row["repeats"], row["load_avg"] = args.repeats, report.announce("latency", backend, f"{agents} agents")
        make = functools.partial(LatencyEngine, pool, low=LATENCY_S, high=LATENCY_S, capacity=agents)
        results = _rotate(make, tokenizer, agents, args, backend)
        row.update(report.latency_row(results, row, LATENCY_S))
        yield row


BENCHES: dict[str, Callable[[Any, argparse.Namespace, str], Iterator[dict[str, Any]]]] = {
    "cpu": bench_cpu,
    "latency": bench_latency,
}


def _counts(text: str, name: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} takes positive integers separated by commas, got {text!r}")
    return values


def _contenders(args: argparse.Namespace) -> list[str]:
    """The contenders of this run: ``--contenders`` (default all), ``workers`` only where it can run."""
    parts = [part.strip() for part in args.workers.split(",")]
    if not all(part == "auto" or (part.isdigit() and int(part) > 0) for part in parts):
        raise SystemExit(f"--workers takes auto or positive integers separated by commas, got {args.workers!r}")
    counts = [auto_workers() if part == "auto" else int(part) for part in parts]
    workers = ["workers" if i == 0 else f"workers_{n}" for i, n in enumerate(counts)]
    _WORKER_COUNTS.clear()
    _WORKER_COUNTS.update(zip(workers, counts, strict=True))
    wanted = [k.strip() for k in args.contenders.split(",") if k.strip()] if args.contenders else None
    kinds = [
        k for k in [*CONTENDERS, *workers] if wanted is None or k in wanted or (k in workers and "workers" in wanted)
    ]
    if unknown := sorted(set(wanted or ()) - {*CONTENDERS, *workers}):
        raise SystemExit(
            f"--contenders: unknown {', '.join(unknown)}; choose from {', '.join([*CONTENDERS, 'workers'])}"
        )
    if (why := workers_unsupported()) is not None and any(is_workers(k) for k in kinds):
        print(f"workers skipped: {why}", flush=True)
        kinds = [k for k in kinds if not is_workers(k)]
    return kinds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    parser.add_argument("--backends", default="asyncio,trio", help="comma-separated backends (default: both)")
    parser.add_argument("--cpu-rollouts", type=int, default=1024)
    parser.add_argument("--agents", default="256,1024", help="concurrent agents in the latency part, comma-separated")
    parser.add_argument(
        "--workers", default="auto", help="endpoint worker processes: auto or N, or N,M,... (one contender each)"
    )
    parser.add_argument("--contenders", default="", help="comma-separated subset of the contenders (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default="auto", help="qwen, tiny or auto (qwen when installed; the default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    args.agents = _counts(args.agents, "agents")
    if args.quick:
        args.cpu_rollouts, args.repeats = 16, 1
        args.agents = [min(n, 8 * (i + 1)) for i, n in enumerate(args.agents)]
    args.contenders = _contenders(args)
    # A batch of instant calls keeps the loop busy from start to end: its lag warning is expected here.
    logging.getLogger("skyrl_structured._runtime.loop_lag").setLevel(logging.ERROR)
    tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg": load_avg(), "quick": args.quick},
        "tokenizer": tokenizer_name,
        "turns": TURNS,
        "goals": GOALS,
        "contenders": args.contenders,
        "workers": dict(_WORKER_COUNTS),
    }
    for name in only:
        results[name] = []
        for backend in backends:
            for row in BENCHES[name](tokenizer, args, backend):
                results[name].append(row)
                report.show(name, row, args.contenders)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
