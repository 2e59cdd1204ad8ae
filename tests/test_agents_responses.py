"""The OpenAI Responses API on the capture endpoint, through the official ``openai`` client and the OpenAI Agents SDK.

Real HTTP on 127.0.0.1, the server in the test's event loop (asyncio and trio), each client in a worker
thread (the Agents SDK on an asyncio loop of its own there), a :class:`ScriptedEngine` behind it with
non-canonical token ids, so a re-tokenized reply would show. Nothing here waits on time.
"""

from __future__ import annotations

import json
from typing import Any, cast

import anyio
import openai
import pytest

from skyrl_structured import GeneratorInput
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator, check_capture, serve_capture
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from tests._agents import (
    ADD_TOOL,
    assert_rollout_ended,
    chat,
    client,
    error_of,
    hermes_template,
    in_thread,
    with_template,
)
from tests.helpers import run_asyncio

pytestmark = pytest.mark.anyio

QUESTION = "What is 2 + 3?"
CALL_TEXT = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "It is 5."
#: ADD_TOOL in the Responses API's shape, as the Agents SDK sends it (``strict``, which no template may see).
RESPONSES_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_TOOL[0]["function"]["parameters"],
    "strict": True,
}


@pytest.fixture
def hermes(tokenizer: Any) -> Any:
    return with_template(tokenizer, hermes_template(strip_think=False))


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized one character at a time, then EOS: the engine's ids, not the tokenizer's canonical ones."""
    return [*(i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)), tokenizer.eos_token_id]


def tool_engine(tokenizer: Any) -> tuple[ScriptedEngine, list[list[int]]]:
    """An engine answering a tool call, then the answer, each with non-canonical ids; and those ids."""
    sampled = [char_ids(tokenizer, CALL_TEXT), char_ids(tokenizer, ANSWER)]
    assert sampled[0][:-1] != tokenizer.encode(CALL_TEXT, add_special_tokens=False)
    replies = [Reply(text, token_ids=ids) for text, ids in zip((CALL_TEXT, ANSWER), sampled, strict=True)]
    return ScriptedEngine.from_replies(tokenizer, *replies), sampled


def chat_render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The template's text for ``messages`` with chat-shaped ``tools`` (what a chat-completions agent gets)."""
    return str(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def assert_one_token_exact_branch(
    tokenizer: Any,
    engine: ScriptedEngine,
    session: Any,
    sampled: list[list[int]],
    *,
    instructions: str | None,
    tools: list[dict[str, Any]] = ADD_TOOL,
) -> None:
    """Two calls, one branch: the engine's sampled ids exactly (mask 1), the template's tokens between (mask 0).

    The prompts are the chat template's render of the same conversation written in chat shape with the
    chat ``tools``, so the Responses request rendered exactly as chat completions would have.
    """
    system = [{"role": "system", "content": instructions}] if instructions else []
    first = [*system, {"role": "user", "content": QUESTION}]
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    second: list[dict[str, Any]] = [
        *first,
        {"role": "assistant", "content": "Let me add.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    prompt0, prompt1 = (c.prompt_token_ids for c in engine.calls)
    assert prompt0 == encode(tokenizer, chat_render(tokenizer, first, tools))
    # The tokens between the calls: the template's tokens for what the second render adds after the first
    # render and the sampled text (the tool call as the template re-serialises it, the result, the prompt).
    branch_text = chat_render(tokenizer, first, tools) + tokenizer.decode(sampled[0])
    second_text = chat_render(tokenizer, second, tools)
    assert second_text.startswith(branch_text)
    tail = encode(tokenizer, second_text[len(branch_text) :])
    assert tail
    assert prompt1 == prompt0 + sampled[0] + tail
    assert [c.sampled_ids for c in session.calls] == sampled
    assert [c.extended for c in session.calls] == [False, True]
    (branch,) = session.capture.branches
    assert branch.prompt_ids == prompt0
    assert branch.response_ids == sampled[0] + tail + sampled[1]
    assert branch.loss_mask == [1] * len(sampled[0]) + [0] * len(tail) + [1] * len(sampled[1])


async def respond(base_url: str, **request: Any) -> Any:
    """One ``responses.create`` from a fresh official client in a worker thread: the response, or the API error."""

    def work() -> Any:
        with client(base_url) as c:
            return c.responses.create(**{"model": "m", **request})

    return await in_thread(work)


def usage_of(engine: ScriptedEngine, sampled: list[list[int]], k: int) -> dict[str, int]:
    prompt = len(engine.calls[k].prompt_token_ids)
    return {"input_tokens": prompt, "output_tokens": len(sampled[k]), "total_tokens": prompt + len(sampled[k])}


def usage(response: Any) -> dict[str, int]:
    u = response.usage
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "total_tokens": u.total_tokens}


# ------------------------------------------------------------------ the official client


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
async def test_a_tool_round_trip_through_responses_is_one_token_exact_branch(hermes, anyio_backend, streamed):
    engine, sampled = tool_engine(hermes)
    deltas: list[list[str]] = []

    def ask(c: openai.OpenAI, **request: Any) -> Any:
        if not streamed:
            return c.responses.create(model="m", tools=[RESPONSES_TOOL], **request)  # type: ignore[list-item]
        with c.responses.stream(model="m", tools=[RESPONSES_TOOL], **request) as stream:  # type: ignore[list-item]
            deltas.append([e.delta for e in stream if e.type in ("response.output_text.delta",)])
            return stream.get_final_response()

    async with serve_capture(engine, hermes) as server, server.session("t0_0") as session:

        def agent() -> list[Any]:
            with client(session.base_url) as c:
                first = ask(c, instructions="Be brief.", input=QUESTION)
                items: list[Any] = [{"role": "user", "content": QUESTION}]
                items += [item.model_dump(exclude_none=True) for item in first.output]  # re-sent with id and status
                call = next(item for item in first.output if item.type == "function_call")
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
                return [first, ask(c, instructions="Be brief.", input=items)]

        first, second = await in_thread(agent)
    message, function_call = first.output
    assert (message.type, message.content[0].text) == ("message", "Let me add.")
    assert (function_call.name, json.loads(function_call.arguments)) == ("add", {"a": 2, "b": 3})
    assert first.status == "completed"
    assert second.output_text == ANSWER
    assert [usage(first), usage(second)] == [usage_of(engine, sampled, 0), usage_of(engine, sampled, 1)]
    assert_one_token_exact_branch(hermes, engine, session, sampled, instructions="Be brief.")
    if streamed:
        assert deltas == [["Let me add."], [ANSWER]]
    assert session.responses == {}  # dropped with the session


async def test_previous_response_id_continues_the_sessions_own_conversation(hermes, anyio_backend):
    engine, sampled = tool_engine(hermes)
    async with serve_capture(engine, hermes) as server:
        async with server.session("t0_0") as session:
            first = await respond(session.base_url, tools=[RESPONSES_TOOL], input=QUESTION)
            call = next(item for item in first.output if item.type == "function_call")
            output = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
            second = await respond(
                session.base_url, tools=[RESPONSES_TOOL], previous_response_id=first.id, input=[output]
            )
            unknown = await respond(session.base_url, previous_response_id="resp_x", input="Hi.")
            ids = list(session.responses)
        late = await respond(session.base_url, previous_response_id=first.id, input="Hi.")
    assert second.previous_response_id == first.id
    assert ids == [first.id, second.id]
    assert_one_token_exact_branch(hermes, engine, session, sampled, instructions=None)
    assert_not_found(unknown, "resp_x")
    assert_rollout_ended(late, "t0_0")
    assert len(engine.calls) == 2


def assert_not_found(answer: Any, response_id: str) -> None:
    """``answer`` is OpenAI's answer to a ``previous_response_id`` it does not hold: a 404 ``NotFoundError``."""
    assert isinstance(answer, openai.NotFoundError), answer
    error = answer.response.json()["error"]
    expected = (404, "invalid_request_error", "previous_response_id", "previous_response_not_found")
    assert (answer.status_code, error["type"], error["param"], error["code"]) == expected
    assert error["message"].startswith(f"Previous response with id '{response_id}' not found.")
    assert answer.response.headers["x-should-retry"] == "false"


async def test_previous_response_id_naming_a_store_false_response_is_not_found(hermes, anyio_backend):
    """Issue 45: a ``store: false`` response is not kept, so continuing it is OpenAI's not found (nothing sampled)."""
    engine, _ = tool_engine(hermes)
    async with serve_capture(engine, hermes) as server, server.session("t0_0") as session:
        first = await respond(session.base_url, tools=[RESPONSES_TOOL], input=QUESTION, store=False)
        second = await respond(session.base_url, previous_response_id=first.id, input="Go on.")
        kept = dict(session.responses)
    assert first.store is False
    assert kept == {}
    assert_not_found(second, first.id)
    assert len(engine.calls) == 1


async def test_responses_tools_render_exactly_as_the_same_chat_tools(hermes, anyio_backend):
    engine = ScriptedEngine.from_replies(hermes, "ok")
    async with serve_capture(engine, hermes) as server:
        async with server.session("chat") as session:
            await chat(session.base_url, messages=[{"role": "user", "content": QUESTION}], tools=ADD_TOOL)
        async with server.session("responses") as session:
            text = [{"type": "input_text", "text": QUESTION}]
            await respond(
                session.base_url,
                input=[{"type": "message", "role": "user", "content": text}],
                tools=[RESPONSES_TOOL],
                include=[],
            )
    chat_prompt, responses_prompt = (c.prompt_token_ids for c in engine.calls)
    assert responses_prompt == chat_prompt
    assert "strict" not in hermes.decode(responses_prompt)


async def test_a_conversation_begun_with_chat_completions_and_continued_with_responses_extends_one_branch(
    hermes, anyio_backend
):
    engine, sampled = tool_engine(hermes)
    async with serve_capture(engine, hermes) as server, server.session("t0_0") as session:
        first = await chat(session.base_url, messages=[{"role": "user", "content": QUESTION}], tools=ADD_TOOL)
        (call,) = first.choices[0].message.tool_calls
        items = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"type": "function_call", "call_id": call.id, "name": "add", "arguments": call.function.arguments},
            {"type": "function_call_output", "call_id": call.id, "output": "5"},
        ]
        second = await respond(session.base_url, input=items, tools=[RESPONSES_TOOL])
    assert second.output_text == ANSWER
    assert_one_token_exact_branch(hermes, engine, session, sampled, instructions=None)


