"""StructuredAgentGenerator: an agent written with the official ``openai`` client, captured token-exact.

Each test runs on asyncio and trio; agents run their blocking client in a worker thread. Cancellation and
deadlines are driven by events (an engine that blocks until the test lets it go, or never returns).
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import AgentContext, AgentError, CaptureSession, StructuredAgentGenerator
from skyrl_structured.engines.routing import session_group
from skyrl_structured.testing import EngineCall, LeakTracker, ScriptedEngine
from skyrl_structured.validate import validate_generator_output
from tests._agents import (
    CALL_TEXT,
    assert_rollout_ended,
    batch,
    chat,
    client,
    closing,
    error_of,
    hermes_template,
    one_call_agent,
    timeout_once_in_the_engine,
    tool_agent,
    with_template,
)
from tests._upstream import skyrl_validate_generator_output
from tests.helpers import token_rewards

pytestmark = pytest.mark.anyio


def tool_engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine.from_replies(tokenizer, CALL_TEXT, "6")


async def test_an_openai_agent_trains_token_exact(tokenizer, anyio_backend):
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    tracker = LeakTracker()
    engine = tool_engine(hermes)
    generator = StructuredAgentGenerator(tracker.track_engine(engine), hermes, tool_agent)
    async with tracker, closing(generator):
        out = await generator.generate(batch(2))
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)  # SkyRL's trainer's own check
    assert [r[-1] for r in token_rewards(out)] == [0.0, 0.0]  # "6" is neither 0 + 3 nor 1 + 3
    assert out["stop_reasons"] == ["stop", "stop"]
    calls_by_session: dict[Any, list[EngineCall]] = {}
    for call in engine.calls:
        calls_by_session.setdefault(call.session_id, []).append(call)
    assert len(calls_by_session) == 2
    logprobs = out["rollout_logprobs"]
    assert logprobs is not None
    for row in range(2):
        (calls,) = [
            c for c in calls_by_session.values() if f"What is {row} + 3?" in hermes.decode(c[0].prompt_token_ids)
        ]
        first, second = calls
        prompt, response, mask = out["prompt_token_ids"][row], out["response_ids"][row], out["loss_masks"][row]
        assert prompt == first.prompt_token_ids
        # The second engine prompt is exactly the trajectory so far; its reply ends the row.
        assert prompt + response[: len(second.prompt_token_ids) - len(prompt)] == second.prompt_token_ids
        sampled1 = [*hermes.encode(CALL_TEXT, add_special_tokens=False), hermes.eos_token_id]
        sampled2 = [*hermes.encode("6", add_special_tokens=False), hermes.eos_token_id]
        tail_len = len(second.prompt_token_ids) - len(prompt) - len(sampled1)
        assert response == sampled1 + second.prompt_token_ids[len(prompt) + len(sampled1) :] + sampled2
        assert mask == [1] * len(sampled1) + [0] * tail_len + [1] * len(sampled2)
        expected_lp = [-0.5 - 0.01 * k for k in range(len(sampled1))]
        expected_lp += [0.0] * tail_len + [-0.5 - 0.01 * k for k in range(len(sampled2))]
        assert logprobs[row] == pytest.approx(expected_lp)
    metrics = out["rollout_metrics"] or {}
    assert metrics["generate/agent_calls"] == 4
    assert metrics["generate/agent_branches"] == 2
    assert metrics["generate/agent_multi_branch_rollouts"] == 0
    assert set(engine.finished_sessions) == set(calls_by_session)
    assert len(engine.finished_sessions) == 2


async def test_the_reward_is_the_agents_number_and_the_step_reuses_one_endpoint(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3", "4")

    async def agent(ctx: AgentContext) -> float:
        reply = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0 if reply.choices[0].message.content == str(ctx.env_extras["answer"]) else 0.25

    generator = StructuredAgentGenerator(engine, tokenizer, agent)
    async with generator.serving() as server:
        first = await generator.generate(batch(2))
        second = await generator.generate(batch(1))
        assert server.open_sessions == 0
    assert [r[-1] for r in token_rewards(first)] == [1.0, 0.25]
    assert [r[-1] for r in token_rewards(second)] == [1.0]


async def test_a_think_stripping_template_trains_on_the_last_branch_and_counts_the_others(tokenizer, anyio_backend):
    qwen3_like = with_template(tokenizer, hermes_template(strip_think=True))
    engine = ScriptedEngine.from_replies(qwen3_like, "<think>\nhmm\n</think>\n\nfive", "<think>\nso\n</think>\n\n6")

    async def agent(ctx: AgentContext) -> float:
        def work() -> None:
            with client(ctx.base_url, ctx.api_key) as c:
                messages: list[Any] = list(ctx.prompt)
                for follow_up in ("Sure?", None):
                    reply = c.chat.completions.create(model="m", messages=messages)
                    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                    if follow_up:
                        messages.append({"role": "user", "content": follow_up})

        await anyio.to_thread.run_sync(work)
        return 1.0

    out = await StructuredAgentGenerator(engine, qwen3_like, agent).generate(batch(1))
    validate_generator_output(1, out)
    last = engine.calls[-1]
    assert out["prompt_token_ids"] == [last.prompt_token_ids]
    assert "hmm" not in qwen3_like.decode(last.prompt_token_ids)
    sampled = [*qwen3_like.encode("<think>\nso\n</think>\n\n6", add_special_tokens=False), qwen3_like.eos_token_id]
    assert out["response_ids"] == [sampled]
    assert out["loss_masks"] == [[1] * len(sampled)]
    metrics = out["rollout_metrics"] or {}
    assert metrics["generate/agent_branches"] == 2
    assert metrics["generate/agent_multi_branch_rollouts"] == 1


async def test_a_failed_rollout_is_a_placeholder_or_fails_the_step(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "fine")
    agent = one_call_agent(fails="q1_0")
    skipping = StructuredAgentGenerator(engine, tokenizer, agent, skip_failed_rollouts=True)
    out = await skipping.generate(batch(2))
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)
    assert out["stop_reasons"] == ["stop", "rollout_error"]
    assert out["loss_masks"][1] == [0]
    assert out["rewards"][1] == [0.0]
    assert (out["rollout_metrics"] or {})["generate/num_failed_rollouts"] == 1
    with pytest.raises(ValueError, match="the agent's own bug"):
        await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(2))


async def test_an_agents_engine_session_names_its_rollouts_prompt_group(tokenizer, anyio_backend):
    """HTTPEngine's routing reads a rollout's prompt group from its session id: an agent's capture
    session names its rollout's, so the samples of one prompt go to one server (design rule 26)."""
    engine = ScriptedEngine.from_replies(tokenizer, "fine")
    inputs = batch(3)
    inputs["trajectory_ids"] = [TrajectoryID("q0", 0), TrajectoryID("q0", 1), TrajectoryID("q1", 0)]
    await StructuredAgentGenerator(engine, tokenizer, one_call_agent()).generate(inputs)
    ids = sorted(str(call.session_id) for call in engine.calls)
    assert [re.fullmatch(r"(q[01]_[01])~[0-9a-f]{32}", i)[1] for i in ids] == ["q0_0", "q0_1", "q1_0"]  # type: ignore[index]
    assert [session_group(i) for i in ids] == ["q0", "q0", "q1"]
    assert sorted(map(str, engine.finished_sessions)) == ids


