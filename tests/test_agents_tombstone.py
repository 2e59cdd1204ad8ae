"""A closed capture endpoint keeps answering agent threads abandoned on it, with the 404 no client retries.

Design rule 22: an ended session answers with a status its clients do not retry. The endpoint closes with
the ``generate()`` call that opened it (SkyRL's trainer runs without ``generator.serving()``); an abandoned
sync agent that calls after that gets the ended session's 404 from the port's tombstone instead of a refused
connection, which the ``openai`` client and LiteLLM retry. On asyncio and trio, with real sockets, the real
``openai`` client (its default two retries on) and LiteLLM where installed. Once the last abandoned call has
returned, the tombstone's thread is gone and the port refuses connections.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import openai
import pytest

from skyrl_structured._runtime.completion import Completion
from skyrl_structured.agents import AgentContext, CaptureServer, CaptureSession, StructuredAgentGenerator, serve_capture
from skyrl_structured.envs._threads import wait_env_thread_calls
from skyrl_structured.testing import ScriptedEngine
from tests._agents import (
    CLEANUP_S,
    DEADLINE,
    HANG_S,
    Blocker,
    assert_closed,
    assert_rollout_ended,
    chat,
    client,
    close_litellm_clients,
    error_of,
    generate_paused_until,
    placeholder,
    port_of,
    refused,
    row,
    tombstones,
)
from tests._http import parse_answers

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]
#: What only the closed endpoint's tombstone says (the live endpoint's 404 says the rollout ended, not the call).
CALL_ENDED = "and so has the generate() call (or generator.serving() block) that served it; stop the agent"


@asynccontextmanager
async def closed_endpoint(tokenizer: Any) -> AsyncIterator[tuple[CaptureServer, CaptureSession, Completion[None]]]:
    """An endpoint closed while a call abandoned on its session ``t0_0`` still runs (the yielded completion: settle
    it to end the call); it is settled on exit."""
    call: Completion[None] = Completion()
    engine = ScriptedEngine.from_replies(tokenizer, "ok")
    try:
        async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
            session.outlived_by(call)
        yield server, session, call
    finally:
        call.settle(None)


async def exchange(port: int, *parts: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``parts`` on one connection (after the first, each once an interim answer came), read until the server
    closes it; the answers as ``(status, headers, body)``."""
    data = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        with anyio.fail_after(HANG_S):
            for k, part in enumerate(parts):
                while k and data.count(b"\r\n\r\n") < k:  # the interim answer (100 Continue) before the next part
                    data += await stream.receive()
                await stream.send(part)
            while True:
                try:
                    data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return parse_answers(data)


def assert_ended_answer(answer: tuple[int, dict[str, str], bytes], message: str) -> dict[str, Any]:
    """A tombstone's answer: 404, not to be retried, the connection closed; its JSON body returned."""
    status, headers, body = answer
    assert status == 404
    assert headers["x-should-retry"] == "false"
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert message in json.dumps(payload)
    return dict(payload)


# ------------------------------------------------------------------ a generate() call without serving()


class LateCaller:
    """Row 0's sync agent: its first call is in the engine at the deadline (499); it ignores that, and once ``go``
    is set (after ``generate()`` returned) calls again with the ``openai`` client's default retries, counting the
    HTTP requests that call sent; then it waits for ``release``."""

    def __init__(self) -> None:
        self.go, self.called, self.release, self.ended = (threading.Event() for _ in range(4))
        self.base_url = ""
        self.first: Exception | None = None
        self.late: Exception | None = None
        self.requests = 0
        self.max_retries = -1

    def _count(self, request: Any) -> None:
        self.requests += 1

    def __call__(self, ctx: AgentContext) -> float:
        self.base_url = ctx.base_url
        try:
            with client(ctx.base_url, ctx.api_key) as c:
                try:
                    c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
                except openai.APIStatusError as exc:
                    self.first = exc
            self.go.wait(HANG_S)
            http = openai.DefaultHttpxClient(event_hooks={"request": [self._count]})
            with openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=http) as c:
                self.max_retries = c.max_retries
                try:
                    c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
                except openai.APIError as exc:
                    self.late = exc
            self.called.set()
            self.release.wait(HANG_S)
            return 1.0
        finally:
            self.ended.set()


