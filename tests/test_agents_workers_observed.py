"""Endpoint worker processes seen by observers: ``endpoint_workers_read``, the trace's tracks and instants,
Prometheus's gauges (real worker processes, a real tokenizer, real HTTP agents; asyncio and trio)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured._observers._trace_replay import ENDPOINT_PID
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator
from skyrl_structured.agents._readings import WorkerReading
from skyrl_structured.observe import EndpointWorker, PrometheusObserver, RolloutObserver, TraceRecorder
from skyrl_structured.testing import ScriptedEngine
from tests._agents import Held, batch, chat, port_of
from tests._pids import gone_within_bound
from tests.trace_check import spans_by_track

pytestmark = pytest.mark.anyio

ROWS = 4


class Heard(RolloutObserver):
    """Every reading heard, as plain tuples; :attr:`busy` is set by the first that shows ``busy_at`` open sessions."""

    def __init__(self, busy_at: int = ROWS) -> None:
        self.readings: list[list[tuple[int, int | None, int, bool, int, int, int]]] = []
        self.busy_at = busy_at
        self.busy = anyio.Event()

    def endpoint_workers_read(self, workers: Any) -> None:
        slots: list[EndpointWorker] = list(workers)
        self.readings.append([(w.index, w.pid, w.port, w.up, w.sessions, w.restarts, w.sessions_lost) for w in slots])
        if sum(w.sessions for w in slots) >= self.busy_at:
            self.busy.set()


class Broken(RolloutObserver):
    """An observer whose reading raises: logged and skipped, never the call's failure."""

    def __init__(self) -> None:
        self.calls = 0

    def endpoint_workers_read(self, workers: Any) -> None:
        self.calls += 1
        raise RuntimeError("a broken dashboard")


def one_chat_agent(ports: dict[str, int], keys: dict[str, tuple[str, str]] | None = None) -> Any:
    async def agent(ctx: AgentContext) -> float:
        ports[ctx.rollout] = port_of(ctx.base_url)
        if keys is not None:
            keys[ctx.rollout] = (ctx.base_url, ctx.api_key)
        reply = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0 if not isinstance(reply, Exception) else 0.5

    return agent


def endpoint_events(recorder: TraceRecorder, tmp_path: Path) -> list[dict[str, Any]]:
    """The written trace's events about the endpoint workers (read back from the file, as a user would)."""
    trace = json.loads(recorder.write(tmp_path / "trace.json").read_text(encoding="utf-8"))
    spans_by_track(trace)  # the whole trace well formed, the rollouts' spans nested
    return [e for e in trace["traceEvents"] if e.get("pid") == ENDPOINT_PID]


def gauge(observer: PrometheusObserver, name: str, worker: int) -> float | None:
    value: float | None = observer.registry.get_sample_value(f"skyrl_structured_{name}", {"worker": str(worker)})
    return value


