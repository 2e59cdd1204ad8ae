"""The capture endpoint's cost: CPU per captured call, and the latency it adds, against calling the engine directly.

    python -m benchmarks.agents                          # both parts, asyncio and trio (15 minutes on 2 busy cores)
    python -m benchmarks.agents --quick                  # toy sizes (the smoke test)
    python -m benchmarks.agents --only cpu --backends trio --json out.json

An agent here is a three-call chat loop: it sends the conversation, appends the reply and a user
observation, and sends it again. Five contenders run the same agents, in rotation, each batch after
a garbage collection; the first four in one process and one event loop:

- ``direct``: the agent renders the conversation with the chat template, tokenizes it and calls the
  ``InferenceClient`` itself (what an agent without an endpoint would have to do; no HTTP);
- ``httpx``: each rollout opens a capture session (:func:`serve_capture`, :meth:`CaptureServer.session`)
  and its agent POSTs raw JSON to the session's ``/chat/completions`` with its own
  ``httpx.AsyncClient`` (one keep-alive connection), as a light Python agent would;
- ``openai``: the same with the official ``openai.AsyncOpenAI`` client (one per agent, over the
  agent's ``httpx`` client, whose TLS context is the process's one), as most agent frameworks send
  their requests;
- ``openai_own``: one ``openai.AsyncOpenAI(base_url=..., api_key=...)`` per agent left to build its own
  HTTP client, so a TLS context per agent (about 30 ms of CPU each, on the loop): what docs/agents.md
  and the default agent did before issue 34, kept so that the cost stays visible;
- ``remote``: the ``httpx`` agents in a child process (:mod:`benchmarks._agent_process`, one event
  loop on the same backend), as agents run as commands are: this process then runs the endpoint and
  the engine alone, so its CPU is the endpoint's side of each exchange, and the latency is still
  what the agents observe (their own client's work included, on the machine's other core).

(a) ``cpu``: 1,024 rollouts x 3 calls, all at once, against an engine that answers at once. Process
    CPU time (``time.process_time``) of a whole batch, timed inside the event loop; the figure is
    ``(median(endpoint) - median(direct)) / calls``: the CPU the endpoint adds per call. For
    ``httpx``, ``openai`` and ``openai_own`` it includes both ends of the HTTP exchange (the agents'
    client runs in the same process): the client's request building and response parsing (and its
    client's creation, once per rollout: with a TLS context of its own for ``openai_own``), the
    server's HTTP/1.1 parsing (h11) and JSON, the capture's render, prefix check and tail tokenization,
    the decode of the sampled ids, and the session's open and close, less what the direct agent
    spends rendering and tokenizing the whole conversation. For
    ``remote`` it is the server's end alone (a child's CPU is not this process's). Goal: at most
    1.5 ms per call (``meets_goal``: ``httpx``; ``remote_meets_goal``: ``remote``).
(b) ``latency``: 256 agents at once x 3 calls against an engine that answers every request after
    200 ms (no batch limit). Per call, the latency the agent observes (``perf_counter`` around its
    request) minus 200 ms: p50, p90, p99 and max over every call of every repeat. The ``direct``
    row is the floor (the event loop waking 256 sleepers). Goals: p50 at most 20 ms, p99 at most
    100 ms (``meets_goal``: ``httpx``; ``remote_meets_goal``: ``remote``).

Every batch is checked: each rollout made its three calls, and on the endpoint each call after the
first extended its session's one branch (the ids reused, not re-rendered). Not part of
``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai

from skyrl_structured.agents import CaptureServer, CaptureSession, serve_capture

from .harness import median, run_loop, settle
from .tokenizer import load_tokenizer
from .workload import InstantEngine, LatencyEngine, ReplyPool, question

TURNS = 3
LATENCY_S = 0.2
GOALS = {"cpu_added_ms_per_call": 1.5, "latency_added_p50_ms": 20.0, "latency_added_p99_ms": 100.0}
CONTENDERS = ("direct", "httpx", "openai", "openai_own", "remote")
#: Where ``python -m benchmarks._agent_process`` runs (the repository root).
_ROOT = Path(__file__).resolve().parent.parent
#: The contenders whose agents go through the endpoint.
ENDPOINT_CONTENDERS = CONTENDERS[1:]
_OBSERVATION = "Observation {turn} for rollout {row}: the tool returned {value}. Continue."


class _TurnPool(ReplyPool):
    """Replies chosen by the turn alone, so that every contender gets the very same texts."""

    def pick(self, session_id: Hashable, turn: int) -> int:
        return turn % len(self.texts)


class _Batch:
    """What one batch did: per-call latencies and, on the endpoint, each session's calls and branches."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.calls = 0
        self.extended = 0
        self.branches = 0


