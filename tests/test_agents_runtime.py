"""Agent rollouts keep every guarantee of the generator: retries from scratch, pause-aware deadlines, straggler
cuts, group policies and placeholders, observers, shared slots and step-wise rows of every branch.

Each test runs on asyncio and trio, with the official ``openai`` client (in worker threads) or a real
subprocess as the agent. Nothing waits on the clock to decide a verdict: a rollout's deadline is held
stopped (``generator.pause()``) until its agent's request is in the engine, so the deadline can only fire
with that request in flight, and the straggler's fast sibling only finishes once the straggler is there.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured import GeneratorConfig, ResilienceSettings, RolloutObserver, RolloutRef, TrajectoryID
from skyrl_structured.agents import AgentContext, CaptureSession, StructuredAgentGenerator, command_agent
from skyrl_structured.config import resolve_resilience
from skyrl_structured.observe import TraceRecorder
from skyrl_structured.testing import EngineCall, LeakTracker, ScriptedEngine
from skyrl_structured.types import GeneratorInput, GeneratorOutput
from skyrl_structured.validate import validate_generator_output
from tests._agents import (
    ADD_TOOL,
    CALL_TEXT,
    DEADLINE,
    SCRIPT,
    Blocker,
    assert_rollout_ended,
    batch,
    chat,
    client,
    closing,
    error_of,
    hermes_template,
    one_call_agent,
    placeholder,
    question,
    row,
    sampled,
    timeout_once_in_the_engine,
    tool_agent,
    with_template,
)
from tests._pids import dead
from tests._scripted_load import AdmissionWatch, ScriptedLoad, admission_of
from tests._upstream import skyrl_validate_generator_output

pytestmark = pytest.mark.anyio


class Recorder(RolloutObserver):
    """Every rollout event, as ``(name, index, attempt, session_id, details)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, Hashable | None, tuple[Any, ...]]] = []

    def _add(self, name: str, rollout: RolloutRef, *details: Any) -> None:
        self.events.append((name, rollout.index, rollout.attempt, rollout.session_id, details))

    def attempt_started(self, rollout: RolloutRef) -> None:
        self._add("attempt_started", rollout)

    def env_opened(self, rollout: RolloutRef) -> None:
        self._add("env_opened", rollout)

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        self._add("engine_call_started", rollout, turn, prompt_tokens)

    def engine_call_finished(
        self, rollout: RolloutRef, turn: int, response_tokens: int | None, stop_reason: str | None, error: Any
    ) -> None:
        self._add("engine_call_finished", rollout, turn, response_tokens, stop_reason, type(error).__name__)

    def cleanup_started(self, rollout: RolloutRef, kind: Any) -> None:
        self._add("cleanup_started", rollout, kind)

    def cleanup_finished(self, rollout: RolloutRef, kind: Any, outcome: Any, error: Any) -> None:
        self._add("cleanup_finished", rollout, kind, outcome)

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._add("attempt_finished", rollout)

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self._add("attempt_failed", rollout, type(error).__name__, timed_out, will_retry)

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        self._add("retry_backoff", rollout)

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self._add("rollout_finished", rollout, failed)

    def of(self, index: int) -> list[tuple[Any, ...]]:
        """Rollout ``index``'s events as ``(name, attempt, details)``."""
        return [(name, attempt, details) for name, i, attempt, _, details in self.events if i == index]


def assert_ended(session: CaptureSession, reason: str) -> None:
    assert (session.closes, session.close_reason, session.closed) == (1, reason, True)


async def assert_gone(session: CaptureSession) -> None:
    """A request on the session's URL after its rollout ended: a 404 no client retries, naming the rollout."""
    late = await chat(session.base_url, messages=[{"role": "user", "content": "late"}])
    assert_rollout_ended(late, session.rollout)


# ------------------------------------------------------------------ retries