async def test_the_trace_and_prometheus_show_each_workers_open_sessions(tokenizer, anyio_backend, tmp_path):
    hold = Held(tokenizer, ROWS)
    ports: dict[str, int] = {}
    heard, recorder, prometheus, broken = Heard(), TraceRecorder(), PrometheusObserver(), Broken()
    generator = StructuredAgentGenerator(
        ScriptedEngine(tokenizer, hold), tokenizer, one_chat_agent(ports), agent_endpoint_workers=2
    )
    generator.observers.extend([broken, recorder, heard, prometheus])
    result: dict[str, Any] = {}
    try:

        async def run() -> None:
            result["out"] = await generator.generate(batch(ROWS))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await hold.all_entered()
            with anyio.fail_after(60):  # a hang bound: the next reading (about a second away) sees them open
                await heard.busy.wait()
            during = {w: gauge(prometheus, "agent_endpoint_sessions", w) for w in (0, 1)}
            hold.release.set()
        assert generator._pool is not None
        worker_ports = [w.port for w in generator._pool.workers]
        worker_pids = [w.pid for w in generator._pool.workers]
    finally:
        await generator.aclose()
    assert result["out"]["stop_reasons"] == ["stop"] * ROWS
    assert broken.calls == 1  # skipped after it raised, for the rest of the call; the others heard on
    placed = [sum(1 for port in ports.values() if port == worker_ports[w]) for w in (0, 1)]
    assert placed == [2, 2]  # each new rollout on the worker with the fewest open sessions
    assert during == {0: 2.0, 1: 2.0}

    events = endpoint_events(recorder, tmp_path)
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"endpoint sessions"}
    assert {e["cat"] for e in counters} == {"agent_endpoint"}
    assert all(set(e["args"]) == {"worker 0", "worker 1"} for e in counters)
    assert counters[0]["args"] == {"worker 0": 0, "worker 1": 0}  # the call's first reading: nothing open yet
    assert counters[-1]["args"] == {"worker 0": 0, "worker 1": 0}  # its last: every session closed
    assert [max(e["args"][f"worker {w}"] for e in counters) for w in (0, 1)] == placed
    assert [e["ts"] for e in counters] == sorted(e["ts"] for e in counters)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"agent endpoint workers"}
    assert [e for e in events if e["ph"] == "i"] == []  # no death, no replacement

    assert len(heard.readings) == len(counters) >= 3
    for reading in heard.readings:
        assert [(i, pid, port, up, restarts, lost) for i, pid, port, up, _, restarts, lost in reading] == [
            (w, worker_pids[w], worker_ports[w], True, 0, 0) for w in (0, 1)
        ]
    for w in (0, 1):
        assert gauge(prometheus, "agent_endpoint_sessions", w) == 0
        assert gauge(prometheus, "agent_endpoint_worker_up", w) == 1
        assert gauge(prometheus, "agent_endpoint_worker_restarts", w) == 0


async def test_in_loop_endpoint_tells_no_worker_readings(tokenizer, anyio_backend, tmp_path):
    heard, recorder = Heard(), TraceRecorder()
    generator = StructuredAgentGenerator(
        ScriptedEngine.from_replies(tokenizer, "3"), tokenizer, one_chat_agent({}), agent_endpoint_workers=0
    )
    generator.observers.extend([recorder, heard])
    try:
        out = await generator.generate(batch(2))
    finally:
        await generator.aclose()
    assert out["stop_reasons"] == ["stop"] * 2
    assert heard.readings == []
    assert endpoint_events(recorder, tmp_path) == []


async def test_a_killed_worker_is_one_death_and_one_replacement_in_the_trace(tokenizer, anyio_backend, tmp_path):
    hold = Held(tokenizer, ROWS)
    ports: dict[str, int] = {}
    keys: dict[str, tuple[str, str]] = {}
    heard, recorder, prometheus = Heard(), TraceRecorder(), PrometheusObserver()
    generator = StructuredAgentGenerator(
        ScriptedEngine(tokenizer, hold),
        tokenizer,
        one_chat_agent(ports, keys),
        agent_endpoint_workers=2,
        skip_failed_rollouts=True,
        failure_budget_action="warn",
    )
    generator.observers.extend([recorder, heard, prometheus])
    try:
        async with generator.serving():
            pool = generator._pool
            assert pool is not None
            first_pids = pool.pids()
            result: dict[str, Any] = {}

            async def run() -> None:
                result["out"] = await generator.generate(batch(ROWS))

            async with anyio.create_task_group() as group:
                group.start_soon(run)
                await hold.all_entered()
                victim = pool.workers[port_of(keys["q0_0"][0]) != pool.workers[0].port]
                lost = {name for name, port in ports.items() if port == victim.port}
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)
                with anyio.fail_after(60):  # a hang bound: the death is seen and every lost session fails
                    while pool.sessions_lost < len(lost):  # noqa: ASYNC110 - a thread's count, no event
                        await anyio.sleep(0.01)
                hold.release.set()
            with anyio.fail_after(60):  # the replacement on the same port gets ready
                while pool.workers[victim.index].pid is None:  # noqa: ASYNC110 - a thread's flag, no event
                    await anyio.sleep(0.01)
            replacement = pool.workers[victim.index]
            again = await generator.generate(batch(ROWS))  # its first reading shows the replacement up
            assert again["stop_reasons"] == ["stop"] * ROWS
        every = set(first_pids) | set(pool.pids())
    finally:
        await generator.aclose()
    await gone_within_bound(sorted(every))
    out = result["out"]
    assert sorted(r for r in range(ROWS) if out["stop_reasons"][r] == "rollout_error") == sorted(
        int(name[1:].split("_")[0]) for name in lost
    )
    other = 1 - victim.index

    instants = [e for e in endpoint_events(recorder, tmp_path) if e["ph"] == "i"]
    assert all(e["cat"] == "agent_endpoint" and e["s"] == "p" for e in instants)
    died = [e for e in instants if e["name"] == "endpoint worker died"]
    replaced = [e for e in instants if e["name"] == "endpoint worker replaced"]
    assert len(instants) == 2
    assert [e["args"] for e in died] == [{"index": victim.index, "pid": victim.pid, "port": victim.port}]
    assert [e["args"] for e in replaced] == [
        {
            "index": victim.index,
            "pid": replacement.pid,
            "port": victim.port,
            "previous_pid": victim.pid,
            "restarts": 1,
        }
    ]
    assert replacement.pid != victim.pid
    assert died[0]["ts"] <= replaced[0]["ts"]

    last = {slot[0]: slot for slot in heard.readings[-1]}
    assert last[victim.index][1:] == (replacement.pid, victim.port, True, 0, 1, len(lost))
    assert last[other][3:] == (True, 0, 0, 0)
    assert gauge(prometheus, "agent_endpoint_worker_restarts", victim.index) == 1
    assert gauge(prometheus, "agent_endpoint_worker_restarts", other) == 0
    assert gauge(prometheus, "agent_endpoint_worker_up", victim.index) == 1
    assert gauge(prometheus, "agent_endpoint_sessions", victim.index) == 0


