"""The Anthropic Messages API on the capture endpoint, through the official ``anthropic`` client (issue 35).

Real HTTP on 127.0.0.1, the server in the test's event loop (asyncio and trio), the client in a worker
thread (or a subprocess), a :class:`ScriptedEngine` behind it. Nothing here waits on time.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, get_args

import anthropic
import anyio
import anyio.to_thread
import httpx
import httpx2
import pytest
from anthropic.types.shared.error_type import ErrorType

from skyrl_structured.agents import StructuredAgentGenerator, check_capture, command_agent, serve_capture
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from tests._agents import ADD_TOOL, Blocked, batch, chat, hermes_template, with_template
from tests._agents import in_thread as agents_in_thread

pytestmark = pytest.mark.anyio

SYSTEM = "You add numbers."
QUESTION = "What is 2 + 3?"
HI: Any = [{"role": "user", "content": "Hi."}]
CALL_TEXT = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
#: ADD_TOOL in Anthropic's shape, with the keys that must not reach the template (``strict``, ``cache_control``).
ADD: Any = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_TOOL[0]["function"]["parameters"],
    "strict": True,
    "cache_control": {"type": "ephemeral"},
}


def messages_client(base_url: str, api_key: str | None = "unused", **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120.0, **kwargs)


async def create(base_url: str, **request: Any) -> Any:
    """One ``messages.create`` from a fresh client in a worker thread: the message, or the ``APIStatusError``."""

    def work() -> Any:
        with messages_client(base_url) as client:
            return client.messages.create(**{"model": "m", "max_tokens": 8, **request})

    return await in_thread(work)


async def in_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` (blocking ``anthropic`` client calls) in a worker thread; an API error is returned, not raised."""
    return await agents_in_thread(work, anthropic.APIStatusError)


def anthropic_error(answer: Any, status: int) -> dict[str, Any]:
    """The ``error`` of an Anthropic-shaped error answer: ``{"type": "error", "error": {"type", "message"}}``."""
    assert isinstance(answer, anthropic.APIStatusError), f"expected an API error, got {answer!r}"
    assert answer.status_code == status
    assert answer.response.headers["x-should-retry"] == "false"
    body = answer.response.json()
    assert set(body) == {"type", "error"}
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] in get_args(ErrorType), f"{body['error']['type']!r} is not one of Anthropic's types"
    return dict(body["error"])


def hermes(tokenizer: Any) -> Any:
    return with_template(tokenizer, hermes_template(strip_think=False))


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The ids chat completions would send the engine for ``messages`` with ADD_TOOL (a Messages call's too)."""
    text = tokenizer.apply_chat_template(messages, tools=ADD_TOOL, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def round_trip(base_url: str, *, stream: bool) -> tuple[list[Any], list[str]]:
    """A two-call tool conversation through the official client: ``(final messages, streamed texts)``."""
    texts: list[str] = []
    with messages_client(base_url) as client:

        def call(messages: list[dict[str, Any]]) -> Any:
            request: dict[str, Any] = {"model": "m", "max_tokens": 64, "system": SYSTEM, "messages": messages}
            if not stream:
                return client.messages.create(**request, tools=[ADD])
            with client.messages.stream(**request, tools=[ADD]) as events:
                texts.append("".join(e.text for e in events if e.type == "text"))
                return events.get_final_message()

        history: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = call(history)
        tool_use = first.content[-1]
        history += [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "5"}]},
        ]
        return [first, call(history)], texts


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_tool_round_trip_is_captured_token_exact_on_one_branch(tokenizer, anyio_backend, stream):
    model = hermes(tokenizer)
    engine = ScriptedEngine.from_replies(model, CALL_TEXT, "It is 5.")
    async with serve_capture(engine, model) as server, server.session("t0_0") as session:
        (first, second), texts = await in_thread(lambda: round_trip(session.anthropic_base_url, stream=stream))

    text, tool_use = first.content
    assert (text.type, text.text) == ("text", "Let me add.")
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "add", {"a": 2, "b": 3})
    assert tool_use.id.startswith("toolu_")
    assert (first.stop_reason, first.stop_sequence) == ("tool_use", None)
    assert [(b.type, b.text) for b in second.content] == [("text", "It is 5.")]
    assert second.stop_reason == "end_turn"
    if stream:
        assert texts == ["Let me add.", "It is 5."]  # the streamed text is the engine's
    # The first prompt is chat completions' render of the same conversation and tools (no `strict` leaks in).
    system = {"role": "system", "content": SYSTEM}
    assert engine.calls[0].prompt_token_ids == chat_prompt(model, [system, {"role": "user", "content": QUESTION}])
    sampled = [c.sampled_ids for c in session.calls]
    assert sampled[0] == [*model.encode(CALL_TEXT, add_special_tokens=False), model.eos_token_id]
    assert sampled[1] == [*model.encode("It is 5.", add_special_tokens=False), model.eos_token_id]
    for message, call, engine_call in zip((first, second), session.calls, engine.calls, strict=True):
        assert (message.usage.input_tokens, message.usage.output_tokens) == (
            len(engine_call.prompt_token_ids),
            len(call.sampled_ids),
        )
    # One branch: the second prompt is the first prompt, its sampled ids as they were, then the template's tail.
    tail = engine.calls[1].prompt_token_ids[len(engine.calls[0].prompt_token_ids) + len(sampled[0]) :]
    assert engine.calls[1].prompt_token_ids == engine.calls[0].prompt_token_ids + sampled[0] + tail
    tail_text = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert model.decode(tail) == tail_text
    (branch,) = session.capture.branches
    assert [c.extended for c in session.calls] == [False, True]
    assert branch.prompt_ids == engine.calls[0].prompt_token_ids
    assert branch.response_ids == sampled[0] + tail + sampled[1]
    assert branch.loss_mask == [1] * len(sampled[0]) + [0] * len(tail) + [1] * len(sampled[1])