async def test_a_retry_runs_the_agent_again_in_a_fresh_session(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    sessions: list[CaptureSession] = []
    old_url: list[Any] = []

    async def agent(ctx: AgentContext) -> float:
        sessions.append(ctx.session)
        if len(sessions) == 1:
            await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
            raise ConnectionError("the agent's tool server went away")
        old_url.append(await chat(sessions[0].base_url, messages=ctx.prompt))  # the first attempt's session
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    recorder = Recorder()
    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, max_rollout_retries=1, rollout_retry_backoff_s=0.0, sampling_seed=7
    )
    generator.observers.append(recorder)
    out = await generator.generate(batch(1))
    validate_generator_output(1, out)
    skyrl_validate_generator_output(1, out)
    first, second = sessions
    assert first.id != second.id
    assert first.base_url != second.base_url
    assert_ended(first, "failed")
    assert_ended(second, "ended")
    (late,) = old_url
    assert_rollout_ended(late, "q0_0")
    assert [c.session_id for c in engine.calls] == [first.id, second.id]  # the late request never reached the engine
    assert engine.finished_sessions == [first.id, second.id]
    # The row is the retry's capture; a retry sends the same derived seed as the attempt it replaces.
    assert out["prompt_token_ids"] == [engine.calls[1].prompt_token_ids]
    assert out["response_ids"] == [sampled(tokenizer, "3")]
    seeds = [(c.sampling_params or {})["seed"] for c in engine.calls]
    assert isinstance(seeds[0], int)
    assert seeds[0] == seeds[1]
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_rollout_retries"], metrics["generate/num_failed_rollouts"]) == (1, 0)
    assert metrics["generate/agent_calls"] == 1  # the successful attempt's
    prompt_tokens = len(engine.calls[0].prompt_token_ids)
    reply = ("engine_call_finished", (0, 2, "stop", "NoneType"))
    # The session is the agent's environment: closed (env_close) before its engine session is finished.
    finish = [
        ("cleanup_started", ("env_close",)),
        ("cleanup_finished", ("env_close", "ok")),
        ("cleanup_started", ("finish_session",)),
        ("cleanup_finished", ("finish_session", "ok")),
    ]
    assert [(name, attempt, details) for name, attempt, details in recorder.of(0)] == [
        ("attempt_started", 1, ()),
        ("env_opened", 1, ()),
        ("engine_call_started", 1, (0, prompt_tokens)),
        (reply[0], 1, reply[1]),
        *[(name, 1, details) for name, details in finish],
        ("attempt_failed", 1, ("ConnectionError", False, True)),
        ("retry_backoff", 1, ()),
        ("attempt_started", 2, ()),
        ("env_opened", 2, ()),
        ("engine_call_started", 2, (0, prompt_tokens)),
        (reply[0], 2, reply[1]),
        *[(name, 2, details) for name, details in finish],
        ("attempt_finished", 2, ()),
        ("rollout_finished", 2, (False,)),
    ]
    # Each attempt's events after its session opened name that session.
    sessions_seen = {(attempt, sid) for name, _, attempt, sid, _ in recorder.events if name != "attempt_started"}
    assert sessions_seen == {(1, first.id), (2, second.id)}


# ------------------------------------------------------------------ observers


async def test_observers_hear_one_engine_call_per_captured_call_and_the_trace_has_its_spans(tokenizer, anyio_backend):
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    engine = ScriptedEngine.from_replies(hermes, CALL_TEXT, "6")
    recorder, trace = Recorder(), TraceRecorder()
    generator = StructuredAgentGenerator(engine, hermes, tool_agent)
    generator.observers += [recorder, trace]
    out = await generator.generate(batch(2))
    skyrl_validate_generator_output(2, out)
    by_session: dict[Hashable | None, list[EngineCall]] = {}
    for call in engine.calls:
        by_session.setdefault(call.session_id, []).append(call)
    for index in range(2):
        events = recorder.of(index)
        (sid,) = {s for name, i, _, s, _ in recorder.events if i == index and name == "engine_call_started"}
        calls = by_session[sid]
        starts = [d for name, _, d in events if name == "engine_call_started"]
        ends = [d for name, _, d in events if name == "engine_call_finished"]
        assert starts == [(0, len(calls[0].prompt_token_ids)), (1, len(calls[1].prompt_token_ids))]
        assert ends == [
            (0, len(sampled(hermes, CALL_TEXT)), "stop", "NoneType"),
            (1, len(sampled(hermes, "6")), "stop", "NoneType"),
        ]
        assert [name for name, _, _ in events][:2] == ["attempt_started", "env_opened"]
        assert [name for name, _, _ in events][-2:] == ["attempt_finished", "rollout_finished"]
    spans = [e for e in trace.events if e.get("ph") == "X"]
    engine_spans = [e for e in spans if e["name"] == "engine"]
    assert len(engine_spans) == 4 == len(engine.calls)
    assert all(not e["args"].get("unfinished") for e in spans)
    assert sorted(e["args"]["turn"] for e in engine_spans) == [0, 0, 1, 1]
    assert len([e for e in spans if e["name"] == "finish_session"]) == 2


