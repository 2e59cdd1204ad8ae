"""OpenAI's legacy ``POST /completions`` on the capture endpoint (issue 45), through the official ``openai`` client.

Real HTTP on 127.0.0.1, the server in the test's event loop (asyncio and trio), the client in a worker
thread, a :class:`ScriptedEngine` that samples non-canonical token ids (one character at a time), so a
re-tokenized prompt or reply would show. Nothing here waits on time.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from skyrl_structured.agents import serve_capture
from skyrl_structured.testing import Reply, ScriptedEngine
from tests._agents import client, in_thread

pytestmark = pytest.mark.anyio

FIRST = " Paris."
SECOND = " Rome."


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized one character at a time: ids the tokenizer itself would not choose for the whole text."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def two_replies(tokenizer: Any) -> tuple[ScriptedEngine, list[list[int]]]:
    sampled = [[*char_ids(tokenizer, FIRST), tokenizer.eos_token_id], char_ids(tokenizer, SECOND)]
    assert sampled[0][:-1] != encode(tokenizer, FIRST)
    replies = [Reply(FIRST, token_ids=sampled[0]), Reply(SECOND, stop_reason="length", token_ids=sampled[1])]
    return ScriptedEngine.from_replies(tokenizer, *replies), sampled


async def complete(base_url: str, **request: Any) -> Any:
    """One ``completions.create`` from a fresh client in a worker thread (a stream read whole): the reply's
    ``(text, finish_reason, usage)``, or the API error."""

    def work() -> Any:
        with client(base_url) as c:
            if not request.get("stream"):
                reply = c.completions.create(**{"model": "m", **request})
                assert reply.object == "text_completion"
                (choice,) = reply.choices
                return choice.text, choice.finish_reason, reply.usage
            chunks = list(c.completions.create(**{"model": "m", **request}))
            assert {chunk.object for chunk in chunks} == {"text_completion"}
            text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
            finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
            usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
            return text, finish[-1], usage[-1] if usage else None

    return await in_thread(work)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_token_id_prompts_are_taken_as_ids_and_extend_one_token_exact_branch(tokenizer, anyio_backend, stream):
    engine, sampled = two_replies(tokenizer)
    prompt = char_ids(tokenizer, "Q: the capital of France?\nA:")
    assert tokenizer.decode(prompt)
    assert prompt != encode(tokenizer, tokenizer.decode(prompt))
    follow = char_ids(tokenizer, "\nQ: and of Italy?\nA:")
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        one = await complete(session.base_url, prompt=prompt, max_tokens=8, stream=stream, **extra)
        two = await complete(
            session.base_url, prompt=prompt + sampled[0] + follow, max_tokens=8, stream=stream, **extra
        )
    assert (one[0], one[1]) == (FIRST, "stop")
    assert (two[0], two[1]) == (SECOND, "length")
    usages = [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in (one[2], two[2])]
    first_len, second_len = len(prompt), len(prompt) + len(sampled[0]) + len(follow)
    assert usages == [
        (first_len, len(sampled[0]), first_len + len(sampled[0])),
        (second_len, len(sampled[1]), second_len + len(sampled[1])),
    ]
    assert [c.prompt_token_ids for c in engine.calls] == [prompt, prompt + sampled[0] + follow]
    assert [(c.sampling_params or {}).get("max_generate_length") for c in engine.calls] == [8, 8]
    (branch,) = session.capture.branches
    assert branch.prompt_ids == prompt
    assert branch.response_ids == sampled[0] + follow + sampled[1]
    assert branch.loss_mask == [1] * len(sampled[0]) + [0] * len(follow) + [1] * len(sampled[1])
    assert [c.extended for c in session.calls] == [False, True]


async def test_a_text_prompt_is_tokenized_and_its_continuation_reuses_the_sampled_ids(tokenizer, anyio_backend):
    engine, sampled = two_replies(tokenizer)
    prompt = "Q: the capital of France?\nA:"
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        await complete(session.base_url, prompt=prompt, temperature=0.5, stop=["\n"])
        continued = prompt + tokenizer.decode(sampled[0]) + "\nQ: and of Italy?\nA:"
        await complete(session.base_url, prompt=continued)
    tail = encode(tokenizer, "\nQ: and of Italy?\nA:")
    assert engine.calls[0].prompt_token_ids == encode(tokenizer, prompt)
    assert engine.calls[1].prompt_token_ids == encode(tokenizer, prompt) + sampled[0] + tail
    params = engine.calls[0].sampling_params or {}
    assert (params["temperature"], params["stop"]) == (0.5, ["\n"])
    (branch,) = session.capture.branches
    assert branch.response_ids == sampled[0] + tail + sampled[1]


@pytest.mark.parametrize(
    ("request_fields", "param", "words"),
    [
        ({"prompt": ["one", "two"]}, "prompt", "is a batch of 2 prompts"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "is a batch of 2 prompts"),
        ({"prompt": []}, "prompt", "must be a string or a non-empty list of token ids"),
        ({"prompt": "Hi", "echo": True}, "echo", "cannot be honoured"),
        ({"prompt": "Hi", "logprobs": 2}, "logprobs", "cannot be honoured"),
        ({"prompt": "Hi", "n": 2}, "n", "cannot be honoured"),
    ],
    ids=["texts", "id-lists", "empty", "echo", "logprobs", "n"],
)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    tokenizer, anyio_backend, request_fields, param, words
):
    engine = ScriptedEngine.from_replies(tokenizer, "x")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answer = await complete(session.base_url, **request_fields)
    assert isinstance(answer, openai.BadRequestError), answer
    error = answer.response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert words in error["message"]
    assert engine.calls == []


async def test_a_completion_continuing_a_chat_call_extends_the_same_branch(tokenizer, anyio_backend):
    """One branch whatever the API (design rule 23): a completion whose text prompt starts with a chat call's
    render and the text it sampled extends that call's branch, its sampled ids reused as they are."""
    engine, sampled = two_replies(tokenizer)
    messages = [{"role": "user", "content": "The capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    follow = "\nAnd of Italy?"

    def chat_then_complete(base_url: str) -> None:
        with client(base_url) as c:
            c.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            c.completions.create(model="m", prompt=rendered + tokenizer.decode(sampled[0]) + follow)

    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        await in_thread(lambda: chat_then_complete(session.base_url))
    prompt = encode(tokenizer, rendered)
    tail = encode(tokenizer, follow)
    assert [c.prompt_token_ids for c in engine.calls] == [prompt, prompt + sampled[0] + tail]
    assert [c.extended for c in session.calls] == [False, True]
    (branch,) = session.capture.branches
    assert branch.response_ids == sampled[0] + tail + sampled[1]
    assert branch.loss_mask == [1] * len(sampled[0]) + [0] * len(tail) + [1] * len(sampled[1])