def _next_messages(messages: list[dict[str, Any]], reply: str, row: int, turn: int) -> list[dict[str, Any]]:
    observation = _OBSERVATION.format(turn=turn, row=row, value=row * 7 + turn)
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": observation}]


#: One chat call of an agent: (messages so far) -> the reply's text.
Call = Callable[[list[dict[str, Any]]], Awaitable[str]]


async def _agent(call: Call, row: int, batch: _Batch) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(row)}]
    for turn in range(TURNS):
        started = time.perf_counter()
        reply = await call(messages)
        batch.latencies.append(time.perf_counter() - started)
        messages = _next_messages(messages, reply, row, turn)


async def _direct_rollout(engine: Any, tokenizer: Any, row: int, batch: _Batch) -> None:
    session = f"direct-{row}"

    async def call(messages: list[dict[str, Any]]) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out = await engine.generate({"prompt_token_ids": [list(ids)], "sampling_params": {}, "session_ids": [session]})
        batch.calls += 1
        return str(out["responses"][0])

    try:
        await _agent(call, row, batch)
    finally:
        await engine.finish_session(session)


def _http_client() -> httpx.AsyncClient:
    """One agent's own HTTP client (one keep-alive connection), as separate agents have.

    Not one shared client: httpx's connection pool scans every connection and waiting request at
    each event, so one pool shared by 1,024 agents measures the pool.
    """
    return httpx.AsyncClient(verify=_tls(), trust_env=False, timeout=600.0)


def _httpx_call(http: httpx.AsyncClient, base_url: str) -> Call:
    """The light agent's chat call: raw JSON POSTed to the session's ``/chat/completions``."""
    url = f"{base_url}/chat/completions"

    async def call(messages: list[dict[str, Any]]) -> str:
        response = await http.post(url, json={"model": "bench", "messages": messages})
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])

    return call


def _tally(batch: _Batch, session: CaptureSession) -> None:
    """Add a finished session's captured calls, extended calls and branches to ``batch``."""
    batch.calls += len(session.calls)
    batch.extended += sum(1 for c in session.calls if c.extended)
    batch.branches += len(session.capture.branches)


def _completions_call(client: openai.AsyncOpenAI) -> Call:
    """The framework agent's chat call, through the official client."""

    async def call(messages: list[dict[str, Any]]) -> str:
        completion = await client.chat.completions.create(model="bench", messages=messages)  # type: ignore[arg-type]
        return completion.choices[0].message.content or ""

    return call


def _openai_client(session: CaptureSession, http: httpx.AsyncClient | None) -> openai.AsyncOpenAI:
    """The official client for one agent: over the agent's ``http`` (``openai``), or over one of its own
    (``openai_own``: None), which brings a TLS context of its own."""
    if http is None:
        return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    return openai.AsyncOpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        http_client=http,  # type: ignore[arg-type]  # openai >= 3 takes httpx2's or (legacy) httpx's
        max_retries=0,
    )


