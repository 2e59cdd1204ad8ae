"""Shared pieces of the agent tests: Hermes-style chat templates for the offline tokenizer, an OpenAI client
run in a worker thread (an agent in its own thread, as on trio the async client cannot run), what tells
whether a closed endpoint's port is still answered (its tombstone thread) or closed, the "What is i + 3?"
batch with its tool agent and command script, an engine handler that blocks chosen rows, and a row read
field by field (a failed rollout's placeholder among them)."""

from __future__ import annotations

import copy
import socket
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlparse

import anyio
import anyio.to_thread
import openai

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator
from skyrl_structured.testing import EngineCall
from skyrl_structured.types import GeneratorInput, GeneratorOutput


def hermes_template(*, strip_think: bool) -> str:
    """A ChatML template with Hermes tool calls (as Qwen2.5/Qwen3 write them); ``strip_think`` drops earlier
    assistant turns' ``<think>...</think>`` blocks, as Qwen3's template does."""
    strip = (
        "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
        if strip_think
        else ""
    )
    return (
        "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] ~ '\\n\\n' -}}{%- endif -%}"
        "{{- '# Tools\\n<tools>\\n' -}}{%- for tool in tools -%}{{- tool | tojson ~ '\\n' -}}{%- endfor -%}"
        "{{- '</tools><|im_end|>\\n' -}}"
        "{%- elif messages[0]['role'] == 'system' -%}"
        "{{- '<|im_start|>system\\n' ~ messages[0]['content'] ~ '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and loop.first -%}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{%- set content = message['content'] or '' -%}" + strip + "{{- '<|im_start|>assistant\\n' ~ content -}}"
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n{\"name\": \"' ~ call['function']['name'] ~ '\", \"arguments\": ' ~ "
        "(call['function']['arguments'] | tojson) ~ '}\\n</tool_call>' -}}"
        "{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}"
        "{%- elif message['role'] == 'tool' -%}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' ~ message['content'] ~ '\\n</tool_response><|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def with_template(tokenizer: Any, template: str) -> Any:
    """A copy of ``tokenizer`` with ``template`` as its chat template (the session fixture stays untouched)."""
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


ADD_TOOL: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120.0)


async def in_thread(work: Callable[[], Any], errors: type[Exception] = openai.APIStatusError) -> Any:
    """Run ``work`` (blocking client calls) in a worker thread; an API error (``errors``: OpenAI's unless given)
    is returned, not raised."""

    def run() -> Any:
        try:
            return work()
        except errors as exc:
            return exc

    return await anyio.to_thread.run_sync(run)


async def chat(base_url: str, api_key: str = "unused", **request: Any) -> Any:
    """One chat completion from a fresh client in a worker thread: the response, or the ``APIStatusError``."""

    def work() -> Any:
        with client(base_url, api_key) as c:
            return c.chat.completions.create(**{"model": "any", **request})

    return await in_thread(work)


def error_of(exc: Any) -> dict[str, Any]:
    """The OpenAI error body of an ``APIStatusError``: ``{"message", "type", "param", "code"}``."""
    assert isinstance(exc, openai.APIStatusError), f"expected an API error, got {exc!r}"
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == exc.status_code
    return dict(error)


def assert_rollout_ended(answer: Any, rollout: str) -> None:
    """``answer`` is the endpoint's answer to a request on an ended session: a 404 that no client retries
    (``x-should-retry: false``), of type ``rollout_ended``, naming the rollout."""
    error = error_of(answer)
    assert answer.status_code == 404
    assert answer.response.headers["x-should-retry"] == "false"
    assert error["type"] == "rollout_ended"
    assert f"rollout {rollout} has ended" in error["message"]


def one_call_agent(
    rewards: Mapping[str, float] | None = None, *, fails: str | None = None
) -> Callable[[Any], Awaitable[float]]:
    """An agent making one chat call with its prompt: rollout ``fails`` then raises, the others return their
    reward from ``rewards`` (1.0 when not given)."""

    async def agent(ctx: Any) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        if ctx.rollout == fails:
            raise ValueError("the agent's own bug")
        return (rewards or {}).get(ctx.rollout, 1.0)

    return agent


async def timeout_once_in_the_engine(generator: Any, input_batch: Any, entered: Callable[[], Awaitable[Any]]) -> str:
    """``generator.generate(input_batch)`` with its clock paused until ``entered()`` returns (the agent's request is
    in the engine), so its deadline can only fire with that request in flight however slow the machine; returns
    the ``TimeoutError`` message it raised."""
    failures: list[TimeoutError] = []

    async def run() -> None:
        try:
            await generator.generate(input_batch)
        except TimeoutError as exc:
            failures.append(exc)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            generator.pause()
            group.start_soon(run)
            await entered()
            generator.resume()
    (error,) = failures
    return str(error)


class Blocked:
    """An engine handler that holds each request until it is cancelled: ``entered`` is set once a request is
    in the engine, ``cancelled`` once its cancellation reached it."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.cancelled = anyio.Event()

    async def __call__(self, call: Any) -> str:
        self.entered.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


def close_litellm_clients() -> None:
    """Close the OpenAI clients LiteLLM cached (one per session's URL and key, for 10 minutes): their pooled
    sockets would otherwise be collected, unclosed, in some later test."""
    import litellm

    cache = litellm.in_memory_llm_clients_cache
    for cached in list(cache.cache_dict.values()):
        if isinstance(cached, openai.OpenAI):
            cached.close()
    cache.flush_cache()


#: A bound only a hang reaches.
HANG_S = 60.0


def tombstones(port: int) -> list[threading.Thread]:
    """The live threads answering for the closed endpoint on ``port``."""
    return [t for t in threading.enumerate() if t.name == f"skyrl-structured-tombstone-{port}"]


def refused(port: int) -> bool:
    """Whether a connection to ``port`` is refused (nothing listens there)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=HANG_S).close()
    except ConnectionRefusedError:
        return True
    return False


async def assert_closed(port: int) -> None:
    """The tombstone of ``port`` has ended (waited for under a bound only a hang reaches) and the port is closed."""

    def join() -> None:
        for thread in tombstones(port):
            thread.join(HANG_S)

    await anyio.to_thread.run_sync(join)
    assert tombstones(port) == []
    assert await anyio.to_thread.run_sync(refused, port)


def port_of(url: str) -> int:
    """The port of a session's base URL (its endpoint's)."""
    port = urlparse(url).port
    assert port is not None
    return port


def noncanonical_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized one character at a time, then EOS: ids an engine may sample that re-tokenizing the
    text would not give back (the tokenizer merges characters), so a test sees any re-tokenization."""
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert ids != tokenizer.encode(text, add_special_tokens=False), f"{text!r} has no merged tokens"
    return [*ids, tokenizer.eos_token_id]


def batch(n: int) -> GeneratorInput:
    """``n`` agent rollouts, row ``i`` asking "What is i + 3?" (its answer in the extras)."""
    return {
        "prompts": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
        "env_classes": ["agent"] * n,
        "env_extras": [{"answer": i + 3} for i in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }


async def tool_agent(ctx: AgentContext) -> dict[str, Any]:
    """A hand-written tool loop: call the model, run its tool calls, answer them, until it stops calling tools."""

    def loop() -> str:
        messages: list[Any] = list(ctx.prompt)
        with client(ctx.base_url, ctx.api_key) as c:
            for _ in range(4):
                reply = c.chat.completions.create(model=ctx.model, messages=messages, tools=ADD_TOOL)  # type: ignore[arg-type]
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return message.content or ""
                for call in message.tool_calls:
                    args = call.model_dump_json()  # the call as the client parsed it
                    assert '"add"' in args
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "6"})
        return ""

    answer = await anyio.to_thread.run_sync(loop)
    return {"reward": 1.0 if answer.strip() == str(ctx.env_extras["answer"]) else 0.0}


CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call>'


SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import openai

    if os.environ.get("EXECUTABLE_FILE"):
        with open(os.environ["EXECUTABLE_FILE"], "w") as f:
            f.write(sys.executable)
    pidfile = os.environ.get("PIDFILE")
    if pidfile:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        os.rename(pidfile + ".tmp", pidfile)
    client = openai.OpenAI(max_retries=0, timeout=120.0)  # base URL and key from the environment
    messages = json.loads(os.environ["SKYRL_AGENT_PROMPT"])
    extras = json.loads(os.environ["SKYRL_AGENT_EXTRAS"])
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    print("a log line the reward does not come from")
    print(json.dumps({"reward": 1.0 if reply.choices[0].message.content == str(extras["answer"]) else 0.5}))
    """
)


