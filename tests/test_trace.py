"""``TraceRecorder``: every rollout is one track of nested, ended spans; retries, failures and cancellations show."""

from __future__ import annotations

import json
from collections import Counter

import anyio
import pytest

from skyrl_structured.observe import TraceRecorder
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, straggler_generator
from .trace_check import children, spans_by_track

pytestmark = pytest.mark.anyio


def _flaky_engine(tokenizer, fail_first: set[str]):
    calls: Counter[object] = Counter()

    def handler(call):
        calls[call.session_id] += 1
        if call.session_id in fail_first and calls[call.session_id] == 1:
            raise ConnectionError(f"blip for {call.session_id}")
        return "an answer #### 7"

    return ScriptedEngine(tokenizer, handler)


async def test_a_retried_a_failed_and_a_clean_rollout_on_their_tracks(tokenizer, anyio_backend, tmp_path):
    recorder = TraceRecorder()
    gen = make_generator(
        tokenizer,
        _flaky_engine(tokenizer, {"q0_0"}),
        skip_failed_rollouts=True,
        max_rollout_retries=1,
        rollout_retry_backoff_s=0.001,
    )
    gen.observers.append(recorder)
    await gen.generate(make_batch(3, EnvLedger(), extras={1: {"fail": "init"}}), disable_tqdm=True)
    trace = json.loads(recorder.write(tmp_path / "trace.json").read_text())
    tracks = spans_by_track(trace)
    assert sorted(tracks) == [(1, 0), (1, 1), (1, 2)]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rollout 0", 1: "rollout 1", 2: "rollout 2"}

    # Rollout 0: attempt 1 fails in its engine call, a backoff, attempt 2 plays both turns.
    spans = tracks[(1, 0)]
    (rollout,) = [s for s in spans if s["cat"] == "rollout"]
    assert rollout["args"] == {
        "trajectory_id": "q0_0",
        "attempts": 2,
        "stop_reason": "stop",
        "response_tokens": 10,  # two replies of 5 tokens (the last attempt's)
        "failed": False,
    }
    assert [s["name"] for s in spans if s["cat"] in ("attempt", "backoff")] == ["attempt 1", "backoff", "attempt 2"]
    first, backoff, second = (s for s in spans if s["cat"] in ("attempt", "backoff"))
    assert first["args"]["outcome"] == "failed"
    assert first["args"]["error"] == "ConnectionError: blip for q0_0"
    assert [s["name"] for s in children(spans, first)] == [
        "env.make",
        "env.init",
        "engine",
        "env.close",
        "finish_session",
    ]
    assert children(spans, first)[2]["args"]["error"] == "ConnectionError: blip for q0_0"
    assert backoff["args"]["next_attempt"] == 2
    assert first["ts"] + first["dur"] <= backoff["ts"] <= second["ts"]
    inner = children(spans, second)
    assert [s["name"] for s in inner] == [
        "env.make",
        "env.init",
        "engine",
        "env.step",
        "engine",
        "env.step",
        "env.close",
        "finish_session",
    ]
    engines = [s["args"] for s in inner if s["name"] == "engine"]
    assert [(a["turn"], a["response_tokens"], a["stop_reason"]) for a in engines] == [(0, 5, "stop"), (1, 5, "stop")]
    assert engines[1]["prompt_tokens"] > engines[0]["prompt_tokens"]
    assert all(s["args"]["outcome"] == "ok" for s in inner if s["cat"] == "cleanup")

    # Rollout 1 fails in env.init on both attempts: two failure instants, the last one final.
    failures = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == "failure"]
    assert sorted((e["tid"], e["args"]["attempt"], e["name"], e["args"]["will_retry"]) for e in failures) == [
        (0, 1, "ConnectionError", True),
        (1, 1, "RuntimeError", True),
        (1, 2, "RuntimeError", False),
    ]
    (failed,) = [s for s in tracks[(1, 1)] if s["cat"] == "rollout"]
    assert failed["args"]["failed"] is True
    assert failed["args"]["stop_reason"] == "rollout_error"
    assert failed["args"]["error"].startswith("RuntimeError: scripted env")
    # Rollout 2 had one clean attempt; nothing in the trace is left unfinished.
    assert [s["name"] for s in tracks[(1, 2)] if s["cat"] == "attempt"] == ["attempt 1"]
    assert not any(s["args"].get("unfinished") for spans in tracks.values() for s in spans)


