"""The capture endpoint as a server: private sessions, other hosts, every request answered, the fields it takes.

Real HTTP (raw keep-alive connections spoken with h11 as a client, httpx and the official ``openai``
client), real subprocesses, the server in the test's event loop (asyncio and trio). Nothing here
waits on time: each wait is on an event, or under a bound only a hang reaches.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import anyio
import h11
import pytest

from skyrl_structured import GeneratorInput
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator, serve_capture
from skyrl_structured.cli._config import load_config
from skyrl_structured.testing import EngineCall, ScriptedEngine
from tests._agents import ADD_TOOL, error_of, in_thread, with_template

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Say hello."}]
ROOT = Path(__file__).resolve().parents[1]


class Raw:
    """One keep-alive HTTP/1.1 connection, spoken with h11 as a client: each exchange on the same socket."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, host: str, port: int) -> Raw:
        return cls(await anyio.connect_tcp(host, port))

    async def request(
        self, method: str, path: str, body: Any = None, headers: list[tuple[str, str]] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """Send one request and read its answer: ``(status, headers, JSON body)``."""
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        head = [("host", "x"), ("content-length", str(len(data))), *(headers or [])]
        await self.stream.send(self.conn.send(h11.Request(method=method, target=path, headers=head)))
        await self.stream.send(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))
        response, payload = await self._answer()
        self.conn.start_next_cycle()
        answer_headers = {k.decode().lower(): v.decode() for k, v in response.headers}
        is_json = answer_headers.get("content-type") == "application/json"
        return response.status_code, answer_headers, json.loads(payload) if is_json else payload

    async def _answer(self) -> tuple[Any, bytes]:
        response = None
        payload = b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive())
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                payload += event.data
            elif isinstance(event, h11.EndOfMessage):
                return response, payload
            else:
                raise AssertionError(f"the server closed the connection instead of answering: {event!r}")

    async def aclose(self) -> None:
        await self.stream.aclose()


# ------------------------------------------------------------------ private sessions


async def test_sessions_are_private_secrets_and_a_request_reaches_only_its_own(tokenizer, anyio_backend):
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    async with (
        serve_capture(engine, tokenizer) as server,
        server.session("a") as own,
        server.session("b") as sibling,
        server.session("c") as third,
    ):
        siblings = [own, sibling, third]
        for session in siblings:
            assert re.fullmatch(r"[0-9a-f]{32}", session.id)  # 128 bits, public
            assert re.fullmatch(r"[A-Za-z0-9_-]{32}", session.api_key)  # 192 bits, the credential
            assert session.id not in session.api_key
            assert session.base_url == f"{server.url}/sessions/{session.api_key}/v1"
        # No prefix or counter relation: the old `<nonce>-<n>` ids shared all but their last characters.
        for one in siblings:
            for other in siblings:
                if one is not other:
                    assert one.id[:8] != other.id[:8]
                    assert one.api_key[:8] != other.api_key[:8]
        own_key = [("authorization", f"Bearer {own.api_key}")]
        raw = await Raw.open("127.0.0.1", server.port)
        chat_body = {"model": "m", "messages": USER}
        answers = {
            # the sibling's public id (completion ids show it) in the path, the agent's own key
            "sibling id + own key": await raw.request(
                "POST", f"/sessions/{sibling.id}/v1/chat/completions", chat_body, own_key
            ),
            "sibling id as key": await raw.request(
                "POST", "/v1/chat/completions", chat_body, [("authorization", f"Bearer {sibling.id}")]
            ),
            "sibling key + own key": await raw.request(
                "POST", f"/sessions/{sibling.api_key}/v1/chat/completions", chat_body, own_key
            ),
            "next counter": await raw.request(
                "POST", f"/sessions/{own.id[:-1]}{(int(own.id[-1], 16) + 1) % 16:x}/v1/chat/completions", chat_body
            ),
            "own key": await raw.request("POST", f"/sessions/{own.api_key}/v1/chat/completions", chat_body),
        }
        await raw.aclose()
    statuses = {what: status for what, (status, _, _) in answers.items()}
    assert statuses == {
        "sibling id + own key": 403,
        "sibling id as key": 404,
        "sibling key + own key": 403,
        "next counter": 404,
        "own key": 200,
    }
    for what, (status, headers, body) in answers.items():
        if status != 200:
            assert headers["x-should-retry"] == "false", what
            assert set(body["error"]) == {"message", "type", "param", "code"}
    # Only the own request reached the engine, and only the own session captured it.
    assert [call.session_id for call in engine.calls] == [own.id]
    assert (len(own.calls), len(sibling.calls), len(third.calls)) == (1, 0, 0)