async def _endpoint_rollout(server: CaptureServer, kind: str, row: int, batch: _Batch) -> None:
    async with server.session(f"r{row}") as session:
        if kind == "openai_own":
            async with _openai_client(session, None) as client:
                await _agent(_completions_call(client), row, batch)
        else:
            async with _http_client() as http:
                call = (
                    _completions_call(_openai_client(session, http))
                    if kind == "openai"
                    else _httpx_call(http, session.base_url)
                )
                await _agent(call, row, batch)
        _tally(batch, session)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every agent's client (unused over plain HTTP; httpx would load one per client)."""
    return ssl.create_default_context()


async def _remote_rollouts(server: CaptureServer, rows: int, batch: _Batch, backend: str) -> None:
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


async def _run_batch(kind: str, engine: Any, tokenizer: Any, rows: int, backend: str) -> _Batch:
    batch = _Batch()
    if kind == "direct":
        async with anyio.create_task_group() as group:
            for row in range(rows):
                group.start_soon(_direct_rollout, engine, tokenizer, row, batch)
    elif kind == "remote":
        async with serve_capture(engine, tokenizer, model="bench") as server:
            await _remote_rollouts(server, rows, batch, backend)
    else:
        async with serve_capture(engine, tokenizer, model="bench") as server, anyio.create_task_group() as group:
            for row in range(rows):
                group.start_soon(_endpoint_rollout, server, kind, row, batch)
    _check(kind, batch, rows, engine)
    return batch


def _check(kind: str, batch: _Batch, rows: int, engine: Any) -> None:
    """Every rollout made its calls; on the endpoint, every call after a session's first extended its branch."""
    calls = rows * TURNS
    if batch.calls != calls or len(batch.latencies) != calls or engine.turns:
        raise AssertionError(f"{kind}: {batch.calls} calls recorded, {len(batch.latencies)} timed; expected {calls}")
    if kind != "direct" and (batch.extended != rows * (TURNS - 1) or batch.branches != rows):
        raise AssertionError(f"{kind}: {batch.extended} calls extended a branch, {batch.branches} branches")


async def _measure(kind: str, engine: Any, tokenizer: Any, rows: int, backend: str) -> tuple[float, float, _Batch]:
    """(wall s, process CPU s, batch) of one batch, timed inside the event loop."""
    wall, cpu = time.perf_counter(), time.process_time()
    batch = await _run_batch(kind, engine, tokenizer, rows, backend)
    return time.perf_counter() - wall, time.process_time() - cpu, batch


def _rotate(
    make_engine: Callable[[], Any], tokenizer: Any, rows: int, args: argparse.Namespace, backend: str
) -> dict[str, list[tuple[float, float, _Batch]]]:
    """Every contender ``args.repeats`` times in rotation, each batch in a fresh event loop with a fresh engine.

    One warm-up batch each comes first, not counted (imports, template compilation, lazy client set-up),
    except with ``--quick``.
    """
    results: dict[str, list[tuple[float, float, _Batch]]] = {kind: [] for kind in CONTENDERS}

    def run(kind: str) -> tuple[float, float, _Batch]:
        settle()
        return run_loop(_measure, kind, make_engine(), tokenizer, rows, backend, backend=backend)

    for kind in CONTENDERS if not args.quick else ():
        run(kind)
    for r in range(args.repeats):
        for kind in [*CONTENDERS[r % len(CONTENDERS) :], *CONTENDERS[: r % len(CONTENDERS)]]:
            results[kind].append(run(kind))
    return results