# ------------------------------------------------------------------ deadlines and pauses


async def test_a_pause_stops_agent_deadlines_and_a_rollout_past_its_deadline_gets_499(tokenizer, anyio_backend):
    """Row 0's engine never answers, row 1's answers only when let go; both wait past the deadline while paused."""
    gate = anyio.Event()
    blocker = Blocker(tokenizer, {0})
    row1_entered, row1_done = anyio.Event(), anyio.Event()

    async def handler(call: EngineCall) -> str:
        if question(tokenizer, call) == 1:
            row1_entered.set()
            await gate.wait()
            return "3"
        return await blocker(call)

    sessions: dict[str, CaptureSession] = {}
    answers: dict[str, Any] = {}

    async def agent(ctx: AgentContext) -> float:
        sessions[ctx.rollout] = ctx.session
        answers[ctx.rollout] = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        if ctx.rollout == "q1_0":
            row1_done.set()
        return 1.0

    tracker = LeakTracker()
    engine = ScriptedEngine(tokenizer, handler)
    generator = StructuredAgentGenerator(
        tracker.track_engine(engine), tokenizer, agent, rollout_timeout_s=DEADLINE, skip_failed_rollouts=True
    )
    result: dict[str, GeneratorOutput] = {}

    async def run() -> None:
        result["out"] = await generator.generate(batch(2))

    async with tracker, closing(generator), generator.serving():
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                generator.pause()
                group.start_soon(run)
                await blocker.all_entered()
                await row1_entered.wait()
                await anyio.sleep(4 * DEADLINE)  # paused: no deadline may fire, however long this takes
                assert "out" not in result
                assert not blocker.cancelled[0].is_set()
                gate.set()
                await row1_done.wait()  # row 1 finished during the pause, past its deadline in wall time
                generator.resume()  # row 0's clock runs again: it times out with its request in flight
        out = result["out"]
        await assert_gone(sessions["q0_0"])
    assert blocker.cancelled[0].is_set()
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)
    assert row(out, 0) == placeholder(tokenizer.pad_token_id)
    assert out["response_ids"][1] == sampled(tokenizer, "3")
    assert (out["stop_reasons"] or [])[1] == "stop"
    assert answers["q0_0"].status_code == 499
    assert "q0_0" in error_of(answers["q0_0"])["message"]
    assert answers["q1_0"].choices[0].message.content == "3"
    assert_ended(sessions["q0_0"], "cancelled")
    assert_ended(sessions["q1_0"], "ended")
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_timed_out_rollouts"], metrics["generate/failures/TimeoutError"]) == (1, 1)
    assert Counter(engine.finished_sessions) == Counter(s.id for s in sessions.values())


@pytest.fixture
def pid_script(tmp_path: Path) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return [sys.executable, str(path)]


async def assert_group_gone(pidfile: Path) -> None:
    """The command agent and the child it started are gone (waited for under a bound only a hang reaches)."""
    agent_pid, child_pid = map(int, (await anyio.Path(pidfile).read_text(encoding="utf-8")).split())
    assert dead(agent_pid)  # reaped before generate() returned
    with anyio.fail_after(60):
        while not dead(child_pid):  # noqa: ASYNC110 - not our child: no event tells when the kernel is done
            await anyio.sleep(0.01)


async def test_a_command_agent_past_its_deadline_gets_499_and_its_process_group_is_killed(
    tokenizer, anyio_backend, pid_script, tmp_path
):
    blocker = Blocker(tokenizer, {0})
    engine = ScriptedEngine(tokenizer, blocker)
    pidfile = tmp_path / "pids"
    command = command_agent(pid_script, env={"PIDFILE": str(pidfile)})
    sessions: list[CaptureSession] = []

    async def agent(ctx: AgentContext) -> Any:
        sessions.append(ctx.session)
        return await command(ctx)

    generator = StructuredAgentGenerator(engine, tokenizer, agent, rollout_timeout_s=DEADLINE)
    async with generator.serving():
        error = await timeout_once_in_the_engine(generator, batch(1), blocker.all_entered)
        (session,) = sessions
        await assert_gone(session)
    assert f"rollout_timeout_s={DEADLINE:g}" in error
    assert blocker.cancelled[0].is_set()
    assert_ended(session, "cancelled")
    assert engine.finished_sessions == [session.id]
    await assert_group_gone(pidfile)