# ------------------------------------------------------------------ agents on other machines

_REMOTE_AGENT = textwrap.dedent(
    """
    import json, sys
    import httpx
    root, key = sys.argv[1], sys.argv[2]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answers = {}
    for name, token in (("own", key), ("wrong", "not-" + key)):
        r = httpx.post(root + "/v1/chat/completions", json=body, headers={"authorization": "Bearer " + token})
        answers[name] = [r.status_code, r.headers.get("x-should-retry")]
    print(json.dumps(answers))
    """
)


async def test_an_endpoint_on_another_address_is_reached_from_a_subprocess_with_its_key_only(tokenizer, anyio_backend):
    seen: dict[str, Any] = {}

    async def remote_agent(ctx: AgentContext) -> float:
        root = ctx.base_url.split("/sessions/")[0]
        seen["base_url"], seen["root"] = ctx.base_url, root
        done = await anyio.run_process([sys.executable, "-c", _REMOTE_AGENT, root, ctx.api_key], check=True)
        seen["answers"] = json.loads(done.stdout)
        with pytest.raises(OSError, match="onnect"):  # it listens on the address asked for, not on 127.0.0.1
            await anyio.connect_tcp("127.0.0.1", int(root.rsplit(":", 1)[1]))
        return 1.0

    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    generator = StructuredAgentGenerator(
        engine,
        tokenizer,
        remote_agent,
        agent_endpoint_host="127.0.0.2",  # loopback only: tests never listen beyond this machine
        agent_endpoint_url="http://127.0.0.2:{port}/",
    )
    with anyio.fail_after(120):
        output = await generator.generate(_one_row())
    assert cast(list[float], output["rewards"][0])[-1] == 1.0
    assert re.fullmatch(r"http://127\.0\.0\.2:\d+/sessions/[A-Za-z0-9_-]{32}/v1", seen["base_url"])
    # Its own key reaches its session (200); any other key is refused with 404, retried by no client.
    assert seen["answers"] == {"own": [200, None], "wrong": [404, "false"]}
    assert len(engine.calls) == 1


def test_the_endpoint_knobs_reach_the_generator_from_keywords_skyrls_section_and_the_cli(tokenizer):
    def agent(ctx: AgentContext) -> Any:
        raise AssertionError("not run")

    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    knobs: dict[str, Any] = {
        "agent_endpoint_host": "0.0.0.0",
        "agent_endpoint_port": 8431,
        "agent_endpoint_url": "http://h:{port}",
    }
    by_keyword = StructuredAgentGenerator(engine, tokenizer, agent, **knobs).endpoint
    from_section = StructuredAgentGenerator.from_config(knobs, engine, tokenizer, agent).endpoint
    cli = load_config(["agent=default", *(f"generator.{k}={v}" for k, v in knobs.items())])
    from_cli = StructuredAgentGenerator.from_config(cli.generator, engine, tokenizer, agent).endpoint
    assert by_keyword == from_section == from_cli
    assert (from_cli.agent_endpoint_host, from_cli.agent_endpoint_port) == ("0.0.0.0", 8431)
    default = StructuredAgentGenerator.from_config({}, engine, tokenizer, agent).endpoint
    assert (default.agent_endpoint_host, default.agent_endpoint_port, default.agent_endpoint_url) == (
        "127.0.0.1",
        0,
        None,
    )
    with pytest.raises(ValueError, match=r"`generator\.agent_endpoint_url` must be the URL agents reach"):
        StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_host="0.0.0.0")
    with pytest.raises(ValueError, match=r"`generator\.agent_endpoint_port` must be a port number"):
        StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_port=True)
    with pytest.raises(ValueError, match=r"`generator\.agent_endpoint_url` must be an http:// or https:// URL"):
        StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_url="127.0.0.2:9000")


# ------------------------------------------------------------------ every request gets an answer