async def test_an_agent_abandoned_by_a_generate_call_without_serving_gets_the_404_after_it_returned(
    tokenizer, anyio_backend
):
    blocker = Blocker(tokenizer, {0})
    late = LateCaller()
    row1_returned = threading.Event()

    def agent(ctx: AgentContext) -> float:
        if ctx.rollout == "q0_0":
            return late(ctx)
        with client(ctx.base_url, ctx.api_key) as c:
            c.chat.completions.create(model="any", messages=ctx.prompt)  # type: ignore[arg-type]
        row1_returned.set()
        return 1.0

    generator = StructuredAgentGenerator(
        ScriptedEngine(tokenizer, blocker),
        tokenizer,
        agent,
        rollout_timeout_s=DEADLINE,
        env_cleanup_timeout_s=CLEANUP_S,
        skip_failed_rollouts=True,
        agent_endpoint_workers=0,  # the in-loop endpoint's tombstone (workers keep their ports until aclose())
    )
    try:
        out, released_first = await generate_paused_until(generator, blocker.all_entered, row1_returned, late.go)
        assert not released_first, "generate() waited on the agent's thread until the watchdog released it"
        port = port_of(late.base_url)
        assert not late.ended.is_set()  # abandoned, still running: its endpoint has closed with generate()
        assert len(tombstones(port)) == 1
        late.go.set()
        with anyio.fail_after(HANG_S):
            assert await anyio.to_thread.run_sync(late.called.wait, HANG_S)
        assert len(tombstones(port)) == 1  # the agent still runs
    finally:
        late.go.set()
        late.release.set()
    assert isinstance(late.first, openai.APIStatusError)
    assert late.first.status_code == 499
    assert isinstance(late.late, openai.NotFoundError), late.late  # not an APIConnectionError
    assert_rollout_ended(late.late, "q0_0")
    assert CALL_ENDED in error_of(late.late)["message"]
    assert (late.max_retries, late.requests) == (2, 1)  # retries on, and the 404 was not retried
    with anyio.fail_after(HANG_S):
        assert await anyio.to_thread.run_sync(late.ended.wait, HANG_S)
        assert await anyio.to_thread.run_sync(wait_env_thread_calls, HANG_S)
        await assert_closed(port)
    assert row(out, 0) == placeholder(tokenizer.pad_token_id)
    assert (out["rollout_metrics"] or {})["generate/env_cleanup_timeouts"] == 1


# ------------------------------------------------------------------ the tombstone's answers