async def test_a_cancelled_batch_ends_every_span(tokenizer, anyio_backend):
    started = anyio.Event()
    calls = 0

    async def hang(call):
        nonlocal calls
        calls += 1
        if calls == 2:
            started.set()
        await anyio.sleep_forever()

    recorder = TraceRecorder()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, hang))
    gen.observers.append(recorder)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(2, EnvLedger()), True)
            await started.wait()
            scope.cancel()
    tracks = spans_by_track(recorder.trace())
    for spans in tracks.values():
        (rollout,) = [s for s in spans if s["cat"] == "rollout"]
        assert rollout["args"]["outcome"] == "cancelled"
        inner = children(spans, rollout)
        assert [s["name"] for s in inner] == [
            "attempt 1",
            "env.make",
            "env.init",
            "engine",
            "env.close",
            "finish_session",
        ]
        assert inner[0]["args"]["outcome"] == "cancelled"
        assert inner[3]["args"]["error"]  # the engine call ended with the cancellation
    aborted = [e for e in recorder.events if e["ph"] == "i" and e["name"].startswith("batch aborted")]
    assert len(aborted) == 1


async def test_each_generate_call_is_its_own_process(tokenizer, anyio_backend):
    recorder = TraceRecorder()
    gen = make_generator(tokenizer)
    gen.observers.append(recorder)
    await gen.generate(make_batch(1, EnvLedger()), disable_tqdm=True)
    await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    tracks = spans_by_track(recorder.trace())
    assert sorted(tracks) == [(1, 0), (2, 0), (2, 1)]
    processes = [e["args"]["name"] for e in recorder.events if e["name"] == "process_name"]
    assert processes == ["generate() #1: 1 rollouts", "generate() #2: 2 rollouts"]


async def test_a_cut_is_marked_cut_and_an_interrupted_batch_marks_no_finished_rollout_failed(tokenizer, anyio_backend):
    """One batch cut by the straggler cutoff, then one cancelled after its rollout 0 succeeded: neither is a failure."""
    from skyrl_structured.cli._timeline import Timeline

    hung = {"q1_1", "q2_0"}  # rollouts 3 and 4 (two samples per prompt)
    recorder = TraceRecorder()
    gen = straggler_generator(tokenizer, hung)
    gen.observers.append(recorder)
    with anyio.fail_after(60):  # a bound only a hang reaches
        await gen.generate(make_batch(5, EnvLedger()), disable_tqdm=True)
    events = recorder.events
    cuts = [e for e in events if e["ph"] == "i" and e["cat"] == "cut"]
    assert sorted(e["tid"] for e in cuts) == [3, 4]
    assert all(e["args"]["error"].startswith("StragglerCutError: ") for e in cuts)
    assert not [e for e in events if e["ph"] == "i" and e["cat"] == "failure"]
    tracks = spans_by_track(recorder.trace())
    for tid in (3, 4):
        (rollout,) = [s for s in tracks[(1, tid)] if s["cat"] == "rollout"]
        (attempt,) = [s for s in tracks[(1, tid)] if s["cat"] == "attempt"]
        assert rollout["args"]["outcome"] == attempt["args"]["outcome"] == "cut"
    timeline = Timeline.of(events)
    assert len(timeline.cuts) == 2
    assert (timeline.failures, timeline.cancelled) == ([], [])

    # Rollout 0 answers and finishes; rollout 1 hangs until the batch is cancelled.
    first_done = anyio.Event()

    async def second_hangs(call):
        if call.session_id == "q0_1":
            await anyio.sleep_forever()
        return "an answer #### 7"

    class FirstDone(TraceRecorder):
        def rollout_finished(self, rollout, *, failed):
            first_done.set()

    done = FirstDone()
    recorder = TraceRecorder()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, second_hangs))
    gen.observers += [recorder, done]
    with anyio.fail_after(60), anyio.CancelScope() as scope:  # a bound only a hang reaches
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(2, EnvLedger()), True)
            await first_done.wait()
            scope.cancel()
    events = recorder.events
    assert [e["tid"] for e in events if e["ph"] == "i" and e["name"].startswith("batch aborted")] == [0]
    timeline = Timeline.of(events)
    starts = {e["tid"]: e["ts"] for e in events if e["ph"] == "X" and e["cat"] == "rollout"}
    rollout_row = {tid: row for row, tid in enumerate(sorted(starts, key=lambda tid: (starts[tid], tid)))}
    assert timeline.failures == []  # the batch's marker is no rollout's failure (rollout 0 succeeded)
    assert timeline.cuts == []
    assert [row for row, _ in timeline.cancelled] == [rollout_row[1]]