# ------------------------------------------------------------------ straggler cutoff


async def test_stragglers_are_cut_their_requests_answered_499_and_their_command_killed(
    tokenizer, anyio_backend, pid_script, tmp_path
):
    """Row 0 finishes once rows 1 (a Python agent) and 2 (a command) are in the engine; the cutoff cuts them."""
    blocker = Blocker(tokenizer, {1, 2})
    tracker = LeakTracker()
    engine = ScriptedEngine(tokenizer, blocker)
    pidfile = tmp_path / "pids"
    command = command_agent(pid_script, env={"PIDFILE": str(pidfile)})
    sessions: dict[str, CaptureSession] = {}
    answers: dict[str, Any] = {}

    async def agent(ctx: AgentContext) -> Any:
        sessions[ctx.rollout] = ctx.session
        if ctx.rollout == "q2_0":
            return await command(ctx)
        if ctx.rollout == "q0_0":
            await blocker.all_entered()
        answers[ctx.rollout] = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    generator = StructuredAgentGenerator(
        tracker.track_engine(engine),
        tokenizer,
        agent,
        skip_failed_rollouts=True,
        straggler_cutoff=1 / 3,
        straggler_grace_s=0.0,
    )
    async with tracker, closing(generator), generator.serving():
        with anyio.fail_after(60):
            out = await generator.generate(batch(3))
        for rollout in ("q1_0", "q2_0"):
            await assert_gone(sessions[rollout])
    validate_generator_output(3, out)
    skyrl_validate_generator_output(3, out)
    assert out["response_ids"][0] == sampled(tokenizer, "3")
    pad = tokenizer.pad_token_id
    assert [row(out, 1), row(out, 2)] == [placeholder(pad), placeholder(pad)]
    assert blocker.cancelled[1].is_set()
    assert blocker.cancelled[2].is_set()
    assert answers["q1_0"].status_code == 499
    assert "q1_0" in error_of(answers["q1_0"])["message"]
    assert_ended(sessions["q0_0"], "ended")
    assert_ended(sessions["q1_0"], "cancelled")
    assert_ended(sessions["q2_0"], "cancelled")
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_cut_rollouts"], metrics["generate/num_failed_rollouts"]) == (2, 2)
    assert Counter(engine.finished_sessions) == Counter(s.id for s in sessions.values())
    await assert_group_gone(pidfile)


# ------------------------------------------------------------------ group policies and placeholders


def grouped_batch() -> GeneratorInput:
    """Two prompts, two samples each: q0 (rows 0, 1) and q1 (rows 2, 3)."""
    ids = [TrajectoryID(f"q{i}", r) for i in range(2) for r in range(2)]
    return {
        "prompts": [[{"role": "user", "content": f"What is {t.instance_id[1]} + 3?"}] for t in ids],
        "env_classes": ["agent"] * 4,
        "env_extras": [{} for _ in ids],
        "trajectory_ids": ids,
    }


@pytest.mark.parametrize("policy", ["placeholder", "mask_group", "fill_group_mean"])
async def test_group_policies_act_on_agent_rollouts_as_on_gym_rollouts(tokenizer, anyio_backend, policy):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    agent = one_call_agent({"q0_0": 0.25, "q0_1": 0.75, "q1_0": 0.5}, fails="q1_1")
    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, skip_failed_rollouts=True, failed_rollout_policy=policy
    )
    out = await generator.generate(grouped_batch())
    validate_generator_output(4, out)
    skyrl_validate_generator_output(4, out)
    ok = sampled(tokenizer, "3")
    pad = tokenizer.pad_token_id

    def scored(value: float) -> list[float]:
        return [0.0] * (len(ok) - 1) + [value]

    failed = placeholder(pad)
    if policy == "placeholder":
        expected_rewards = [scored(0.25), scored(0.75), scored(0.5), [0.0]]
        expected_masks = [[1] * len(ok)] * 3 + [[0]]
    elif policy == "mask_group":
        expected_rewards = [scored(0.25), scored(0.75), [0.0] * len(ok), [0.0]]
        expected_masks = [[1] * len(ok)] * 2 + [[0] * len(ok), [0]]
    else:  # the failed rollout scores its group's successful mean: the group's baseline is unchanged
        expected_rewards = [scored(0.25), scored(0.75), scored(0.5), [0.5]]
        expected_masks = [[1] * len(ok)] * 3 + [[0]]
    assert out["rewards"] == expected_rewards
    assert out["loss_masks"] == expected_masks
    assert out["response_ids"][3] == failed["response"]
    assert out["prompt_token_ids"][3] == failed["prompt"]
    assert out["stop_reasons"] == ["stop", "stop", "stop", "rollout_error"]
    assert (out["rollout_logprobs"] or [])[3] == [0.0]
    assert (out["rollout_metrics"] or {})["generate/failures/ValueError"] == 1


