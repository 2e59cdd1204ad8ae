"""Which branch is an agent rollout's row, and forks that reuse sampled ids (issue 45, design rule 19).

A side call (a title, a summary) answered after the main conversation's last turn must not become the
row; two continuations of one earlier call reuse that call's sampled ids as the engine sampled them.
Real HTTP on 127.0.0.1 with the official ``openai`` and ``anthropic`` clients in worker threads, a
:class:`ScriptedEngine` behind the endpoint with non-canonical token ids (re-tokenizing would change
them), on asyncio and trio. The order of completion is forced with events, never with time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import anyio
import anyio.to_thread
import pytest

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator, serve_capture
from skyrl_structured.agents._capture import CallTag, Capture
from skyrl_structured.agents._conversation import render_text
from skyrl_structured.agents._rows import main_branch
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from skyrl_structured.types import GeneratorInput
from skyrl_structured.validate import validate_generator_output
from tests._agents import chat, client, error_of, in_thread, noncanonical_ids

pytestmark = pytest.mark.anyio

QUESTION = "What is 2 + 3?"
MAIN_REPLIES = ("Let me think about it.", "It is five.")
#: The side call's prompt: longer than the main conversation's first render, so only the rule keeps it off the row.
SIDE_PROMPT = "Write a five-word title for this conversation: " + "the user asks what two plus three is. " * 6
SIDE_REPLY = "Adding two and three"


def one_row() -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": QUESTION}]],
        "env_classes": ["agent"],
        "env_extras": [{}],
        "trajectory_ids": [TrajectoryID("q0", 0)],
    }


def logprobs_for(ids: list[int], base: float) -> list[float]:
    return [base - 0.01 * k for k in range(len(ids))]


class SideAfterMain:
    """An engine that answers the main conversation at once and holds the side call until the agent says
    the main conversation has ended: the side call is the last call to complete, whatever the speed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.main = [noncanonical_ids(tokenizer, text) for text in MAIN_REPLIES]
        self.side = noncanonical_ids(tokenizer, SIDE_REPLY)
        self.side_in_engine = anyio.Event()
        self.main_done = anyio.Event()
        self._replies: Iterator[Reply] = iter(
            Reply(text, token_ids=ids, logprobs=logprobs_for(ids, -0.5 - k))
            for k, (text, ids) in enumerate(zip(MAIN_REPLIES, self.main, strict=True))
        )
        self.engine = ScriptedEngine(tokenizer, self._answer)

    async def _answer(self, call: EngineCall) -> Reply:
        if "five-word title" in self.tokenizer.decode(call.prompt_token_ids):
            self.side_in_engine.set()
            await self.main_done.wait()
            return Reply(SIDE_REPLY, token_ids=self.side, logprobs=logprobs_for(self.side, -3.0))
        return next(self._replies)

    def main_calls(self) -> list[EngineCall]:
        return [c for c in self.engine.calls if "five-word title" not in self.tokenizer.decode(c.prompt_token_ids)]

    def side_call(self) -> EngineCall:
        (call,) = [c for c in self.engine.calls if "five-word title" in self.tokenizer.decode(c.prompt_token_ids)]
        return call

    async def run(self, side: Callable[[], Any], main: Callable[[], Any]) -> None:
        """Start the side call, run the main conversation while the engine holds it, then let it be answered."""
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, side)
            await self.side_in_engine.wait()
            await anyio.to_thread.run_sync(main)
            self.main_done.set()


def assert_row_is_the_main_conversation(out: Any, script: SideAfterMain, turns: int) -> None:
    """The row: the main conversation's first prompt, then every main reply as sampled (mask 1, its logprobs)
    with the template's tokens between (mask 0); nothing of the side call."""
    calls = script.main_calls()
    assert len(calls) == turns
    prompt = calls[0].prompt_token_ids
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for k in range(turns):
        tail = calls[k].prompt_token_ids[len(prompt) + len(response) :]
        assert calls[k].prompt_token_ids == prompt + response + tail  # each prompt extends the branch
        sampled = script.main[k]
        response += tail + sampled
        mask += [0] * len(tail) + [1] * len(sampled)
        logprobs += [0.0] * len(tail) + logprobs_for(sampled, -0.5 - k)
    assert out["prompt_token_ids"] == [prompt]
    assert out["response_ids"] == [response]
    assert out["loss_masks"] == [mask]
    assert out["rollout_logprobs"] == [pytest.approx(logprobs)]
    assert out["rewards"][0][-1] == 1.0
    assert script.side not in [response[i : i + len(script.side)] for i in range(len(response))]
    metrics = out["rollout_metrics"] or {}
    assert metrics["generate/agent_calls"] == turns + 1
    assert (metrics["generate/agent_branches"], metrics["generate/agent_multi_branch_rollouts"]) == (2, 1)