def reading(index: int, pid: int | None, up: bool, *, sessions: int = 0, restarts: int = 0, lost: int = 0) -> Any:
    return WorkerReading(index, pid, 9000 + index, up, sessions, restarts, lost)


def test_the_replay_tells_each_death_and_replacement_once():
    clock = iter(range(0, 10**9, 1000))
    recorder = TraceRecorder(clock=lambda: next(clock))
    for slots in (
        [reading(0, 11, True, sessions=2), reading(1, None, False)],  # slot 1 starting: not a death
        [reading(0, 11, True, sessions=3), reading(1, 21, True)],  # slot 1 up: not a replacement
        [reading(0, 11, False, restarts=1, lost=3), reading(1, 21, True)],  # slot 0 died
        [reading(0, None, False, restarts=1, lost=3), reading(1, 21, True)],  # its replacement starts
        [reading(0, None, False, restarts=2, lost=3), reading(1, 21, True)],  # which failed: still down, no new death
        [reading(0, 12, True, restarts=2, lost=3), reading(1, 21, True, sessions=1)],  # replaced
        # Slot 1 died and was replaced between two readings: both told, in that order.
        [reading(0, 12, True, restarts=2, lost=3), reading(1, 22, True, restarts=1, lost=1)],
    ):
        recorder.endpoint_workers_read(slots)
    events = recorder.events
    instants = [(e["name"], e["args"]) for e in events if e["ph"] == "i"]
    assert instants == [
        ("endpoint worker died", {"index": 0, "pid": 11, "port": 9000}),
        ("endpoint worker replaced", {"index": 0, "pid": 12, "port": 9000, "previous_pid": 11, "restarts": 2}),
        ("endpoint worker died", {"index": 1, "pid": 21, "port": 9001}),
        ("endpoint worker replaced", {"index": 1, "pid": 22, "port": 9001, "previous_pid": 21, "restarts": 1}),
    ]
    counters = [e for e in events if e["ph"] == "C"]
    assert [e["args"] for e in counters] == [
        {"worker 0": 2, "worker 1": 0},
        {"worker 0": 3, "worker 1": 0},
        {"worker 0": 0, "worker 1": 0},
        {"worker 0": 0, "worker 1": 0},
        {"worker 0": 0, "worker 1": 0},
        {"worker 0": 0, "worker 1": 1},
        {"worker 0": 0, "worker 1": 0},
    ]
    assert [e["ts"] for e in counters] == [0, 1, 2, 3, 4, 5, 6]
    assert {(e["pid"], e["cat"]) for e in counters} == {(ENDPOINT_PID, "agent_endpoint")}
