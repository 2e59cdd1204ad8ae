"""The capture endpoint through the official ``openai`` client: token identity, branches, tool calls, errors.

Real HTTP on 127.0.0.1, the server in the test's event loop (asyncio and trio), the client in a worker
thread, a :class:`ScriptedEngine` behind it. Nothing here waits on time.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from skyrl_structured.agents import check_capture, serve_capture
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

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Say hello."}]


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized one character at a time: the same text, not the tokenizer's canonical ids."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


async def test_sampled_ids_are_reused_exactly_and_only_new_messages_are_rendered(tokenizer, anyio_backend):
    # The engine samples "hello world" in a non-canonical tokenization: re-tokenizing its text would change them.
    sampled = [*char_ids(tokenizer, "hello world"), tokenizer.eos_token_id]
    assert sampled[:-1] != tokenizer.encode("hello world", add_special_tokens=False)
    logprobs = [-0.1 * (k + 1) for k in range(len(sampled))]
    engine = ScriptedEngine.from_replies(
        tokenizer, Reply("hello world", token_ids=sampled, logprobs=logprobs), "second"
    )
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        first = await chat(session.base_url, messages=USER)
        assert first.choices[0].message.content == "hello world"
        assert first.choices[0].finish_reason == "stop"
        assert first.usage.completion_tokens == len(sampled)
        history = [*USER, {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "Again."}]
        second = await chat(session.base_url, messages=history)
        assert second.choices[0].message.content == "second"

    prompt0 = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert engine.calls[0].prompt_token_ids == tokenizer.encode(prompt0, add_special_tokens=False)
    tail_text = "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    tail = tokenizer.encode(tail_text, add_special_tokens=False)
    assert engine.calls[1].prompt_token_ids == engine.calls[0].prompt_token_ids + sampled + tail
    assert next(c.sampled_ids for c in session.calls) == sampled
    assert session.calls[0].logprobs == logprobs
    (branch,) = session.capture.branches
    second_ids = engine.calls[1].prompt_token_ids
    assert branch.prompt_ids + branch.response_ids == second_ids + session.calls[1].sampled_ids
    assert branch.loss_mask == [1] * len(sampled) + [0] * len(tail) + [1] * len(session.calls[1].sampled_ids)
    assert branch.logprobs[: len(sampled)] == logprobs
    assert branch.logprobs[len(sampled) : len(sampled) + len(tail)] == [0.0] * len(tail)
    assert session.closes == 1
    assert engine.finished_sessions == [session.id]


async def test_a_rewritten_history_starts_a_branch_from_the_whole_render(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "one", "two")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        await chat(session.base_url, messages=USER)
        rewritten = [{"role": "user", "content": "Summary: the user asked for hello."}]
        await chat(session.base_url, messages=rewritten)
    text = tokenizer.apply_chat_template(rewritten, add_generation_prompt=True, tokenize=False)
    assert engine.calls[1].prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert [c.extended for c in session.calls] == [False, False]
    assert [b.prompt_ids for b in session.capture.branches] == [c.prompt_token_ids for c in engine.calls]


async def test_a_think_stripping_template_branches_instead_of_training_on_wrong_tokens(tokenizer, anyio_backend):
    qwen3_like = with_template(tokenizer, hermes_template(strip_think=True))
    engine = ScriptedEngine.from_replies(qwen3_like, "<think>\nmull\n</think>\n\nhello", "bye")
    async with serve_capture(engine, qwen3_like) as server, server.session("t0_0") as session:
        reply = await chat(session.base_url, messages=USER)
        history = [*USER, {"role": "assistant", "content": reply.choices[0].message.content}]
        await chat(session.base_url, messages=[*history, {"role": "user", "content": "Again."}])
    assert [c.extended for c in session.calls] == [False, False]
    assert len(session.capture.branches) == 2
    # The second branch is exactly what the engine saw: the stripped render, no stale think tokens.
    assert session.capture.branches[1].prompt_ids == engine.calls[1].prompt_token_ids
    assert "mull" not in qwen3_like.decode(engine.calls[1].prompt_token_ids)
    report = check_capture(qwen3_like)
    assert not report.append_only
    assert [c.extended for c in report.calls] == [False, True, False]
    assert "call 2: branches" in str(report)


async def test_tool_calls_are_parsed_and_the_tool_turn_extends_the_branch(tokenizer, anyio_backend):
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    call_text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = ScriptedEngine.from_replies(hermes, call_text, "It is 5.")
    async with serve_capture(engine, hermes) as server, server.session("t0_0") as session:

        def agent() -> list[Any]:
            with client(session.base_url) as c:
                first = c.chat.completions.create(model="m", messages=USER, tools=ADD_TOOL)  # type: ignore[arg-type]
                message = first.choices[0].message
                (tool_call,) = message.tool_calls or []
                history = [
                    *USER,
                    message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
                ]
                second = c.chat.completions.create(model="m", messages=history, tools=ADD_TOOL)  # type: ignore[arg-type]
                return [first, second]

        first, second = await in_thread(agent)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function"
    assert tool_call.function.name == "add"
    assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 3}
    assert tool_call.id.startswith("call_")
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    # The template got the tools, and re-serialises the call as the model wrote it: one branch.
    assert '"name": "add"' in hermes.decode(engine.calls[0].prompt_token_ids)
    assert [c.extended for c in session.calls] == [False, True]
    assert engine.calls[1].prompt_token_ids[: len(engine.calls[0].prompt_token_ids)] == engine.calls[0].prompt_token_ids
    assert check_capture(hermes).append_only


async def test_sampling_fields_are_mapped_onto_the_engines_params(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    async with serve_capture(engine, tokenizer) as server:
        async with server.session("a", sampling_params={"max_generate_length": 64, "top_k": 5}) as session:
            await chat(
                session.base_url,
                messages=USER,
                temperature=0.3,
                top_p=0.9,
                max_completion_tokens=7,
                stop=["\n"],
                seed=11,
                extra_body={"min_p": 0.1},
            )
        async with server.session("b", sampling_params={"max_tokens": 64}) as session:
            await chat(session.base_url, messages=USER, max_tokens=9, stop="END")
    assert engine.calls[0].sampling_params == {
        "max_generate_length": 7,
        "top_k": 5,
        "logprobs": 1,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": ["\n"],
        "seed": 11,
        "min_p": 0.1,
    }
    assert engine.calls[1].sampling_params == {"max_tokens": 9, "logprobs": 1, "stop": ["END"]}


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "tools": ADD_TOOL}, "tool_choice"),
        ({"temperature": -1.0}, "temperature"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
)
async def test_a_field_that_cannot_be_honoured_is_refused_with_a_400_naming_it(
    tokenizer, anyio_backend, request_fields, param
):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answer = await chat(session.base_url, messages=USER, **request_fields)
    error = error_of(answer)
    assert answer.status_code == 400
    assert error["param"] == param
    assert f"`{param}`" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert engine.calls == []


async def test_unknown_ended_and_unnamed_sessions_get_a_404_no_client_retries(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    async with serve_capture(engine, tokenizer) as server:
        async with server.session("t3_1") as session:
            ok = await chat(f"{server.url}/v1", api_key=session.api_key, messages=USER)  # the API key names it
            assert ok.choices[0].message.content == "ok"
        gone = await chat(session.base_url, messages=USER)
        gone_by_key = await chat(f"{server.url}/v1", api_key=session.api_key, messages=USER)
        unknown = await chat(f"{server.url}/sessions/nope/v1", messages=USER)
        unnamed = await chat(f"{server.url}/v1", api_key="nope", messages=USER)
        models = await in_thread(lambda: client(f"{server.url}/sessions/nope/v1").models.list())
    for answer in (gone, gone_by_key):
        assert_rollout_ended(answer, "t3_1")
        assert session.id in error_of(answer)["message"]  # the public id, not the key
        assert session.api_key not in error_of(answer)["message"]
    for answer in (unknown, unnamed):
        assert answer.status_code == 404
        assert answer.response.headers["x-should-retry"] == "false"
        assert "`nope`" in error_of(answer)["message"]
    assert [m.id for m in models.data] == ["skyrl-agent"]
    assert len(engine.calls) == 1
    assert server.open_sessions == 0


async def test_closing_the_session_answers_its_in_flight_request_499_and_cancels_the_engine_call(
    tokenizer, anyio_backend
):
    entered = anyio.Event()
    cancelled = anyio.Event()

    async def blocked(call: EngineCall) -> str:
        entered.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    engine = ScriptedEngine(tokenizer, blocked)
    answers: list[Any] = []
    async with serve_capture(engine, tokenizer) as server:
        async with anyio.create_task_group() as group:
            with anyio.CancelScope() as rollout_scope:
                async with server.session("t7_0") as session:

                    async def agent() -> None:
                        answers.append(await chat(session.base_url, messages=USER))

                    group.start_soon(agent)
                    await entered.wait()
                    rollout_scope.cancel()
                    await anyio.sleep_forever()
        late = await chat(session.base_url, messages=USER)
    assert cancelled.is_set()
    (answer,) = answers
    assert answer.status_code == 499
    assert "t7_0" in error_of(answer)["message"]
    assert session.closes == 1
    assert session.close_reason == "cancelled"
    assert_rollout_ended(late, "t7_0")
    assert len(engine.calls) == 1


async def test_a_client_that_disconnects_cancels_its_engine_request(tokenizer, anyio_backend):
    entered = anyio.Event()
    cancelled = anyio.Event()

    async def blocked(call: EngineCall) -> str:
        entered.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    engine = ScriptedEngine(tokenizer, blocked)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        body = json.dumps({"model": "m", "messages": USER}).encode()
        path = f"/sessions/{session.api_key}/v1/chat/completions"
        head = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        await stream.send(head.encode() + body)
        await entered.wait()
        await stream.aclose()
        await cancelled.wait()
        assert session.calls == []  # nothing recorded for an abandoned request


async def test_streaming_sends_the_same_reply_as_chunks_and_captures_the_same_ids(tokenizer, anyio_backend):
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    call_text = 'On it.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    engine = ScriptedEngine.from_replies(hermes, "hello world", call_text)
    async with serve_capture(engine, hermes) as server, server.session("t0_0") as session:

        def agent() -> list[list[Any]]:
            with client(session.base_url) as c:
                plain = c.chat.completions.create(  # type: ignore[call-overload]
                    model="m", messages=USER, stream=True, stream_options={"include_usage": True}
                )
                first = list(plain)
                tools = c.chat.completions.create(model="m", messages=USER, tools=ADD_TOOL, stream=True)  # type: ignore[arg-type]
                return [first, list(tools)]

        plain, tools = await in_thread(agent)
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == "hello world"
    assert [c.choices[0].finish_reason for c in plain if c.choices][-1] == "stop"
    assert plain[-1].usage.completion_tokens == len(session.calls[0].sampled_ids)
    assert session.calls[0].sampled_ids == [
        *hermes.encode("hello world", add_special_tokens=False),
        hermes.eos_token_id,
    ]
    assert "".join(c.choices[0].delta.content or "" for c in tools) == "On it."
    (call,) = [t for c in tools for t in c.choices[0].delta.tool_calls or []]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "add", {"a": 1, "b": 2})
    assert tools[-1].choices[0].finish_reason == "tool_calls"
    assert tools[-1].usage is None


async def test_concurrent_calls_of_one_session_never_splice_ids_the_engine_did_not_see(tokenizer, anyio_backend):
    both_in = anyio.Event()
    release = anyio.Event()
    waiting: list[EngineCall] = []
    seen: list[EngineCall] = []

    async def handler(call: EngineCall) -> str:
        seen.append(call)
        if len(seen) == 1:
            return "a"  # the first call: answered at once
        waiting.append(call)
        if len(waiting) == 2:
            both_in.set()
        await release.wait()
        return f"reply {len(call.prompt_token_ids)}"

    engine = ScriptedEngine(tokenizer, handler)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        await chat(session.base_url, messages=USER)
        history = [*USER, {"role": "assistant", "content": "a"}]

        async def follow(text: str) -> None:
            await chat(session.base_url, messages=[*history, {"role": "user", "content": text}])

        async with anyio.create_task_group() as group:
            for follow_up in ("x", "a longer follow-up"):
                group.start_soon(follow, follow_up)
            await both_in.wait()
            release.set()
    # Both calls were prepared as extensions of branch 0; the one recorded second became its own branch.
    assert len(session.calls) == 3
    assert [c.extended for c in session.calls].count(True) == 1
    assert len(session.capture.branches) == 2
    for branch in session.capture.branches:
        last = [c for c in session.calls if c.branch == session.capture.branches.index(branch)][-1]
        assert branch.prompt_ids + branch.response_ids == last.prompt_ids + last.sampled_ids
    assert sorted(map(tuple, (c.prompt_ids for c in session.calls))) == sorted(
        map(tuple, (c.prompt_token_ids for c in engine.calls))
    )


async def _raw(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """One HTTP/1.1 request on a fresh connection; the status and the JSON body."""
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(head.encode() + body)
        data = b""
        while True:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                break
    header, _, payload = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), json.loads(payload)


async def test_malformed_requests_get_openai_error_bodies(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        base = f"/sessions/{session.api_key}/v1"
        answers = {
            "not json": await _raw(server.port, "POST", f"{base}/chat/completions", b"{nope"),
            "not an object": await _raw(server.port, "POST", f"{base}/chat/completions", b"[1]"),
            "no messages": await _raw(server.port, "POST", f"{base}/chat/completions", b"{}"),
            "bad part": await _raw(
                server.port,
                "POST",
                f"{base}/chat/completions",
                json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
            ),
            "GET completions": await _raw(server.port, "GET", f"{base}/chat/completions"),
            "unknown route": await _raw(server.port, "POST", f"{base}/embeddings", b"{}"),
        }
    assert {what: status for what, (status, _) in answers.items()} == {
        "not json": 400,
        "not an object": 400,
        "no messages": 400,
        "bad part": 400,
        "GET completions": 405,
        "unknown route": 404,
    }
    for _, body in answers.values():
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert answers["no messages"][1]["error"]["param"] == "messages"
    assert answers["bad part"][1]["error"]["param"] == "messages[0].content[0]"
    assert engine.calls == []