async def test_a_conversation_started_on_chat_completions_continues_on_messages_on_one_branch(tokenizer, anyio_backend):
    model = hermes(tokenizer)
    engine = ScriptedEngine.from_replies(model, "Five.", "Ten.")
    async with serve_capture(engine, model) as server, server.session("t0_0") as session:
        await chat(session.base_url, messages=[{"role": "user", "content": QUESTION}])

        def messages() -> Any:
            with messages_client(session.anthropic_base_url) as client:
                return client.messages.create(
                    model="m",
                    max_tokens=8,
                    messages=[
                        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
                        {"role": "assistant", "content": "Five."},
                        {"role": "user", "content": "And 5 + 5?"},
                    ],
                )

        reply = await in_thread(messages)
    assert reply.content[0].text == "Ten."
    assert [c.extended for c in session.calls] == [False, True]
    assert len(session.capture.branches) == 1


async def test_a_conversation_through_chat_completions_then_responses_then_messages_is_one_branch(
    tokenizer, anyio_backend
):
    # Issue 35: one session, a tool turn, each call through another API's official client; the three
    # renders extend one branch, so every sampled id is trained on (mask 1) and nothing else is.
    import openai

    model = hermes(tokenizer)
    engine = ScriptedEngine.from_replies(model, CALL_TEXT, "Five.", "Ten.")
    function = ADD_TOOL[0]["function"]
    async with serve_capture(engine, model) as server, server.session("t0_0") as session:
        system: Any = {"role": "system", "content": SYSTEM}
        first = await chat(session.base_url, messages=[system, {"role": "user", "content": QUESTION}], tools=ADD_TOOL)
        text = first.choices[0].message.content
        (call,) = first.choices[0].message.tool_calls
        arguments = call.function.arguments

        def later() -> tuple[Any, Any]:
            with openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
                second = client.responses.create(
                    model="m",
                    instructions=SYSTEM,
                    input=[
                        {"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": text},
                        {
                            "type": "function_call",
                            "call_id": call.id,
                            "name": "add",
                            "arguments": call.function.arguments,
                        },
                        {"type": "function_call_output", "call_id": call.id, "output": "5"},
                    ],
                    tools=[cast(Any, {"type": "function", "strict": True, **function})],
                )
            tool_use: Any = {"type": "tool_use", "id": call.id, "name": "add", "input": json.loads(arguments)}
            with messages_client(session.anthropic_base_url) as client:
                third = client.messages.create(
                    model="m",
                    max_tokens=8,
                    system=SYSTEM,
                    tools=[ADD],
                    messages=[
                        {"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": [{"type": "text", "text": text}, tool_use]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]},
                        {"role": "assistant", "content": second.output_text},
                        {"role": "user", "content": "And 5 + 5?"},
                    ],
                )
            return second, third

        second, third = await anyio.to_thread.run_sync(later)
    assert (second.output_text, third.content[0].text) == ("Five.", "Ten.")
    assert [c.extended for c in session.calls] == [False, True, True]
    (branch,) = session.capture.branches
    sampled = [i for c in session.calls for i in c.sampled_ids]
    assert [i for i, m in zip(branch.response_ids, branch.loss_mask, strict=True) if m == 1] == sampled
    replies = (CALL_TEXT, "Five.", "Ten.")
    assert sampled == [i for r in replies for i in [*model.encode(r, add_special_tokens=False), model.eos_token_id]]
    # Each engine prompt is the branch so far: what the call before sampled, then the template's tail.
    for k, engine_call in enumerate(engine.calls):
        assert engine_call.prompt_token_ids == session.calls[k].prompt_ids
    assert engine.calls[2].prompt_token_ids[: len(engine.calls[1].prompt_token_ids)] == engine.calls[1].prompt_token_ids