# ------------------------------------------------------------------ step-wise rows of every branch

#: The engine's replies to a session's calls, in order (the first thinks; a Qwen3-style template strips it later).
BRANCHING_REPLIES = ("<think>\nhmm\n</think>\n\nfive", CALL_TEXT, "6", "side", "done")
#: The calls of :func:`branching_agent` by branch, in the order step-wise rows come: the first call's branch
#: (its history is rewritten by the next call), the side question's, then the branch of the last call.
BRANCH_CALLS = ([0], [3], [1, 2, 4])


async def branching_agent(ctx: AgentContext) -> float:
    """A tool loop that also asks a side question: five calls, three branches under a think-stripping template."""

    def work() -> None:
        with client(ctx.base_url, ctx.api_key) as c:
            main: list[Any] = list(ctx.prompt)
            for follow_up in ("Sure?", None, None):
                reply = c.chat.completions.create(model="m", messages=main, tools=ADD_TOOL)  # type: ignore[arg-type]
                message = reply.choices[0].message
                main.append(message.model_dump(exclude_none=True))
                main += [{"role": "tool", "tool_call_id": t.id, "content": "6"} for t in message.tool_calls or []]
                if follow_up:
                    main.append({"role": "user", "content": follow_up})
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "A side question."}])
            main.append({"role": "user", "content": "Last one."})
            c.chat.completions.create(model="m", messages=main, tools=ADD_TOOL)  # type: ignore[arg-type]

    await anyio.to_thread.run_sync(work)
    return 1.0 if ctx.rollout == "q0_0" else 0.5


def concat(rows: list[list[Any]]) -> list[Any]:
    return [x for r in rows for x in r]


async def test_step_wise_output_holds_every_branch_token_for_token(tokenizer, anyio_backend):
    qwen3_like = with_template(tokenizer, hermes_template(strip_think=True))
    engine = ScriptedEngine.from_replies(qwen3_like, *BRANCHING_REPLIES)
    generator = StructuredAgentGenerator(engine, qwen3_like, branching_agent, step_wise_trajectories=True)
    out = await generator.generate(batch(2))
    validate_generator_output(2, out, step_wise=True)
    skyrl_validate_generator_output(2, out, step_wise=True)
    ids, is_last, logprobs = out["trajectory_ids"], out["is_last_step"], out["rollout_logprobs"]
    assert ids is not None
    assert is_last is not None
    assert logprobs is not None
    assert ids == [TrajectoryID("q0", 0)] * 5 + [TrajectoryID("q1", 0)] * 5
    assert is_last == [False] * 4 + [True] + [False] * 4 + [True]
    for t in range(2):
        by_session: dict[Hashable | None, list[EngineCall]] = {}
        for call in engine.calls:
            by_session.setdefault(call.session_id, []).append(call)
        (calls,) = [c for c in by_session.values() if question(qwen3_like, c[0]) == t]
        rows = iter(range(5 * t, 5 * t + 5))
        for branch in BRANCH_CALLS:
            mine = [next(rows) for _ in branch]
            for r, k in zip(mine, branch, strict=True):
                # A row: its call's engine prompt, what the engine sampled (mask 1), the tail up to the next call.
                assert out["prompt_token_ids"][r] == calls[k].prompt_token_ids
                reply = sampled(qwen3_like, BRANCHING_REPLIES[k])
                tail = len(out["response_ids"][r]) - len(reply)
                assert out["response_ids"][r][: len(reply)] == reply
                assert out["loss_masks"][r] == [1] * len(reply) + [0] * tail
                assert logprobs[r] == pytest.approx([-0.5 - 0.01 * j for j in range(len(reply))] + [0.0] * tail)
                assert (out["stop_reasons"] or [])[r] == "stop"
            # Concatenated, a branch's rows are the branch: its last call's prompt and what that call sampled.
            first, last = calls[branch[0]], calls[branch[-1]]
            assert out["prompt_token_ids"][mine[0]] == first.prompt_token_ids
            whole = first.prompt_token_ids + concat([out["response_ids"][r] for r in mine])
            assert whole == last.prompt_token_ids + sampled(qwen3_like, BRANCHING_REPLIES[branch[-1]])
        rewards = [out["rewards"][r] for r in range(5 * t, 5 * t + 5)]
        assert all(isinstance(x, list) and not any(x) for x in rewards[:-1])
        final = rewards[-1]
        assert isinstance(final, list)
        assert final == [0.0] * (len(final) - 1) + [1.0 if t == 0 else 0.5]
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (10, 6)
    assert metrics["generate/agent_multi_branch_rollouts"] == 2
    # Without step-wise rows, the same rollouts give one row each: the branch of the last call.
    flat = await StructuredAgentGenerator(engine, qwen3_like, branching_agent).generate(batch(1))
    last_call = engine.calls[-1]
    assert flat["prompt_token_ids"] == [engine.calls[-4].prompt_token_ids]  # the branch began at the second call
    assert flat["prompt_token_ids"][0] + flat["response_ids"][0] == last_call.prompt_token_ids + sampled(
        qwen3_like, "done"
    )