async def test_a_closed_endpoint_answers_every_request_with_the_ended_sessions_404_until_the_call_returns(
    tokenizer, anyio_backend
):
    async with closed_endpoint(tokenizer) as (server, session, call):
        port = server.port
        assert len(tombstones(port)) == 1
        key = session.api_key
        body = json.dumps({"model": "any", "messages": USER}).encode()
        chat_head = f"POST /sessions/{key}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
        by_client = await chat(session.base_url, session.api_key, messages=USER)
        (on_session,) = await exchange(port, chat_head.encode() + b"\r\n" + body)
        (by_bearer,) = await exchange(
            port, f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\r\n".encode()
        )
        (unnamed,) = await exchange(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        (anthropic,) = await exchange(
            port, f"POST /sessions/{key}/v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{{}}".encode()
        )
        (malformed,) = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        async with await anyio.connect_tcp("127.0.0.1", port) as gone:  # leaves halfway through its request head
            await gone.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost:")
        interim, after_continue = await exchange(port, chat_head.encode() + b"expect: 100-continue\r\n\r\n", body)
        (http10,) = await exchange(port, b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert len(tombstones(port)) == 1
        call.settle(None)
        with anyio.fail_after(HANG_S):
            await assert_closed(port)
    assert_rollout_ended(by_client, "t0_0")  # the openai client, with the session's base URL
    assert CALL_ENDED in error_of(by_client)["message"]
    for answer in (on_session, by_bearer, after_continue):
        payload = assert_ended_answer(answer, f"its rollout t0_0 has ended, {CALL_ENDED}")
        assert payload["error"] == {
            "message": payload["error"]["message"],
            "type": "rollout_ended",
            "param": None,
            "code": 404,
        }
        assert session.id in payload["error"]["message"]
        assert key not in payload["error"]["message"]
    for answer in (unnamed, malformed, http10):
        payload = assert_ended_answer(answer, "this capture endpoint has closed")
        assert payload["error"]["type"] == "rollout_ended"
    assert assert_ended_answer(anthropic, "its rollout t0_0 has ended")["error"]["type"] == "not_found_error"
    assert json.loads(anthropic[2])["type"] == "error"  # Anthropic's error shape on its route
    assert interim[0] == 100


async def test_nothing_answers_for_an_endpoint_whose_abandoned_calls_have_returned(tokenizer, anyio_backend):
    returned: Completion[None] = Completion()
    returned.settle(None)
    later: Completion[None] = Completion()
    async with serve_capture(ScriptedEngine.from_replies(tokenizer, "ok"), tokenizer) as server:
        async with server.session("t0_0") as session:
            session.outlived_by(returned)
            session.outlived_by(later)
        later.settle(None)  # returned while the endpoint is up
    assert server.afterlife.running == 0
    assert server.afterlife.tombstone is None
    await assert_closed(server.port)


async def test_the_port_closes_once_the_last_of_several_abandoned_calls_returns(tokenizer, anyio_backend):
    calls: list[Completion[None]] = [Completion(), Completion()]
    async with serve_capture(ScriptedEngine.from_replies(tokenizer, "ok"), tokenizer) as server:
        for k, call in enumerate(calls):
            async with server.session(f"t{k}_0") as session:
                session.outlived_by(call)
    try:
        calls[0].settle(None)
        (answer,) = await exchange(server.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert_ended_answer(answer, "this capture endpoint has closed")
        assert server.afterlife.running == 1
        tombstone = server.afterlife.tombstone
        assert tombstone is not None
        assert tombstone.answered == 1
    finally:
        calls[1].settle(None)
    with anyio.fail_after(HANG_S):
        await assert_closed(server.port)


# ------------------------------------------------------------------ the generator's endpoints


async def test_serving_keeps_its_live_endpoint_and_aclose_closes_the_port_kept_after_it(tokenizer, anyio_backend):
    call: Completion[None] = Completion()
    generator = StructuredAgentGenerator(  # the in-loop endpoint's tombstone (workers keep their ports until aclose())
        ScriptedEngine.from_replies(tokenizer, "ok"), tokenizer, lambda ctx: 1.0, agent_endpoint_workers=0
    )
    try:
        async with generator.serving() as server:
            async with server.session("t0_0") as session:
                session.outlived_by(call)
            assert tombstones(server.port) == []  # the live endpoint answers: nothing changes
            assert_rollout_ended(await chat(session.base_url, session.api_key, messages=USER), "t0_0")
        assert len(tombstones(server.port)) == 1
        assert_rollout_ended(await chat(session.base_url, session.api_key, messages=USER), "t0_0")
        await generator.aclose()  # the call still runs: closing the generator closes the port anyway
        assert tombstones(server.port) == []
        assert await anyio.to_thread.run_sync(refused, server.port)
    finally:
        call.settle(None)


async def test_a_fixed_port_kept_for_abandoned_agents_is_taken_back_by_the_next_endpoint(tokenizer, anyio_backend):
    with socket.socket() as probe:  # a port free now, for agent_endpoint_port
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    call: Completion[None] = Completion()
    generator = StructuredAgentGenerator(
        ScriptedEngine.from_replies(tokenizer, "ok"),
        tokenizer,
        lambda ctx: 1.0,
        agent_endpoint_port=port,
        agent_endpoint_workers=0,  # the in-loop endpoint's tombstone (workers keep their ports until aclose())
    )
    try:
        async with generator.serving() as first, first.session("t0_0") as session:
            session.outlived_by(call)
        assert len(tombstones(port)) == 1
        async with generator.serving() as second:  # binds the port the tombstone held
            assert second.port == port
            assert tombstones(port) == []
            late = await chat(session.base_url, session.api_key, messages=USER)
        assert isinstance(late, openai.NotFoundError)  # the new endpoint does not know the key: still not retried
        assert late.response.headers["x-should-retry"] == "false"
    finally:
        call.settle(None)
    await assert_closed(port)


# ------------------------------------------------------------------ LiteLLM


@pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")  # see test_agents_real_clients
async def test_litellm_does_not_retry_the_closed_endpoints_404(tokenizer, anyio_backend, monkeypatch):
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")  # before LiteLLM's import: no price list fetched online
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")

    def completion(session: CaptureSession) -> Exception | None:
        try:
            litellm.completion(
                model="openai/skyrl-agent", messages=USER, api_base=session.base_url, api_key=session.api_key
            )
        except Exception as exc:
            return exc
        return None

    try:
        async with closed_endpoint(tokenizer) as (server, session, _):
            error = await anyio.to_thread.run_sync(completion, session)
            tombstone = server.afterlife.tombstone
            assert tombstone is not None
            answered = tombstone.answered
    finally:
        close_litellm_clients()
    assert isinstance(error, litellm.NotFoundError), error
    assert error.status_code == 404
    assert "its rollout t0_0 has ended" in str(error)
    assert answered == 1  # one request: neither LiteLLM nor its OpenAI client retried it
    await assert_closed(server.port)