async def test_the_key_reaches_the_session_as_x_api_key_or_bearer_with_any_version_beta_and_query(
    tokenizer, anyio_backend
):
    engine = ScriptedEngine.from_replies(tokenizer, "one", "two", "three")
    user: Any = [{"role": "user", "content": "Say hello."}]
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:

        def clients() -> list[Any]:
            # Bearer (the SDK's api_key) on the endpoint's root; the beta resource adds ?beta=true and anthropic-beta.
            with messages_client(server.url, session.api_key) as bearer:
                first = bearer.messages.create(model="m", max_tokens=8, messages=user)
                beta = bearer.beta.messages.create(model="m", max_tokens=8, messages=user, betas=["x-2099-01-01"])
                counted = bearer.messages.count_tokens(model="m", messages=user)
            return [first, beta, counted]

        first, beta, counted = await in_thread(clients)
        # x-api-key as Claude-Code-style clients send it, with another anthropic-version.
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{server.url}/v1/messages?beta=true",
                headers={"x-api-key": session.api_key, "anthropic-version": "2026-10-21", "anthropic-beta": "a,b"},
                json={"model": "m", "max_tokens": 8, "messages": user},
            )
    assert [first.content[0].text, beta.content[0].text, answer.json()["content"][0]["text"]] == ["one", "two", "three"]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert counted.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert [c.prompt_token_ids for c in engine.calls] == [tokenizer.encode(prompt, add_special_tokens=False)] * 3


async def test_stop_reasons_and_sampling_fields(tokenizer, anyio_backend):
    stopped = tokenizer.encode("1, 2, 3 END", add_special_tokens=False)  # a stop string, no EOS: as vLLM returns it
    engine = ScriptedEngine.from_replies(
        tokenizer, Reply("1, 2, 3 END", token_ids=stopped), Reply("1, 2", stop_reason="length")
    )
    user: Any = [{"role": "user", "content": "Count."}]
    base = {"max_generate_length": 64}
    async with serve_capture(engine, tokenizer) as server, server.session("a", sampling_params=base) as session:

        def calls() -> list[Any]:
            with messages_client(session.anthropic_base_url) as client:
                request: dict[str, Any] = {"model": "m", "max_tokens": 7, "messages": user}
                # This client's create() has no sampling arguments (older ones had); other clients send them.
                sampling = {"temperature": 0.3, "top_p": 0.9, "top_k": 5}
                return [
                    client.messages.create(
                        **request, stop_sequences=["ZZ", "END"], metadata={"user_id": "u"}, extra_body=sampling
                    ),
                    client.messages.create(**request),
                ]

        by_stop, by_length = await in_thread(calls)
    assert (by_stop.stop_reason, by_stop.stop_sequence, by_stop.content[0].text) == (
        "stop_sequence",
        "END",
        "1, 2, 3 END",
    )
    assert (by_length.stop_reason, by_length.stop_sequence) == ("max_tokens", None)
    assert engine.calls[0].sampling_params == {
        "max_generate_length": 7,
        "logprobs": 1,
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["ZZ", "END"],
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "The"}]}, "messages[1]"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"temperature": -1.0}, "temperature"),
        ({"best_of": 3}, "best_of"),
    ],
)
async def test_a_field_that_cannot_be_honoured_is_refused_with_a_400_naming_it(tokenizer, anyio_backend, fields, param):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answer = await create(session.anthropic_base_url, messages=HI, extra_body=fields)
    error = anthropic_error(answer, 400)
    assert error["type"] == "invalid_request_error"
    assert f"`{param}`" in error["message"]
    assert engine.calls == []


async def test_an_engine_failure_and_a_body_that_is_not_json_answer_in_anthropics_error_shape(tokenizer, anyio_backend):
    def failing(call: EngineCall) -> str:
        raise RuntimeError("the engine broke")

    engine = ScriptedEngine(tokenizer, failing)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        failed = await create(session.anthropic_base_url, messages=HI)
        async with httpx.AsyncClient() as http:
            not_json = await http.post(f"{session.anthropic_base_url}/v1/messages", content=b"{not json")
    assert isinstance(failed, anthropic.InternalServerError)
    # Final, as on every route: the engine client has retried already; the SDK's retries would resend it.
    assert failed.response.headers["x-should-retry"] == "false"
    assert len(engine.calls) == 1
    assert failed.response.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine failed: RuntimeError: the engine broke"},
    }
    assert (not_json.status_code, not_json.headers["x-should-retry"]) == (400, "false")
    assert not_json.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the request body is not valid JSON"},
    }