# ------------------------------------------------------------------ the row is the main conversation


#: How the side call is told from the main conversation: the main has more turns (no mark at all); the side
#: call names another model than the served one; the side call says `x-skyrl-branch: side`; the main says `main`.
WAYS = ("turns", "model", "side header", "main header")


@pytest.mark.parametrize("way", WAYS)
async def test_a_side_call_answered_last_does_not_become_the_row(tokenizer, anyio_backend, way):
    script = SideAfterMain(tokenizer)
    turns = 2 if way == "turns" else 1

    async def agent(ctx: AgentContext) -> float:
        main_model = ctx.model if way == "model" else "any"
        side_headers = {"x-skyrl-branch": "side"} if way == "side header" else {}
        main_headers = {"x-skyrl-branch": "main"} if way == "main header" else {}

        def side() -> None:
            with client(ctx.base_url, ctx.api_key) as c:
                messages: Any = [{"role": "user", "content": SIDE_PROMPT}]
                c.chat.completions.create(model="side-model", messages=messages, extra_headers=side_headers)

        def main() -> None:
            messages: list[Any] = list(ctx.prompt)
            with client(ctx.base_url, ctx.api_key) as c:
                for _ in range(turns):
                    reply = c.chat.completions.create(model=main_model, messages=messages, extra_headers=main_headers)
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": "Go on."},
                    ]

        await script.run(side, main)
        assert ctx.session.calls[-1].sampled_ids == script.side  # the side call completed last
        return 1.0

    # The agent reads the session's calls while it is open: the in-loop endpoint's (a worker's are in the worker).
    generator = StructuredAgentGenerator(script.engine, tokenizer, agent, agent_endpoint_workers=0)
    out = await generator.generate(one_row())
    validate_generator_output(1, out)
    assert_row_is_the_main_conversation(out, script, turns)


