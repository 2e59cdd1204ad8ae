"""Sync agents run in the generator's worker threads, and a rollout never waits on one past its bound.

On asyncio and trio, with the blocking ``openai`` client in the agent's thread. The agent that will
not stop behaves like mini-swe-agent on LiteLLM, which retried the session's error answers for
minutes: it ignores every answer and asks again until a ``threading.Event`` lets it go, and the test
sets that event only after ``generate()`` has returned, so a ``generate()`` that waited on the thread
could only end by the watchdog's 60 s (a bound only a hang reaches), and the test would fail then.
The clock is paused (no deadline runs) until row 0's request is in the engine and row 1's agent has
returned, so row 1 never races the short deadline however loaded the machine is (a CI run on a busy
machine once timed row 1 out while its thread started).
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import openai
import pytest

from skyrl_structured.agents import AgentContext, StructuredAgentGenerator
from skyrl_structured.envs._threads import wait_env_thread_calls
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.validate import validate_generator_output
from tests._agents import (
    CLEANUP_S,
    DEADLINE,
    HANG_S,
    Blocker,
    assert_closed,
    batch,
    client,
    generate_paused_until,
    placeholder,
    port_of,
    question,
    row,
    sampled,
)

#: A watchdog's bound around ``generate()``: only a rollout waiting on its stuck thread reaches it.


class Stubborn:
    """A sync agent that ignores the session's error answers and keeps asking until ``release`` is set.

    ``statuses`` are the answers it got (a status, or ``"connection"`` for a connection error), those of
    the calls it began once ``late`` was set (``generate()`` had returned) in ``late_statuses``; ``retried``
    is set once it made two such calls, ``ended`` when its thread leaves the agent.
    """

    def __init__(self) -> None:
        self.release = threading.Event()
        self.late = threading.Event()
        self.retried = threading.Event()
        self.ended = threading.Event()
        self.statuses: list[int | str] = []
        self.late_statuses: list[int | str] = []
        self.threads: set[str] = set()
        self.base_url = ""

    def __call__(self, ctx: AgentContext) -> float:
        self.threads.add(threading.current_thread().name)
        self.base_url = ctx.base_url
        try:
            with client(ctx.base_url, ctx.api_key) as c:
                while not self.release.is_set():
                    answers = self.late_statuses if self.late.is_set() else self.statuses
                    try:
                        c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
                    except openai.APIStatusError as exc:
                        answers.append(exc.status_code)
                    except openai.APIConnectionError:
                        answers.append("connection")
                    if len(self.late_statuses) > 1:
                        self.retried.set()
                    self.release.wait(0.02)  # a client's backoff before it retries
            return 1.0
        finally:
            self.ended.set()


@pytest.mark.anyio
async def test_a_sync_agent_that_keeps_retrying_is_abandoned_past_the_cleanup_bound(tokenizer, anyio_backend):
    blocker = Blocker(tokenizer, {0})
    stubborn = Stubborn()
    answered: list[str] = []
    row1_returned = threading.Event()

    def agent(ctx: AgentContext) -> float:
        if ctx.rollout == "q0_0":
            return stubborn(ctx)
        with client(ctx.base_url, ctx.api_key) as c:
            reply = c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
        answered.append(reply.choices[0].message.content or "")
        row1_returned.set()
        return 1.0

    engine = ScriptedEngine(tokenizer, blocker)
    generator = StructuredAgentGenerator(
        engine,
        tokenizer,
        agent,
        rollout_timeout_s=DEADLINE,
        env_cleanup_timeout_s=CLEANUP_S,
        skip_failed_rollouts=True,
        agent_endpoint_workers=0,  # the in-loop endpoint's tombstone (workers keep their ports until aclose())
    )
    try:
        out, released_first = await generate_paused_until(
            generator, blocker.all_entered, row1_returned, stubborn.release
        )
        assert not released_first, "generate() waited on the agent's thread until the watchdog released it"
        assert not stubborn.ended.is_set()  # returned while the thread still runs: abandoned, not waited for
        stubborn.late.set()
        with anyio.fail_after(HANG_S):  # the abandoned agent goes on asking after its endpoint closed
            assert await anyio.to_thread.run_sync(stubborn.retried.wait, HANG_S)
    finally:
        stubborn.release.set()
    with anyio.fail_after(HANG_S):
        assert await anyio.to_thread.run_sync(stubborn.ended.wait, HANG_S)
        assert await anyio.to_thread.run_sync(wait_env_thread_calls, HANG_S)  # nothing left in a worker thread
        await assert_closed(port_of(stubborn.base_url))  # nor in the thread that answered for its closed endpoint
    validate_generator_output(2, out)
    assert row(out, 0) == placeholder(tokenizer.pad_token_id)
    assert out["response_ids"][1] == sampled(tokenizer, "3")
    assert answered == ["3"]
    assert stubborn.statuses[0] == 499  # its request in flight at the deadline; it asked again anyway
    # Once generate() had returned and its endpoint closed, the port's tombstone answered: the ended session's 404,
    # never a refused connection.
    assert set(stubborn.late_statuses) == {404}
    assert all(name.startswith("skyrl-structured-agent") for name in stubborn.threads)
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_timed_out_rollouts"], metrics["generate/failures/TimeoutError"]) == (1, 1)
    assert metrics["generate/env_cleanup_timeouts"] == 1


@pytest.mark.anyio
async def test_a_sync_agent_that_stops_on_its_answer_is_waited_for_not_abandoned(tokenizer, anyio_backend):
    blocker = Blocker(tokenizer, {0})
    statuses: list[int] = []
    ended, row1_returned = threading.Event(), threading.Event()

    def agent(ctx: AgentContext) -> float:
        try:
            with client(ctx.base_url, ctx.api_key) as c:
                c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
            raise
        finally:
            if ctx.rollout == "q0_0":
                ended.set()
        row1_returned.set()
        return 1.0

    generator = StructuredAgentGenerator(
        ScriptedEngine(tokenizer, blocker),
        tokenizer,
        agent,
        rollout_timeout_s=DEADLINE,
        env_cleanup_timeout_s=HANG_S,  # waited for: the agent returns once its request is answered
        skip_failed_rollouts=True,
    )
    out, released_first = await generate_paused_until(generator, blocker.all_entered, row1_returned, threading.Event())
    assert not released_first
    assert ended.is_set()  # generate() waited for the thread that stops by itself
    assert statuses == [499]
    assert row(out, 0) == placeholder(tokenizer.pad_token_id)
    assert out["response_ids"][1] == sampled(tokenizer, "3")
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_timed_out_rollouts"], metrics["generate/env_cleanup_timeouts"]) == (1, 0)


@pytest.mark.anyio
async def test_a_sync_agent_never_runs_on_the_event_loop_and_its_calls_are_captured(tokenizer, anyio_backend):
    loop_thread = threading.current_thread()
    seen: list[threading.Thread] = []

    def agent(ctx: AgentContext) -> dict[str, Any]:
        seen.append(threading.current_thread())
        with client(ctx.base_url, ctx.api_key) as c:
            reply = c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
        return {"reward": float(reply.choices[0].message.content == str(ctx.env_extras["answer"]))}

    engine = ScriptedEngine(tokenizer, lambda call: str(question(tokenizer, call) + 3))
    out = await StructuredAgentGenerator(engine, tokenizer, agent, max_agent_threads=2).generate(batch(3))
    validate_generator_output(3, out)
    assert [r[-1] for r in out["rewards"]] == [1.0, 1.0, 1.0]  # type: ignore[index]
    assert len(seen) == 3
    assert loop_thread not in seen
    assert len({t.name for t in seen}) <= 2
    assert (out["rollout_metrics"] or {})["generate/agent_calls"] == 3


@pytest.mark.anyio
async def test_a_plain_function_returning_a_coroutine_fails_its_rollout_saying_to_declare_it_async(
    tokenizer, anyio_backend
):
    async def solve(ctx: AgentContext) -> float:
        return 1.0

    def agent(ctx: AgentContext) -> Any:
        return solve(ctx)

    generator = StructuredAgentGenerator(ScriptedEngine.from_replies(tokenizer, "3"), tokenizer, agent)
    with pytest.raises(Exception, match="declare an agent that awaits as `async def`"):
        await generator.generate(batch(1))


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_agent_threads_below_one_is_refused_naming_it(tokenizer, value):
    with pytest.raises(ValueError, match=r"^`max_agent_threads` must be an integer of at least 1"):
        StructuredAgentGenerator(
            ScriptedEngine.from_replies(tokenizer, "3"), tokenizer, lambda ctx: 1.0, max_agent_threads=value
        )