async def test_an_ended_session_answers_in_anthropics_error_shape_and_the_client_does_not_retry(
    tokenizer, anyio_backend
):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    sent: list[Any] = []
    async with serve_capture(engine, tokenizer) as server:
        async with server.session("t3_1") as session:
            pass

        def late() -> Any:
            http = httpx2.Client(event_hooks={"request": [sent.append]})
            with anthropic.Anthropic(
                base_url=session.anthropic_base_url,
                api_key=session.api_key,
                max_retries=5,
                http_client=http,
            ) as client:
                return client.messages.create(model="m", max_tokens=8, messages=HI)

        answer = await in_thread(late)
        unknown = await create(f"{server.url}/sessions/nope", messages=HI)
        with_v1 = await create(session.base_url, messages=HI)  # the chat base URL: /v1/v1/messages
    assert isinstance(answer, anthropic.NotFoundError)
    error = anthropic_error(answer, 404)
    assert error["type"] == "not_found_error"  # Anthropic's type (issue 47); the message names the rollout
    assert "rollout t3_1 has ended" in error["message"]
    assert session.id in error["message"]
    assert len(sent) == 1  # a 5xx would have been sent 6 times
    assert "`nope`" in anthropic_error(unknown, 404)["message"]
    assert "base_url is the session's root, without /v1" in anthropic_error(with_v1, 404)["message"]
    assert engine.calls == []


async def test_an_in_flight_call_on_a_cancelled_rollout_gets_499(tokenizer, anyio_backend):
    blocked = Blocked()
    engine = ScriptedEngine(tokenizer, blocked)
    answers: list[Any] = []
    async with serve_capture(engine, tokenizer) as server, anyio.create_task_group() as group:
        with anyio.CancelScope() as rollout_scope:
            async with server.session("t7_0") as session:

                async def agent() -> None:
                    answers.append(await create(session.anthropic_base_url, messages=HI, stream=True))

                group.start_soon(agent)
                await blocked.entered.wait()
                rollout_scope.cancel()
                await anyio.sleep_forever()
    assert blocked.cancelled.is_set()
    (answer,) = answers
    error = anthropic_error(answer, 499)
    assert error["type"] == "api_error"
    assert "rollout t7_0 ended (cancelled)" in error["message"]
    assert session.calls == []


SCRIPT = textwrap.dedent(
    """
    import json, os
    import anthropic

    client = anthropic.Anthropic(max_retries=0, timeout=120.0)  # ANTHROPIC_BASE_URL and _API_KEY
    messages = json.loads(os.environ["SKYRL_AGENT_PROMPT"])
    reply = client.messages.create(model=os.environ["OPENAI_MODEL"], max_tokens=8, messages=messages)
    print(json.dumps({"reward": 1.0 if reply.content[0].text == "3" else 0.5}))
    """
)


async def test_a_command_agent_finds_the_session_through_the_anthropic_variables(tokenizer, anyio_backend, tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(SCRIPT, encoding="utf-8")
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    agent = command_agent([sys.executable, str(Path(path))])
    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(1))
    assert [r[-1] for r in out["rewards"]] == [1.0]  # type: ignore[index]
    assert out["response_ids"] == [[*tokenizer.encode("3", add_special_tokens=False), tokenizer.eos_token_id]]


def test_check_capture_covers_tool_turns_written_in_messages_shape(tokenizer):
    model = hermes(tokenizer)
    chat_check = check_capture(model)
    messages_check = check_capture(model, api="messages")
    assert messages_check.append_only
    assert (messages_check.branches, len(messages_check.calls)) == (1, 3)
    assert [c.extended for c in messages_check.calls] == [c.extended for c in chat_check.calls]
    stripping = check_capture(with_template(tokenizer, hermes_template(strip_think=True)), api="messages")
    assert [c.extended for c in stripping.calls] == [False, True, False]
    assert str(chat_check).endswith("\nwritten as messages requests: the same, call by call")
    with pytest.raises(ValueError, match="`api` must be one of 'chat', 'responses', 'messages', got 'grpc'"):
        check_capture(model, api="grpc")  # type: ignore[arg-type]


def test_the_streamed_events_each_carry_an_event_line():
    from skyrl_structured.agents._wire.messages import message_stream

    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "add", "input": {"a": 1}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    events = [e.split("\n") for e in message_stream(message).decode().strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_stop"] * 2,
        "message_delta",
        "message_stop",
    ]
    assert [json.loads(lines[1].removeprefix("data: "))["type"] for lines in events] == names
    deltas = [json.loads(lines[1].removeprefix("data: ")) for lines in events if lines[0].endswith("_delta")]
    assert deltas[0]["delta"] == {"type": "text_delta", "text": "a"}
    assert deltas[1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert deltas[2]["usage"] == {"input_tokens": 3, "output_tokens": 2}