#: A deadline that fires only once its rollout's request is in the engine (the clock is paused before).
DEADLINE = 0.5


def sampled(tokenizer: Any, text: str) -> list[int]:
    """What the scripted engine samples for ``text``: its ids and the eos token."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def question(tokenizer: Any, call: EngineCall) -> int:
    """Which row of :func:`batch` an engine call is for (its prompt asks "What is i + 3?")."""
    text = tokenizer.decode(call.prompt_token_ids)
    (row,) = [i for i in range(16) if f"What is {i} + 3?" in text]
    return row


class Blocker:
    """An engine handler: rows in ``blocked`` never get an answer (``entered``/``cancelled`` tell where they are),
    the others get ``"3"``."""

    def __init__(self, tokenizer: Any, blocked: set[int]) -> None:
        self.tokenizer = tokenizer
        self.entered = {row: anyio.Event() for row in blocked}
        self.cancelled = {row: anyio.Event() for row in blocked}

    async def __call__(self, call: EngineCall) -> str:
        row = question(self.tokenizer, call)
        if row not in self.entered:
            return "3"
        self.entered[row].set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled[row].set()
            raise
        raise AssertionError("unreachable")

    async def all_entered(self) -> None:
        for event in self.entered.values():
            await event.wait()


def placeholder(pad: int) -> dict[str, Any]:
    """The row of a failed rollout, field by field."""
    return {"prompt": [pad], "response": [pad], "mask": [0], "reward": [0.0], "stop": "rollout_error", "lp": [0.0]}


def row(out: GeneratorOutput, r: int) -> dict[str, Any]:
    logprobs = out["rollout_logprobs"]
    return {
        "prompt": out["prompt_token_ids"][r],
        "response": out["response_ids"][r],
        "mask": out["loss_masks"][r],
        "reward": out["rewards"][r],
        "stop": (out["stop_reasons"] or [])[r],
        "lp": logprobs[r] if logprobs is not None else None,
    }


#: How long a sync agent gets to return once its session closed; the stubborn one never does in time.
CLEANUP_S = 0.2


async def generate_paused_until(
    generator: StructuredAgentGenerator, entered: Any, row1_returned: threading.Event, release: threading.Event
) -> Any:
    """``generator.generate(batch(2))`` with the clock paused until row 0's request is in the engine and row 1's
    agent has returned.

    Returns ``(output, released_first)``: ``released_first`` is True when the watchdog had to release the
    agent (``generate()`` was waiting on its thread), so a regression fails instead of hanging the suite.
    """
    result: dict[str, GeneratorOutput] = {}
    released_first = False

    async def watchdog() -> None:
        nonlocal released_first
        await anyio.sleep(HANG_S)
        released_first = True
        release.set()

    async def run() -> None:
        result["out"] = await generator.generate(batch(2))

    async with anyio.create_task_group() as outer:
        outer.start_soon(watchdog)
        async with anyio.create_task_group() as group:
            generator.pause()
            group.start_soon(run)
            await entered()
            assert await anyio.to_thread.run_sync(row1_returned.wait, HANG_S)
            generator.resume()
        outer.cancel_scope.cancel()
    return result["out"], released_first


@asynccontextmanager
async def closing(generator: Any) -> AsyncIterator[Any]:
    """The block, then ``generator.aclose()`` (its endpoint workers stop): inside a leak tracker, nothing is left."""
    try:
        yield generator
    finally:
        await generator.aclose()


class Held:
    """An engine handler holding each row's first call until :attr:`release` is set (cancel-aware)."""

    def __init__(self, tokenizer: Any, rows: int) -> None:
        self.tokenizer = tokenizer
        self.entered = {r: anyio.Event() for r in range(rows)}
        self.release = anyio.Event()

    async def __call__(self, call: EngineCall) -> str:
        self.entered[question(self.tokenizer, call)].set()
        await self.release.wait()
        return "3"

    async def all_entered(self) -> None:
        for event in self.entered.values():
            await event.wait()