async def test_an_agent_that_never_calls_the_endpoint_or_returns_no_reward_fails_by_name(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "fine")

    async def silent(ctx: AgentContext) -> float:
        return 1.0

    async def no_reward(ctx: AgentContext) -> dict[str, Any]:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return {"score": 1.0}

    with pytest.raises(AgentError, match="no chat completion request"):
        await StructuredAgentGenerator(engine, tokenizer, silent).generate(batch(1))
    with pytest.raises(AgentError, match="`reward`"):
        await StructuredAgentGenerator(engine, tokenizer, no_reward).generate(batch(1))


def blocking_engine(tokenizer: Any, entered: anyio.Event, cancelled: anyio.Event) -> ScriptedEngine:
    async def blocked(call: EngineCall) -> str:
        entered.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    return ScriptedEngine(tokenizer, blocked)


async def test_cancelling_a_step_answers_499_aborts_the_engine_call_and_leaves_nothing(tokenizer, anyio_backend):
    entered, cancelled = anyio.Event(), anyio.Event()
    engine = blocking_engine(tokenizer, entered, cancelled)
    seen: list[Any] = []
    sessions: list[CaptureSession] = []

    async def agent(ctx: AgentContext) -> float:
        sessions.append(ctx.session)
        seen.append(await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt))
        return 1.0

    tracker = LeakTracker()
    generator = StructuredAgentGenerator(tracker.track_engine(engine), tokenizer, agent)
    async with tracker, closing(generator), generator.serving():
        async with anyio.create_task_group() as group:
            group.start_soon(generator.generate, batch(1))
            await entered.wait()
            group.cancel_scope.cancel()
        assert cancelled.is_set()
        (answer,) = seen
        assert answer.status_code == 499
        assert "q0_0" in error_of(answer)["message"]
        (session,) = sessions
        assert (session.closes, session.close_reason) == (1, "cancelled")
        late = await chat(session.base_url, messages=[{"role": "user", "content": "late"}])
        assert_rollout_ended(late, "q0_0")
    assert len(engine.calls) == 1
    assert engine.finished_sessions == [session.id]  # its engine session too, though no call was answered