async def test_step_wise_placeholders_and_the_single_row_default(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    step_wise = StructuredAgentGenerator(
        engine, tokenizer, one_call_agent(fails="q1_0"), step_wise_trajectories=True, skip_failed_rollouts=True
    )
    out = await step_wise.generate(batch(2))
    validate_generator_output(2, out, step_wise=True)
    skyrl_validate_generator_output(2, out, step_wise=True)
    assert out["trajectory_ids"] == [TrajectoryID("q0", 0), TrajectoryID("q1", 0)]
    assert out["is_last_step"] == [True, True]
    assert row(out, 1) == placeholder(tokenizer.pad_token_id)
    with pytest.raises(ValueError, match=r"trajectory_ids.*step_wise_trajectories"):
        await step_wise.generate({"prompts": batch(1)["prompts"]})  # type: ignore[typeddict-item]  # no trajectory_ids on purpose


# ------------------------------------------------------------------ shared slots, knobs


async def test_max_concurrent_rollouts_is_shared_by_concurrent_generate_calls(tokenizer, anyio_backend):
    gate = anyio.Event()
    entered = anyio.Event()

    async def handler(call: EngineCall) -> str:
        entered.set()
        await gate.wait()
        return "3"

    async def agent(ctx: AgentContext) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    engine = ScriptedEngine(tokenizer, handler)
    generator = StructuredAgentGenerator(engine, tokenizer, agent, max_concurrent_rollouts=1)
    outputs: list[GeneratorOutput] = []

    async def one() -> None:
        outputs.append(await generator.generate(batch(1)))

    with anyio.fail_after(60):
        async with generator.serving(), anyio.create_task_group() as group:
            group.start_soon(one)
            group.start_soon(one)
            await entered.wait()
            slots = generator._frame.slots.current(1)
            assert slots is not None
            # The other call's rollout waits for this generator's one slot (a limiter per call would not hold it).
            while slots.statistics().tasks_waiting < 1:  # noqa: ASYNC110 - the limiter has no event to wait on
                await anyio.sleep(0.01)
            assert (slots.borrowed_tokens, len(engine.calls)) == (1, 1)
            gate.set()
    assert len(outputs) == 2
    assert len(engine.calls) == 2


async def test_max_concurrent_rollouts_auto_follows_the_engines_load_for_agents_too(tokenizer, anyio_backend):
    """The agent generator's one adaptive limit: the floor first, one more on a reading with room."""
    gate = anyio.Event()

    async def handler(call: EngineCall) -> str:
        await gate.wait()
        return "3"

    async def agent(ctx: AgentContext) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    engine = ScriptedLoad(ScriptedEngine(tokenizer, handler))
    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, max_concurrent_rollouts="auto", admission_min_rollouts=1
    )
    generator.admission_interval_s = 0.0
    watch = AdmissionWatch()
    generator.observers.append(watch)
    outputs: list[GeneratorOutput] = []

    async def run() -> None:
        outputs.append(await generator.generate(batch(3)))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await watch.until(lambda w: len(w.started) == 1)
            engine.give(0.1)
            await watch.until(lambda w: len(w.started) == 2)
            assert watch.decisions == [(2, 1, "grow")]
            gate.set()
    (out,) = outputs
    assert out["stop_reasons"] == ["stop"] * 3
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/admission_limit_min"], metrics["generate/admission_limit_max"]) == (1.0, 2.0)
    assert metrics["generate/admission_changes/grow"] == 1.0