async def test_sampling_fields_reach_the_engine_under_the_chat_rule(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, Reply("cut", stop_reason="length"))
    params = {"max_generate_length": 64}
    async with serve_capture(engine, tokenizer) as server, server.session("a", sampling_params=params) as session:
        answer = await respond(
            session.base_url, input="Hi.", temperature=0.3, top_p=0.9, max_output_tokens=7, extra_body={"seed": 3}
        )
    assert engine.calls[0].sampling_params == {
        "max_generate_length": 7,
        "logprobs": 1,
        "temperature": 0.3,
        "top_p": 0.9,
        "seed": 3,
    }
    assert (answer.status, answer.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert answer.output_text == "cut"


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
        ({"reasoning": {"effort": "none", "summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"budget": 3}}, "reasoning.budget"),
        ({"reasoning": "none"}, "reasoning"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required", "tools": [RESPONSES_TOOL]}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"instructions": ["not", "text"]}, "instructions"),
    ],
)
async def test_a_responses_field_that_cannot_be_honoured_is_refused_with_a_400_naming_it(
    tokenizer, anyio_backend, request_fields, param
):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    request = {"input": "Hi.", **request_fields}
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answer = await respond(session.base_url, **request)
    error = error_of(answer)
    assert (answer.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert f"`{param}`" in error["message"]
    assert answer.response.headers["x-should-retry"] == "false"
    assert engine.calls == []


@pytest.mark.parametrize(
    "request_fields",
    [
        {"reasoning": {"effort": "none"}, "text": {"verbosity": "low"}},  # the Agents SDK's default model settings
        {"reasoning": {"effort": None, "summary": None}, "text": {"format": {"type": "text"}, "verbosity": "medium"}},
        {"reasoning": {}, "text": {}},
    ],
    ids=["sdk-defaults", "explicit-defaults", "empty"],
)
async def test_reasoning_and_text_settings_that_ask_for_what_the_engine_does_are_accepted(
    tokenizer, anyio_backend, request_fields
):
    """Issue 47: no reasoning effort and the default verbosities change nothing the engine gets."""
    engine = ScriptedEngine.from_replies(tokenizer, "ok", "ok")
    async with serve_capture(engine, tokenizer) as server:
        async with server.session("t0_0") as plain:
            await respond(plain.base_url, input="Hi.")
        async with server.session("t1_0") as settled:
            answer = await respond(settled.base_url, input="Hi.", **request_fields)
    assert answer.output_text == "ok"
    first, second = engine.calls
    assert (second.prompt_token_ids, second.sampling_params) == (first.prompt_token_ids, first.sampling_params)


async def test_an_in_flight_response_of_a_cancelled_rollout_gets_499_and_a_later_one_hears_it_ended(
    tokenizer, anyio_backend
):
    entered = anyio.Event()

    async def blocked(call: EngineCall) -> str:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    answers: list[Any] = []
    server_scope = serve_capture(ScriptedEngine(tokenizer, blocked), tokenizer)
    async with server_scope as server, anyio.create_task_group() as group:
        with anyio.CancelScope() as rollout_scope:
            async with server.session("t7_0") as session:

                async def agent() -> None:
                    request = {"input": "Hi.", "stream": True}
                    answers.append(await respond(session.base_url, **request))

                group.start_soon(agent)
                await entered.wait()
                rollout_scope.cancel()
                await anyio.sleep_forever()
        late = await respond(session.base_url, input="Hi.")
    (answer,) = answers
    assert answer.status_code == 499
    assert answer.response.headers["x-should-retry"] == "false"
    assert "rollout t7_0 ended (cancelled)" in error_of(answer)["message"]
    assert_rollout_ended(late, "t7_0")


def test_check_capture_covers_tool_turns_written_in_the_responses_shape(tokenizer):
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    report = check_capture(hermes)
    assert [c.api for c in (report, *report.others)] == ["chat.completions", "responses", "messages"]
    responses, _ = report.others
    assert [c.extended for c in responses.calls] == [False, True, True]
    assert responses == check_capture(hermes, api="responses")
    assert report.append_only
    assert "\nwritten as responses requests: the same, call by call\n" in str(report)
    qwen3_like = with_template(tokenizer, hermes_template(strip_think=True))
    assert [c.extended for c in check_capture(qwen3_like).others[0].calls] == [False, True, False]


# ------------------------------------------------------------------ the OpenAI Agents SDK, default model


def run_agents_sdk(base_url: str, api_key: str, *, streamed: bool) -> tuple[str, list[str], dict[str, Any]]:
    """An Agents SDK agent with one function tool, its default model (the Responses API) pointed at ``base_url``:
    its final output, the text deltas it streamed, and its tool in chat shape."""
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = Agent(name="adder", instructions="Be brief.", tools=[add], model="m")
    tool = {"name": add.name, "description": add.description, "parameters": add.params_json_schema}

    async def main() -> tuple[str, list[str], dict[str, Any]]:
        # A client of the run's own: the provider's default one pools connections process-wide, bound to the
        # first event loop it ran on (each rollout here runs a loop of its own).
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as own:
            provider = OpenAIProvider(openai_client=own)
            assert isinstance(provider.get_model("m"), OpenAIResponsesModel)  # the SDK's default model
            config = RunConfig(model_provider=provider, tracing_disabled=True)
            if not streamed:
                return str((await Runner.run(agent, QUESTION, run_config=config)).final_output), [], tool
            run = Runner.run_streamed(agent, QUESTION, run_config=config)
            deltas = [
                e.data.delta
                async for e in run.stream_events()
                if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"
            ]
            return str(run.final_output), deltas, tool

    return run_asyncio(main())


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_agents_sdk_agent_with_its_default_model_is_captured_token_exact(hermes, anyio_backend, streamed):
    engine, sampled = tool_engine(hermes)
    seen: dict[str, Any] = {}

    def agent(ctx: AgentContext) -> float:
        seen["output"], seen["deltas"], seen["tool"] = run_agents_sdk(ctx.base_url, ctx.api_key, streamed=streamed)
        seen["session"] = ctx.session
        return 1.0

    batch = cast(GeneratorInput, {"prompts": [[{"role": "user", "content": QUESTION}]], "env_extras": [{}]})
    out = await StructuredAgentGenerator(engine, hermes, agent).generate(batch)
    assert seen["output"] == ANSWER
    assert seen["deltas"] == (["Let me add.", ANSWER] if streamed else [])
    tools = [{"type": "function", "function": seen["tool"]}]
    assert_one_token_exact_branch(hermes, engine, seen["session"], sampled, instructions="Be brief.", tools=tools)
    (branch,) = seen["session"].capture.branches
    assert out["prompt_token_ids"] == [branch.prompt_ids]
    assert out["response_ids"] == [branch.response_ids]
    assert out["loss_masks"] == [branch.loss_mask]