async def test_a_rollout_past_its_deadline_gets_499_and_fails_with_timeout(tokenizer, anyio_backend):
    entered, cancelled = anyio.Event(), anyio.Event()
    engine = blocking_engine(tokenizer, entered, cancelled)  # never answers: only the deadline ends the call
    seen: list[Any] = []

    async def agent(ctx: AgentContext) -> float:
        seen.append(await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt))
        return 1.0

    generator = StructuredAgentGenerator(engine, tokenizer, agent, rollout_timeout_s=0.2)
    error = await timeout_once_in_the_engine(generator, batch(1), entered.wait)
    assert "rollout_timeout_s=0.2" in error
    assert cancelled.is_set()
    assert seen[0].status_code == 499


async def test_an_agent_interleaving_two_conversations_trains_on_the_one_it_ended_with(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "main 1", "side", "main 2")

    async def agent(ctx: AgentContext) -> float:
        main = list(ctx.prompt)
        first = await chat(ctx.base_url, ctx.api_key, messages=main)
        await chat(ctx.base_url, ctx.api_key, messages=[{"role": "user", "content": "A side question."}])
        main += [{"role": "assistant", "content": first.choices[0].message.content}]
        await chat(ctx.base_url, ctx.api_key, messages=[*main, {"role": "user", "content": "Go on."}])
        return 1.0

    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(1))
    validate_generator_output(1, out)
    main_prompt, _, last = (c.prompt_token_ids for c in engine.calls)
    assert out["prompt_token_ids"] == [main_prompt]
    sampled_last = [*tokenizer.encode("main 2", add_special_tokens=False), tokenizer.eos_token_id]
    assert main_prompt + out["response_ids"][0] == last + sampled_last
    assert out["loss_masks"][0].count(1) == 2 * len(sampled_last)  # "main 1" and "main 2" have as many tokens
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_branches"], metrics["generate/agent_multi_branch_rollouts"]) == (2, 1)


async def test_the_progress_bar_counts_an_agents_calls_before_its_rollout_ends(tokenizer, anyio_backend, capsys):
    # An agent's rollout is several chat calls: the bar shows each one that came back, not only finished rollouts.
    engine = ScriptedEngine.from_replies(tokenizer, "3", "4")

    async def agent(ctx: AgentContext) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0

    generator = StructuredAgentGenerator(engine, tokenizer, agent)
    await generator.generate(batch(1), disable_tqdm=False)
    renders = capsys.readouterr().err.split("\r")
    # The first call is drawn once it came back, while the rollout still runs: whatever the speed.
    assert any("0/1" in render and "calls=1" in render for render in renders), renders
    assert "1/1" in renders[-1], renders
    assert "calls=2" in renders[-1], renders