async def test_an_agents_captured_calls_are_its_committed_context(tokenizer, anyio_backend):
    """The capture session's engine calls are the rollout's own: admission counts what they hold."""
    gate, entered = anyio.Event(), anyio.Event()
    calls: list[EngineCall] = []

    async def handler(call: EngineCall) -> str:
        calls.append(call)
        entered.set()
        await gate.wait()
        return "3"

    async def agent(ctx: AgentContext) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    engine = ScriptedLoad(ScriptedEngine(tokenizer, handler))
    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, max_concurrent_rollouts="auto", admission_min_rollouts=1
    )
    outputs: list[GeneratorOutput] = []

    async def run() -> None:
        outputs.append(await generator.generate(batch(2)))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await entered.wait()
            admission = admission_of(generator)
            [tracker] = admission._committed
            assert len(tracker) == 1  # the floor: one admitted, the other waits
            assert admission.committed_tokens() == len(calls[0].prompt_token_ids)
            gate.set()
    (out,) = outputs
    assert out["stop_reasons"] == ["stop"] * 2
    assert len(tracker) == 0
    assert admission.committed_tokens() == 0.0


def test_every_knob_reaches_the_generator_by_keyword_or_from_config(tokenizer):
    async def agent(ctx: AgentContext) -> float:
        return 1.0

    engine = ScriptedEngine.from_replies(tokenizer, "3")
    cfg = GeneratorConfig(
        step_wise_trajectories=True,
        zero_reward_on_non_stop=True,
        skip_failed_rollouts=True,
        rollout_timeout_s=30.0,
        max_rollout_retries=2,
        rollout_retry_backoff_s=0.5,
        max_concurrent_rollouts=4,
        env_cleanup_timeout_s=5.0,
        max_failed_rollout_fraction=0.5,
        failure_budget_action="warn",
        failed_rollout_policy="mask_group",
        sampling_seed=3,
        straggler_cutoff=0.75,
        straggler_grace_s=1.0,
        straggler_cutoff_scope="group",
    )
    built = StructuredAgentGenerator.from_config(cfg, engine, tokenizer, agent, model="m")
    assert built.resilience == resolve_resilience(cfg)
    assert built.resilience != ResilienceSettings()
    assert (built.generator_cfg.step_wise_trajectories, built.generator_cfg.zero_reward_on_non_stop) == (True, True)
    assert built.generator_cfg.apply_overlong_filtering is False
    assert built.model == "m"
    assert built.sampling_params is not None
    by_keyword = StructuredAgentGenerator(engine, tokenizer, agent, rollout_timeout_s=2.0, max_concurrent_rollouts=3)
    assert (by_keyword.resilience.rollout_timeout_s, by_keyword.resilience.max_concurrent_rollouts) == (2.0, 3)
    with pytest.raises(TypeError, match=r"unknown knob\(s\) \['rollout_timeout'\]"):
        StructuredAgentGenerator(engine, tokenizer, agent, rollout_timeout=2.0)
    with pytest.raises(ValueError, match=r"straggler_cutoff=0.5` needs `generator.skip_failed_rollouts=true"):
        StructuredAgentGenerator(engine, tokenizer, agent, straggler_cutoff=0.5)
    with pytest.raises(ValueError, match=r"`generator.step_wise_trajectories` must be true or false"):
        StructuredAgentGenerator(engine, tokenizer, agent, step_wise_trajectories="yes")
    with pytest.raises(ValueError, match=r"`generator.max_rollout_retries`"):
        StructuredAgentGenerator(engine, tokenizer, agent, max_rollout_retries=-1)
