"""The agents of :mod:`benchmarks.agents`: the three-call chat loop and each contender's way of making a call.

Shared by the benchmark's process and the ``remote`` / ``workers`` agents' child process
(:mod:`benchmarks._agent_process`), so that every contender runs the very same agent.
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai

from .workload import question

TURNS = 3
_OBSERVATION = "Observation {turn} for rollout {row}: the tool returned {value}. Continue."

#: One chat call of an agent: (messages so far) -> the reply's text.
Call = Callable[[list[dict[str, Any]]], Awaitable[str]]


class Batch:
    """What one batch did: per-call latencies and, on the endpoint, each session's calls and branches."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.calls = 0
        self.extended = 0
        self.branches = 0
        #: Seconds the endpoint took to serve (a pool of workers starting), outside the timed region.
        self.start_s: float | None = None


def next_messages(messages: list[dict[str, Any]], reply: str, row: int, turn: int) -> list[dict[str, Any]]:
    """The conversation after ``reply``: the reply, then the tool's observation as the next user turn."""
    observation = _OBSERVATION.format(turn=turn, row=row, value=row * 7 + turn)
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": observation}]


def first_messages(row: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question(row)}]


async def agent(call: Call, row: int, batch: Batch) -> None:
    """The agent: :data:`TURNS` calls, each sending the whole conversation so far; each call's latency kept."""
    messages = first_messages(row)
    for turn in range(TURNS):
        started = time.perf_counter()
        reply = await call(messages)
        batch.latencies.append(time.perf_counter() - started)
        messages = next_messages(messages, reply, row, turn)


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for every agent's client (unused over plain HTTP; httpx would load one per client)."""
    return ssl.create_default_context()


def http_client() -> httpx.AsyncClient:
    """One agent's own HTTP client (one keep-alive connection), as separate agents have.

    Not one shared client: httpx's connection pool scans every connection and waiting request at
    each event, so one pool shared by 1,024 agents measures the pool (``openai_shared`` shows it).
    """
    return httpx.AsyncClient(verify=tls(), trust_env=False, timeout=600.0)


def httpx_call(http: httpx.AsyncClient, base_url: str) -> Call:
    """The light agent's chat call: raw JSON POSTed to the session's ``/chat/completions``."""
    url = f"{base_url}/chat/completions"

    async def call(messages: list[dict[str, Any]]) -> str:
        response = await http.post(url, json={"model": "bench", "messages": messages})
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])

    return call


def completions_call(client: openai.AsyncOpenAI) -> Call:
    """The framework agent's chat call, through the official client."""

    async def call(messages: list[dict[str, Any]]) -> str:
        completion = await client.chat.completions.create(model="bench", messages=messages)  # type: ignore[arg-type]
        return completion.choices[0].message.content or ""

    return call


def openai_client(base_url: str, api_key: str, http: httpx.AsyncClient | None) -> openai.AsyncOpenAI:
    """The official client for one agent: over the agent's ``http`` (``openai``), or over one of its own
    (``openai_own``: None), which brings a TLS context of its own."""
    if http is None:
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        http_client=http,  # type: ignore[arg-type]  # openai >= 3 takes httpx2's or (legacy) httpx's
        max_retries=0,
    )


def shared_base() -> openai.AsyncOpenAI:
    """``openai_shared``'s one base client of a batch: one HTTP client (openai's defaults, the shared TLS
    context) under it. Each rollout takes ``base.with_options(base_url=..., api_key=...)``, which reuses
    that HTTP client: what docs/agents.md recommends for a loop that lives for the whole run."""
    http = openai.DefaultAsyncHttpxClient(verify=tls(), timeout=600.0)
    return openai.AsyncOpenAI(api_key="unused", max_retries=0, http_client=http)