def claude_code_like(ctx: AgentContext) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A Claude-Code-shaped agent: system blocks with ``cache_control``, a two-turn main conversation on the
    served model, and a title request on a small model in parallel (Anthropic Messages, official client)."""
    system: Any = [{"type": "text", "text": "You are a careful assistant.", "cache_control": {"type": "ephemeral"}}]

    def messages_client() -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0, timeout=120.0)

    def side() -> None:
        with messages_client() as c:
            c.messages.create(
                model="claude-haiku-small-fast",
                max_tokens=32,
                messages=[{"role": "user", "content": SIDE_PROMPT}],
            )

    def main() -> None:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        with messages_client() as c:
            for _ in MAIN_REPLIES:
                reply = c.messages.create(model=ctx.model, max_tokens=64, system=system, messages=messages)
                text = "".join(block.text for block in reply.content if block.type == "text")
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]

    return side, main


async def test_a_claude_code_like_side_call_is_not_the_row_and_step_wise_keeps_it(tokenizer, anyio_backend):
    outputs = {}
    scripts = {}
    for step_wise in (False, True):
        script = scripts[step_wise] = SideAfterMain(tokenizer)

        async def agent(ctx: AgentContext, script: SideAfterMain = script) -> float:
            await script.run(*claude_code_like(ctx))
            assert ctx.session.calls[-1].sampled_ids == script.side  # the side call completed last
            return 1.0

        generator = StructuredAgentGenerator(  # the agent reads the open session's calls: the in-loop endpoint's
            script.engine, tokenizer, agent, step_wise_trajectories=step_wise, agent_endpoint_workers=0
        )
        outputs[step_wise] = await generator.generate(one_row())
    validate_generator_output(1, outputs[False])
    assert_row_is_the_main_conversation(outputs[False], scripts[False], 2)

    # Step-wise: every branch, the side call's first; the main conversation's steps last, the reward on its end.
    out, script = outputs[True], scripts[True]
    validate_generator_output(1, out, step_wise=True)
    first, second = script.main_calls()
    side = script.side_call()
    assert out["is_last_step"] == [False, False, True]
    assert out["prompt_token_ids"] == [side.prompt_token_ids, first.prompt_token_ids, second.prompt_token_ids]
    tail = second.prompt_token_ids[len(first.prompt_token_ids) + len(script.main[0]) :]
    assert out["response_ids"] == [script.side, script.main[0] + tail, script.main[1]]
    assert out["loss_masks"] == [
        [1] * len(script.side),
        [1] * len(script.main[0]) + [0] * len(tail),
        [1] * len(script.main[1]),
    ]
    assert [r[-1] for r in out["rewards"]] == [0.0, 0.0, 1.0]  # type: ignore[index]


async def test_a_branch_mark_that_is_neither_main_nor_side_is_refused_by_name(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "unused")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answer = await chat(
            session.base_url, messages=[{"role": "user", "content": "Hi."}], extra_headers={"x-skyrl-branch": "title"}
        )
    assert answer.status_code == 400
    assert error_of(answer)["param"] == "x-skyrl-branch"
    assert "`main`" in error_of(answer)["message"]
    assert engine.calls == []


# ------------------------------------------------------------------ forks reuse the sampled ids


def fork_engine(tokenizer: Any) -> tuple[ScriptedEngine, list[list[int]]]:
    """Three replies with non-canonical ids (the first is the one both forks continue); and those ids."""
    texts = ("The answer is five.", "Two and three.", "Five, as in two plus three, which is what you asked.")
    sampled = [noncanonical_ids(tokenizer, text) for text in texts]
    replies = [
        Reply(text, token_ids=ids, logprobs=logprobs_for(ids, -1.0 - k))
        for k, (text, ids) in enumerate(zip(texts, sampled, strict=True))
    ]
    return ScriptedEngine.from_replies(tokenizer, *replies), sampled


def assert_forked_from_the_first_call(session: Any, engine: ScriptedEngine, sampled: list[list[int]]) -> None:
    """The second fork's prompt begins with exactly the first call's prompt and sampled ids; each fork's
    branch holds those ids as recorded (mask 1, their logprobs) and then its own."""
    first, one, two = (c.prompt_token_ids for c in engine.calls)
    shared = first + sampled[0]
    for prompt in (one, two):
        assert prompt[: len(shared)] == shared
        assert len(prompt) > len(shared)
    assert [c.extended for c in session.calls] == [False, True, False]
    assert [c.reused for c in session.calls] == [0, len(shared), len(shared)]
    assert [c.branch for c in session.calls] == [0, 0, 1]
    main, fork = session.capture.branches
    assert fork.prompt_ids == first
    assert fork.prompt_ids + fork.response_ids == two + sampled[2]
    tail = two[len(shared) :]
    assert fork.loss_mask == [1] * len(sampled[0]) + [0] * len(tail) + [1] * len(sampled[2])
    assert fork.logprobs == pytest.approx(
        logprobs_for(sampled[0], -1.0) + [0.0] * len(tail) + logprobs_for(sampled[2], -3.0)
    )
    assert main.prompt_ids + main.response_ids == one + sampled[1]


async def test_two_chat_forks_from_one_call_reuse_its_sampled_ids(tokenizer, anyio_backend):
    engine, sampled = fork_engine(tokenizer)
    user: list[Any] = [{"role": "user", "content": QUESTION}]
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        reply = await chat(session.base_url, messages=user)
        history = [*user, {"role": "assistant", "content": reply.choices[0].message.content}]
        for follow_up in ("Why?", "Say it another way."):
            await chat(session.base_url, messages=[*history, {"role": "user", "content": follow_up}])
    assert_forked_from_the_first_call(session, engine, sampled)


async def test_two_responses_forks_from_one_previous_response_id_reuse_its_sampled_ids(tokenizer, anyio_backend):
    engine, sampled = fork_engine(tokenizer)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:

        def agent() -> None:
            with client(session.base_url) as c:
                first = c.responses.create(model="m", input=QUESTION)
                for follow_up in ("Why?", "Say it another way."):
                    c.responses.create(model="m", input=follow_up, previous_response_id=first.id)

        answer = await in_thread(agent)
        assert answer is None
    assert_forked_from_the_first_call(session, engine, sampled)


async def test_a_fork_of_a_fork_reuses_the_longest_recorded_prefix(tokenizer, anyio_backend):
    # Calls: A; B continues A; C forks from A; D continues C's conversation from its own start again (a fork of
    # the fork at C's end, once the fork branch has moved on): each prompt starts with the ids recorded up to there.
    texts = tuple(f"hello world {n}." for n in ("one", "two", "three", "four", "five"))
    sampled = [noncanonical_ids(tokenizer, text) for text in texts]
    engine = ScriptedEngine.from_replies(
        tokenizer, *(Reply(t, token_ids=s) for t, s in zip(texts, sampled, strict=True))
    )
    user: list[Any] = [{"role": "user", "content": QUESTION}]

    def turn(history: list[Any], text: str, follow_up: str) -> list[Any]:
        return [*history, {"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]

    a = user
    b = turn(a, texts[0], "b")
    c = turn(a, texts[0], "c")
    d = turn(c, texts[2], "d")
    e = turn(c, texts[2], "e")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        for messages in (a, b, c, d, e):
            await chat(session.base_url, messages=messages)
    prompts = [call.prompt_token_ids for call in engine.calls]
    at_a = prompts[0] + sampled[0]
    at_c = prompts[2] + sampled[2]
    assert prompts[1][: len(at_a)] == at_a
    assert prompts[2][: len(at_a)] == at_a
    assert prompts[3][: len(at_c)] == at_c
    assert prompts[4][: len(at_c)] == at_c
    assert [call.branch for call in session.calls] == [0, 0, 1, 1, 2]
    assert [call.reused for call in session.calls] == [0, len(at_a), len(at_a), len(at_c), len(at_c)]
    assert len(session.capture.branches) == 3


async def test_forks_count_as_branches_and_the_row_is_one_whole_fork(tokenizer, anyio_backend):
    async def agent(ctx: AgentContext) -> float:
        reply = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        history = [*ctx.prompt, {"role": "assistant", "content": reply.choices[0].message.content}]
        for follow_up in ("Why?", "Say it another way."):
            await chat(ctx.base_url, ctx.api_key, messages=[*history, {"role": "user", "content": follow_up}])
        return 1.0

    for step_wise in (False, True):
        engine, sampled = fork_engine(tokenizer)
        out = await StructuredAgentGenerator(engine, tokenizer, agent, step_wise_trajectories=step_wise).generate(
            one_row()
        )
        validate_generator_output(1, out, step_wise=step_wise)
        metrics = out["rollout_metrics"] or {}
        assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (3, 2)
        assert metrics["generate/agent_multi_branch_rollouts"] == 1
        first, one, two = (c.prompt_token_ids for c in engine.calls)
        if not step_wise:
            # Both forks have two turns: the longer one (the second) is the row, whole from the first prompt.
            assert out["prompt_token_ids"] == [first]
            assert first + out["response_ids"][0] == two + sampled[2]
            assert out["loss_masks"][0].count(1) == len(sampled[0]) + len(sampled[2])
        else:
            # Every sampled id is trained on once: the fork's step starts at its own call.
            assert out["prompt_token_ids"] == [first, one, two]
            assert [r.count(1) for r in out["loss_masks"]] == [len(s) for s in sampled]
            assert out["is_last_step"] == [False, False, True]


async def test_the_row_rule_in_order_marks_then_served_model_then_turns(tokenizer, anyio_backend):
    # The rule on a session's record alone (main_branch), each step deciding where the one before left a choice.
    def session(*calls: tuple[list[Any], CallTag]) -> Capture:
        capture = Capture(tokenizer)
        for messages, tag in calls:
            turns = 1 + sum(m["role"] == "assistant" for m in messages)
            prepared = capture.prepare(render_text(tokenizer, messages, None), turns=turns, tag=tag)
            capture.record(prepared, tokenizer.encode("ok", add_special_tokens=False), None, "stop", "ok")
        return capture

    short: list[Any] = [{"role": "user", "content": "Hi."}]
    long_: list[Any] = [{"role": "user", "content": "Hi. " * 40}]
    two_turns: list[Any] = [*short, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "More."}]
    plain, side, main, served = CallTag(), CallTag("side"), CallTag("main"), CallTag(served=True)
    # The last call marked main wins over turns, length and order.
    assert main_branch(session((short, main), (two_turns, plain), (long_, plain))) == 0
    # Side marks leave a branch out; when every call is marked side, the marks decide nothing.
    assert main_branch(session((short, plain), (long_, side))) == 0
    assert main_branch(session((short, side), (long_, side))) == 1
    # A call naming the served model leaves out the branches of calls naming another model.
    assert main_branch(session((short, served), (long_, plain))) == 0
    # Turns first (the second call extends the first's branch), then tokens, then the last to complete.
    assert main_branch(session((short, plain), (two_turns, plain), (long_, plain))) == 0
    assert main_branch(session((short, plain), (long_, plain))) == 1
    assert main_branch(session((long_, plain), (short, plain))) == 0
    assert main_branch(session((short, plain), (short, plain))) == 1  # the same request twice: two equal branches
