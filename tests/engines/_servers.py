"""Shared pieces of the HTTP engine tests: a URL nothing listens on, a scripted ``/metrics`` route for the test
vLLM server, vLLM's metrics text, and an engine that answers "ok"."""

from __future__ import annotations

import socket
from typing import Any

from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest


def closed_port_url() -> str:
    """A URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def vllm_metrics(
    kv: float | list[float] = 0.25,
    running: int = 3,
    waiting: int = 1,
    preemptions: int | None = 7,
    hits: int | None = 40,
    queries: int | None = 100,
) -> str:
    """``GET /metrics`` as vLLM 0.32 writes it (one block per engine when ``kv`` is a list)."""
    usages = kv if isinstance(kv, list) else [kv]
    lines = []
    for engine, usage in enumerate(usages):
        labels = f'engine="{engine}",model_name="tiny"'
        share = 1 if engine == 0 else 0  # the request counts and counters all on engine 0
        lines += [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running * share}.0",
            f"vllm:num_requests_waiting{{{labels}}} {waiting * share}.0",
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 99.0',
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
        ]
        for name, value in (
            ("vllm:num_preemptions", preemptions),
            ("vllm:prefix_cache_hits", hits),
            ("vllm:prefix_cache_queries", queries),
        ):
            if value is not None:
                lines += [
                    f"# TYPE {name} counter",
                    f"{name}_total{{{labels}}} {value * share}.0",
                    f"{name}_created{{{labels}}} 1.7e+09",
                ]
    lines.append('python_info{implementation="CPython",major="3"} 1.0')
    return "\n".join(lines) + "\n"


class Scripted:
    """A ``/metrics`` route whose text the test sets; other routes are the test server's own."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.status = 200
        self.requests: list[ServedRequest] = []

    def __call__(self, request: ServedRequest) -> RawResponse | None:
        if request.path != "/metrics":
            return None
        self.requests.append(request)
        if self.status != 200:
            return RawResponse(self.status, b'{"detail":"Not Found"}')
        return RawResponse(200, self.text.encode(), "text/plain; version=0.0.4; charset=utf-8")


def echo(tokenizer: Any) -> ScriptedEngine:
    """An engine that answers every call with "ok"."""
    return ScriptedEngine(tokenizer, lambda call: Reply("ok"))