#: Raises, as Mistral's, Llama's and Gemma's templates do, on a role order it does not take.
_STRICT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class _FailingTokenizer:
    """The session tokenizer, but ``encode`` raises: a fault of the endpoint itself, not of the request."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tokenizer broke")


async def test_a_raising_template_a_lone_surrogate_and_an_endpoint_fault_are_answered_on_a_usable_connection(
    tokenizer, anyio_backend
):
    strict = with_template(tokenizer, _STRICT_TEMPLATE)
    engine = ScriptedEngine(strict, lambda call: "ok")
    async with serve_capture(engine, strict) as server, server.session("t0_0") as session:
        raw = await Raw.open("127.0.0.1", server.port)
        path = f"/sessions/{session.api_key}/v1/chat/completions"
        bad_order = [{"role": "assistant", "content": "I speak first."}, *USER]
        template = await raw.request("POST", path, {"model": "m", "messages": bad_order})
        surrogate = await raw.request(
            "POST", path, b'{"model": "m", "messages": [{"role": "user", "content": "caf\\udce9"}]}'
        )
        paired = await raw.request("POST", path, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
        fine = await raw.request("POST", path, {"model": "m", "messages": USER})
        await raw.aclose()
    status, headers, body = template
    assert (status, body["error"]["param"], headers["x-should-retry"]) == (400, "messages", "false")
    assert "Conversation roles must alternate user/assistant" in body["error"]["message"]
    status, _, body = surrogate
    assert (status, body["error"]["param"]) == (400, "messages[0].content")
    assert "lone UTF-16 surrogate" in body["error"]["message"]
    assert (paired[0], fine[0]) == (200, 200)  # a paired surrogate is one character (an emoji)
    assert len(engine.calls) == 2

    broken = _FailingTokenizer(tokenizer)
    async with serve_capture(engine, broken) as server, server.session("t1_0") as session:
        raw = await Raw.open("127.0.0.1", server.port)
        status, headers, body = await raw.request(
            "POST", f"/sessions/{session.api_key}/v1/chat/completions", {"messages": USER}
        )
        models = await raw.request("GET", f"/sessions/{session.api_key}/v1/models")
        await raw.aclose()
    assert status == 500
    assert "rollout t1_0" in body["error"]["message"]
    assert "RuntimeError: the tokenizer broke" in body["error"]["message"]
    assert "x-should-retry" not in headers
    assert models[0] == 200  # the same connection answers the next request


async def test_an_engine_failure_reaches_the_engine_once_though_the_client_retries_5xx(tokenizer, anyio_backend):
    # Issue 35: the official clients retry every 5xx twice by default; an engine failure says
    # `x-should-retry: false`, so the engine sees the request once and the agent hears it at once.
    import openai

    def broken(call: EngineCall) -> str:
        raise ConnectionError("the engine server went away")

    engine = ScriptedEngine(tokenizer, broken)
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:

        def ask() -> Any:
            with openai.OpenAI(base_url=session.base_url, api_key="unused") as c:  # max_retries: the default, 2
                return c.chat.completions.create(model="any", messages=cast(Any, USER))

        answer = await in_thread(ask)
    assert isinstance(answer, openai.InternalServerError), answer
    assert answer.response.headers["x-should-retry"] == "false"
    assert error_of(answer)["message"] == "the engine failed: ConnectionError: the engine server went away"
    assert len(engine.calls) == 1


async def test_expect_100_continue_is_answered_before_the_body_is_sent(tokenizer, anyio_backend):
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        raw = await Raw.open("127.0.0.1", server.port)
        body = json.dumps({"messages": USER}).encode()
        head = [("host", "x"), ("content-length", str(len(body))), ("expect", "100-continue")]
        path = f"/sessions/{session.api_key}/v1/chat/completions"
        await raw.stream.send(raw.conn.send(h11.Request(method="POST", target=path, headers=head)))
        with anyio.fail_after(60):  # without 100 Continue this waits forever: the body is not sent before it
            event = raw.conn.next_event()
            while event is h11.NEED_DATA:
                raw.conn.receive_data(await raw.stream.receive())
                event = raw.conn.next_event()
        assert isinstance(event, h11.InformationalResponse)
        assert event.status_code == 100
        await raw.stream.send(raw.conn.send(h11.Data(data=body)) + raw.conn.send(h11.EndOfMessage()))
        response, payload = await raw._answer()
        await raw.aclose()
    assert response.status_code == 200
    assert json.loads(payload)["choices"][0]["message"]["content"] == "ok"


async def test_a_caller_cancelling_generate_answers_the_in_flight_request_499(tokenizer, anyio_backend):
    entered = anyio.Event()

    async def blocked(call: EngineCall) -> str:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    answers: list[Any] = []

    async def agent(ctx: AgentContext) -> float:
        def call() -> Any:
            try:
                return chat_sync(ctx.base_url, ctx.api_key)
            except Exception as exc:  # a dropped connection: what the agent got before the fix
                return exc

        answers.append(await anyio.to_thread.run_sync(call))
        return 1.0

    generator = StructuredAgentGenerator(ScriptedEngine(tokenizer, blocked), tokenizer, agent)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:  # no serving(): the endpoint lives in the cancelled call
            group.start_soon(generator.generate, _one_row())
            await entered.wait()
            group.cancel_scope.cancel()
    (answer,) = answers
    error = error_of(answer)
    assert answer.status_code == 499
    assert "#0" in error["message"]


def chat_sync(base_url: str, api_key: str) -> Any:
    """One chat call with the official client (no retries); the ``APIStatusError`` returned, not raised."""
    import openai

    from tests._agents import client

    try:
        with client(base_url, api_key) as c:
            return c.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    except openai.APIStatusError as exc:
        return exc


_FD_EXHAUSTION = textwrap.dedent(
    """
    import logging, os, resource, sys
    import anyio, httpx
    from skyrl_structured.agents import StructuredAgentGenerator
    from skyrl_structured.testing import ScriptedEngine
    from skyrl_structured.tiny import build_chatml_tokenizer

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    tokenizer = build_chatml_tokenizer()
    logging.basicConfig(level=logging.WARNING)
    accept_failed = []
    failed = None

    class Watch(logging.Handler):
        def emit(self, record):  # in the event loop's thread: the server's accept loop logs it
            if "accepting a connection failed" in record.getMessage():
                accept_failed.append(record)
                failed.set()

    logging.getLogger("skyrl_structured").addHandler(Watch())

    async def agent(ctx):
        host, port = ctx.base_url.split("/")[2].split(":")
        idle = [await anyio.connect_tcp(host, int(port)) for _ in range(40)]  # idle keep-alive connections
        files = []
        while True:  # every descriptor left, held
            try:
                files.append(open(os.devnull))
            except OSError:
                break
        files.pop().close()
        pending = await anyio.connect_tcp(host, int(port))  # the last descriptor: the server cannot accept it
        await failed.wait()  # the server's accept has failed (logged) and it backs off
        for f in files:
            f.close()
        for stream in [*idle, pending]:
            await stream.aclose()
        async with httpx.AsyncClient() as http:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            r = await http.post(ctx.base_url + "/chat/completions", json=body)
        return 1.0 if r.status_code == 200 else 0.0

    async def main():
        global failed
        failed = anyio.Event()
        generator = StructuredAgentGenerator(  # the trainer's own accept loop runs out of descriptors: in-loop
            ScriptedEngine(tokenizer, lambda call: "ok"), tokenizer, agent, agent_endpoint_workers=0
        )
        with anyio.fail_after(120):
            out = await generator.generate({"prompts": [[{"role": "user", "content": "hi"}]], "env_extras": [{}]})
        print("reward", out["rewards"][0][-1], "logged", len(accept_failed))

    anyio.run(main, backend=sys.argv[1])
    """
)


def _backend_name(anyio_backend: Any) -> str:
    return anyio_backend if isinstance(anyio_backend, str) else anyio_backend[0]


async def test_running_out_of_file_descriptors_is_logged_once_and_does_not_end_generate(tokenizer, anyio_backend):
    done = await anyio.run_process(
        [sys.executable, "-c", _FD_EXHAUSTION, _backend_name(anyio_backend)], check=False, cwd=ROOT
    )
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr[-3000:]
    assert done.stdout.decode().split() == ["reward", "1.0", "logged", "1"]
    assert "Too many open files" in stderr
    assert "ulimit -n" in stderr
    assert "Traceback" not in stderr


# ------------------------------------------------------------------ the request fields (docs/agents.md's table)

#: One row per row of the table in docs/agents.md: (first field, a request it accepts, the engine's sampling
#: params it must yield (None: unchanged), a request it refuses (None: none refused)).
FIELD_ROWS: list[tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]] = [
    ("model", {"model": "anything"}, None, None),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, None, None),
    ("tools", {"tools": ADD_TOOL}, None, {"tools": {"add": 1}}),
    ("stream", {"stream": True, "stream_options": {"include_usage": True}}, None, {"stream_options": {"x": 1}}),
    (
        "temperature",
        {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "stop": ["x"], "seed": 3, "top_k": 4, "min_p": 0.1},
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "max_generate_length": 7,
            "stop": ["x"],
            "seed": 3,
            "top_k": 4,
            "min_p": 0.1,
        },
        {"temperature": "hot"},
    ),
    ("n", {"n": 1}, None, {"n": 2}),
    ("presence_penalty", {"presence_penalty": 0, "frequency_penalty": 0.0}, None, {"frequency_penalty": 0.5}),
    ("logprobs", {"logprobs": False, "top_logprobs": 0}, None, {"logprobs": True}),
    ("tool_choice", {"tool_choice": "auto", "tools": ADD_TOOL}, None, {"tool_choice": "required", "tools": ADD_TOOL}),
    ("response_format", {"response_format": {"type": "text"}}, None, {"response_format": {"type": "json_object"}}),
    ("logit_bias", {"logit_bias": {}}, None, {"logit_bias": {"5": 10}}),
    ("modalities", {"modalities": ["text"]}, None, {"modalities": ["text", "audio"]}),
    (
        "user",
        {
            "user": "u1",
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "flex",
            "prompt_cache_key": "c1",
            "safety_identifier": "s1",
            "parallel_tool_calls": True,
        },
        None,
        None,
    ),
    ("audio", {}, None, {"audio": {"voice": "alloy", "format": "wav"}}),
    ("reasoning_effort", {"reasoning_effort": "none", "verbosity": "low"}, None, {"reasoning_effort": "high"}),
]


def test_the_docs_table_has_one_row_per_tested_row():
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    section = text.split("### Request fields", 1)[1].split("### ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the head and its rule
    firsts = [re.findall(r"`([a-z_]+)`", line.split("|")[1])[0] for line in table]
    assert firsts == [row[0] for row in FIELD_ROWS]


@pytest.mark.parametrize(("field", "accepted", "sampled", "refused"), FIELD_ROWS, ids=[r[0] for r in FIELD_ROWS])
async def test_each_request_field_is_accepted_ignored_or_refused_as_the_docs_table_says(
    tokenizer, anyio_backend, field, accepted, sampled, refused
):
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    async with serve_capture(engine, tokenizer) as server, server.session("t0_0") as session:
        raw = await Raw.open("127.0.0.1", server.port)
        path = f"/sessions/{session.api_key}/v1/chat/completions"
        ok = await raw.request("POST", path, {"model": "m", "messages": USER, **accepted})
        no = await raw.request("POST", path, {"model": "m", "messages": USER, **refused}) if refused else None
        await raw.aclose()
    assert ok[0] == 200, ok[2]
    assert engine.calls[0].sampling_params == {"logprobs": 1, **(sampled or {})}
    if no is not None:
        status, headers, body = no
        assert (status, headers["x-should-retry"]) == (400, "false")
        assert body["error"]["param"] == next(iter(refused.keys() - {"tools"} or {"tools"}))
        assert len(engine.calls) == 1


async def test_the_official_client_with_retries_sends_one_request_to_an_ended_session(tokenizer, anyio_backend):
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    async with serve_capture(engine, tokenizer) as server:
        async with server.session("t0_0") as session:
            pass
        sent: list[Any] = []

        def with_retries() -> Any:
            import httpx
            import openai

            http = httpx.Client(event_hooks={"request": [sent.append]})
            # openai's annotation names its own httpx distribution; a plain httpx.Client is what it takes.
            client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=5, http_client=http)  # type: ignore[arg-type]
            with client:
                return client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]

        answer = await in_thread(with_retries)
    assert answer.status_code == 404
    assert len(sent) == 1  # a 408, 409, 429 or 5xx would have been sent 6 times
    assert engine.calls == []


def _one_row() -> GeneratorInput:
    """A one-row batch for an agent generator (its env class is never used)."""
    return cast(GeneratorInput, {"prompts": [USER], "env_extras": [{}]})
