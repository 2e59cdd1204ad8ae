"""A prompt longer than the model's context is answered in its API's own error, not a 500 (issue 45, behaviour 2).

Coding agents act on these answers: Claude Code compacts its history on Anthropic's 400
``invalid_request_error`` "prompt is too long: N tokens > M maximum"; OpenAI clients read the 400's
``code: "context_length_exceeded"``. Both paths: the endpoint told the context length (refused before any
engine call), and an engine that refuses the prompt as vLLM does. Official clients, real HTTP, asyncio and trio.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from skyrl_structured.agents import AgentContext, StructuredAgentGenerator, serve_capture
from skyrl_structured.cli._config import load_config
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines.errors import EngineHTTPError
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm
from skyrl_structured.types import TrajectoryID
from tests._agents import client, in_thread

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "Tell me everything about the capital of France, in detail."}]
#: vLLM's refusal of a prompt over ``max_model_len`` (its engine's check on a token prompt).
VLLM_REFUSAL = (
    "The decoder prompt (length {n}) is longer than the maximum model length of 16. Make sure that "
    "`max_model_len` is no smaller than the number of text tokens."
)


def prompt_length(tokenizer: Any) -> int:
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def refusing_engine(tokenizer: Any) -> ScriptedEngine:
    """An engine that refuses every prompt as a vLLM server with ``max_model_len=16`` does (HTTP 400)."""

    def refuse(call: EngineCall) -> str:
        raise EngineHTTPError("http://vllm:8000", 400, VLLM_REFUSAL.format(n=len(call.prompt_token_ids)))

    return ScriptedEngine(tokenizer, refuse)


async def openai_answers(base_url: str) -> dict[str, Any]:
    """The same too-long conversation sent to each OpenAI API: the error each raised."""

    def work() -> dict[str, Any]:
        answers: dict[str, Any] = {}
        with client(base_url) as c:
            for api, call in {
                "chat": lambda: c.chat.completions.create(model="m", messages=QUESTION),  # type: ignore[arg-type]
                "responses": lambda: c.responses.create(model="m", input=QUESTION[0]["content"]),
                "completions": lambda: c.completions.create(model="m", prompt=list(range(40, 90))),
            }.items():
                try:
                    call()
                except openai.APIStatusError as exc:
                    answers[api] = exc
        return answers

    return dict(await in_thread(work))


async def anthropic_answer(base_url: str, *, count: bool = False) -> Any:
    def work() -> Any:
        with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120.0) as c:
            if count:
                return c.messages.count_tokens(model="m", messages=QUESTION)  # type: ignore[arg-type]
            return c.messages.create(model="m", max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]

    return await in_thread(work, anthropic.APIStatusError)


def assert_openai_too_long(answers: dict[str, Any], tokens: dict[str, int], maximum: int) -> None:
    assert set(answers) == {"chat", "responses", "completions"}
    for api, param in (("chat", "messages"), ("responses", "input"), ("completions", "prompt")):
        answer = answers[api]
        assert isinstance(answer, openai.BadRequestError), (api, answer)
        error = answer.response.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            "context_length_exceeded",
            "invalid_request_error",
            param,
        )
        assert error["message"].startswith(
            f"This model's maximum context length is {maximum} tokens. However, your request has {tokens[api]} input"
        )
        assert answer.response.headers["x-should-retry"] == "false"


async def test_a_known_context_length_refuses_a_longer_prompt_before_the_engine(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "never sent")
    n = prompt_length(tokenizer)
    assert n > 16
    async with serve_capture(engine, tokenizer, context_length=16) as server, server.session("t0_0") as session:
        answers = await openai_answers(session.base_url)
        refused = await anthropic_answer(session.anthropic_base_url)
        counted = await anthropic_answer(session.anthropic_base_url, count=True)
    assert_openai_too_long(answers, {"chat": n, "responses": n, "completions": 50}, 16)
    assert isinstance(refused, anthropic.BadRequestError), refused
    assert refused.response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > 16 maximum"},
    }
    assert counted.input_tokens == n  # counting a prompt is not sending it
    assert engine.calls == []
    assert session.calls == []


async def test_the_engines_refusal_of_a_too_long_prompt_is_the_apis_own_error(tokenizer, anyio_backend):
    engine = refusing_engine(tokenizer)
    n = prompt_length(tokenizer)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answers = await openai_answers(session.base_url)
        refused = await anthropic_answer(session.anthropic_base_url)
    assert_openai_too_long(answers, {"chat": n, "responses": n, "completions": 50}, 16)
    assert isinstance(refused, anthropic.BadRequestError), refused
    assert refused.response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > 16 maximum"},
    }
    assert len(engine.calls) == 4  # each request reached the engine once: a 400 is not retried
    assert session.calls == []


async def test_a_vllm_servers_400_for_a_too_long_prompt_is_the_apis_own_error(tokenizer, anyio_backend):
    """The same through :class:`HTTPEngine` and a real HTTP server answering as vLLM does (its 400 body)."""
    refused: list[int] = []

    def too_long(request: ServedRequest) -> RawResponse | None:
        if request.method != "POST" or not isinstance(request.body, dict):
            return None
        ids = request.body.get("token_ids") or request.body.get("prompt") or []
        refused.append(len(ids))
        return RawResponse.vllm_error(400, VLLM_REFUSAL.format(n=len(ids)), "BadRequestError")

    n = prompt_length(tokenizer)
    served = ScriptedEngine.from_replies(tokenizer, "never sampled")
    async with (
        serve_vllm(served, model="tiny", intercept=too_long) as vllm,
        HTTPEngine(vllm.url, "tiny") as engine,
        serve_capture(engine, tokenizer) as server,
        server.session("t0_0") as session,
    ):
        answers = await openai_answers(session.base_url)
        anthropic_refusal = await anthropic_answer(session.anthropic_base_url)
    assert_openai_too_long(answers, {"chat": n, "responses": n, "completions": 50}, 16)
    assert isinstance(anthropic_refusal, anthropic.BadRequestError), anthropic_refusal
    assert anthropic_refusal.response.json()["error"]["message"] == f"prompt is too long: {n} tokens > 16 maximum"
    assert refused == [n, n, 50, n]  # each prompt reached the server once, as the engine's token ids
    assert served.calls == []


async def test_another_engine_failure_is_still_a_500(tokenizer, anyio_backend):
    def fail(call: EngineCall) -> str:
        raise EngineHTTPError("http://vllm:8000", 400, "`temperature` must be non-negative")

    engine = ScriptedEngine(tokenizer, fail)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        answers = await openai_answers(session.base_url)
    assert {api: answer.status_code for api, answer in answers.items()} == {
        "chat": 500,
        "responses": 500,
        "completions": 500,
    }
    assert all(answer.response.json()["error"]["code"] == 500 for answer in answers.values())


async def test_the_generators_agent_context_length_refuses_before_the_engine(tokenizer, anyio_backend):
    """``generator.agent_context_length`` (from the CLI's parser here) reaches the endpoint: an agent's too-long
    prompt is its API's 400 before any engine call; the agent compacts, as Claude Code does, and goes on."""
    n = prompt_length(tokenizer)
    short = [{"role": "user", "content": "Capital?"}]
    seen: list[Any] = []

    async def agent(ctx: AgentContext) -> float:
        seen.append(await anthropic_answer(ctx.anthropic_base_url))

        def compacted() -> Any:
            with anthropic.Anthropic(base_url=ctx.anthropic_base_url, api_key="unused", max_retries=0) as c:
                return c.messages.create(model="m", max_tokens=8, messages=short)  # type: ignore[arg-type]

        seen.append(await in_thread(compacted))
        return 0.25

    engine = ScriptedEngine.from_replies(tokenizer, "Paris.")
    cli = load_config(["agent=default", f"generator.agent_context_length={n - 1}"])
    generator = StructuredAgentGenerator.from_config(cli.generator, engine, tokenizer, agent)
    assert generator.endpoint.agent_context_length == n - 1
    output = await generator.generate(
        {"prompts": [QUESTION], "env_classes": ["agent"], "env_extras": [{}], "trajectory_ids": [TrajectoryID("t", 0)]}
    )
    refused, answered = seen
    assert isinstance(refused, anthropic.BadRequestError), refused
    assert refused.response.json()["error"]["message"] == f"prompt is too long: {n} tokens > {n - 1} maximum"
    assert answered.content[0].text == "Paris."
    (call,) = engine.calls  # only the compacted prompt reached the engine
    assert "Capital?" in tokenizer.decode(call.prompt_token_ids)
    assert output["prompt_token_ids"] == [call.prompt_token_ids]
    assert output["rewards"][0][-1] == 0.25  # type: ignore[index]


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "16"])
def test_a_bad_agent_context_length_is_refused_in_one_line(tokenizer, value):
    engine = ScriptedEngine.from_replies(tokenizer, "never sent")
    with pytest.raises(ValueError, match=r"`generator\.agent_context_length` must be the model's context length"):
        StructuredAgentGenerator(engine, tokenizer, lambda ctx: 0.0, agent_context_length=value)