def bench_cpu(tokenizer: Any, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    rows = args.cpu_rollouts
    pool = _TurnPool.build(tokenizer)
    results = _rotate(lambda: InstantEngine(pool), tokenizer, rows, args, backend)
    calls = rows * TURNS
    row: dict[str, Any] = {"backend": backend, "rollouts": rows, "calls": calls, "repeats": args.repeats}
    for kind, runs in results.items():
        row[f"{kind}_cpu_s"] = median([cpu for _, cpu, _ in runs])
        row[f"{kind}_wall_s"] = median([wall for wall, _, _ in runs])
        row[f"{kind}_calls"] = [batch.calls for _, _, batch in runs]
    for kind in ENDPOINT_CONTENDERS:
        added = (row[f"{kind}_cpu_s"] - row["direct_cpu_s"]) / calls
        row[f"{kind}_cpu_added_ms_per_call"] = 1e3 * added
        row[f"{kind}_cpu_ratio"] = row[f"{kind}_cpu_s"] / row["direct_cpu_s"]
        row[f"{kind}_extended_calls"] = [batch.extended for _, _, batch in results[kind]]
        row[f"{kind}_branches"] = [batch.branches for _, _, batch in results[kind]]
    for key, kind in (("meets_goal", "httpx"), ("remote_meets_goal", "remote")):
        row[key] = row[f"{kind}_cpu_added_ms_per_call"] <= GOALS["cpu_added_ms_per_call"]
    return row


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": 1e3 * ordered[-1], "n": len(ordered)}


def bench_latency(tokenizer: Any, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    rows = args.agents
    pool = _TurnPool.build(tokenizer)
    results = _rotate(
        lambda: LatencyEngine(pool, low=LATENCY_S, high=LATENCY_S, capacity=rows), tokenizer, rows, args, backend
    )
    row: dict[str, Any] = {"backend": backend, "agents": rows, "engine_latency_s": LATENCY_S, "repeats": args.repeats}
    for kind, runs in results.items():
        added = [latency - LATENCY_S for _, _, batch in runs for latency in batch.latencies]
        row[f"{kind}_added"] = _percentiles(added)
        row[f"{kind}_calls"] = [batch.calls for _, _, batch in runs]
    for key, kind in (("meets_goal", "httpx"), ("remote_meets_goal", "remote")):
        added = row[f"{kind}_added"]
        row[key] = added["p50_ms"] <= GOALS["latency_added_p50_ms"] and added["p99_ms"] <= GOALS["latency_added_p99_ms"]
    return row


BENCHES = {"cpu": bench_cpu, "latency": bench_latency}


def _print(name: str, row: dict[str, Any]) -> None:
    if name == "cpu":
        print(
            f"cpu     {row['backend']:7s} {row['rollouts']} rollouts x {TURNS} calls: "
            f"direct {row['direct_cpu_s']:.3f} s CPU; "
            f"httpx +{row['httpx_cpu_added_ms_per_call']:.3f} ms/call (x{row['httpx_cpu_ratio']:.2f}); "
            f"openai +{row['openai_cpu_added_ms_per_call']:.3f} ms/call (x{row['openai_cpu_ratio']:.2f}); "
            f"openai_own +{row['openai_own_cpu_added_ms_per_call']:.3f} ms/call "
            f"(x{row['openai_own_cpu_ratio']:.2f}); "
            f"remote (server side) +{row['remote_cpu_added_ms_per_call']:.3f} ms/call (x{row['remote_cpu_ratio']:.2f})",
            flush=True,
        )
    else:
        parts = [
            f"{kind} p50 {row[f'{kind}_added']['p50_ms']:.1f} p99 {row[f'{kind}_added']['p99_ms']:.1f}"
            for kind in CONTENDERS
        ]
        print(f"latency {row['backend']:7s} {row['agents']} agents, ms added: " + "; ".join(parts), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    parser.add_argument("--backends", default="asyncio,trio", help="comma-separated backends (default: both)")
    parser.add_argument("--cpu-rollouts", type=int, default=1024)
    parser.add_argument("--agents", type=int, default=256, help="concurrent agents in the latency part")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default="auto", help="qwen, tiny or auto (qwen when installed; the default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    if args.quick:
        args.cpu_rollouts, args.agents, args.repeats = 16, 8, 1
    # A batch of instant calls keeps the loop busy from start to end: its lag warning is expected here.
    logging.getLogger("skyrl_structured._runtime.loop_lag").setLevel(logging.ERROR)
    tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "quick": args.quick},
        "tokenizer": tokenizer_name,
        "turns": TURNS,
        "goals": GOALS,
    }
    for name in only:
        results[name] = []
        for backend in backends:
            row = BENCHES[name](tokenizer, args, backend)
            results[name].append(row)
            _print(name, row)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
