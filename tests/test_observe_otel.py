"""OpenTelemetryObserver: a span tree per batch, rollout, attempt and turn; errors recorded; none left open."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from skyrl_structured.observe import OpenTelemetryObserver
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator

pytestmark = pytest.mark.anyio


class OpenSpans(SpanProcessor):
    """Every span started and not yet ended (the leak check)."""

    def __init__(self) -> None:
        self.open: dict[int, str] = {}

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        self.open[span.get_span_context().span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        del self.open[span.context.span_id]


@pytest.fixture
def otel() -> tuple[TracerProvider, InMemorySpanExporter, OpenSpans]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    leaks = OpenSpans()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(leaks)
    return provider, exporter, leaks


def attrs(item: Any) -> Mapping[str, Any]:
    """A span's or a span event's attributes (the SDK types them as optional)."""
    found: Mapping[str, Any] | None = item.attributes
    return found or {}


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    mine = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    return sorted(mine, key=lambda s: s.start_time or 0)


async def test_a_retried_and_a_failed_rollout_as_span_trees(tokenizer, anyio_backend, otel):
    provider, exporter, leaks = otel
    calls: Counter[object] = Counter()

    def handler(call):
        calls[call.session_id] += 1
        if call.session_id == "q0_0" and calls[call.session_id] == 1:
            raise ConnectionError("blip")
        return "an answer #### 7"

    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        skip_failed_rollouts=True,
        max_rollout_retries=1,
        rollout_retry_backoff_s=0.001,
    )
    gen.observers.append(OpenTelemetryObserver(tracer_provider=provider))
    await gen.generate(make_batch(2, EnvLedger(), extras={1: {"fail": "init"}}), disable_tqdm=True)
    assert leaks.open == {}
    spans = list(exporter.get_finished_spans())
    (batch,) = [s for s in spans if s.name == "skyrl.generate"]
    assert batch.parent is None
    rollouts = _children(spans, batch)
    assert [s.name for s in rollouts] == ["skyrl.rollout", "skyrl.rollout"]
    by_index = {attrs(s)["skyrl.rollout.index"]: s for s in rollouts}

    retried = by_index[0]
    assert attrs(retried)["skyrl.trajectory_id"] == "q0_0"
    assert attrs(retried)["skyrl.attempts"] == 2
    assert retried.status.status_code == StatusCode.UNSET
    assert [s.name for s in _children(spans, retried)] == ["skyrl.attempt", "skyrl.backoff", "skyrl.attempt"]
    first, _, second = _children(spans, retried)
    assert first.status.status_code == StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert attrs(first.events[0])["exception.type"] == "ConnectionError"
    assert [s.name for s in _children(spans, second)] == [
        "skyrl.env.init",
        "skyrl.turn",
        "skyrl.turn",
        "skyrl.env.close",
        "skyrl.finish_session",
    ]
    turn = _children(spans, second)[1]
    assert attrs(turn)["skyrl.stop_reason"] == "stop"
    assert attrs(turn)["skyrl.response_tokens"] == 5
    assert [s.name for s in _children(spans, turn)] == ["skyrl.engine", "skyrl.env.step"]

    failed = by_index[1]
    assert failed.status.status_code == StatusCode.ERROR
    assert attrs(failed)["skyrl.error.type"] == "RuntimeError"
    attempts = [s for s in _children(spans, failed) if s.name == "skyrl.attempt"]
    assert [s.status.status_code for s in attempts] == [StatusCode.ERROR, StatusCode.ERROR]
    assert [attrs(s)["skyrl.will_retry"] for s in attempts] == [True, False]


async def test_a_cancelled_batch_ends_every_span(tokenizer, anyio_backend, otel):
    provider, exporter, leaks = otel
    started = anyio.Event()
    calls = 0

    async def hang(call):
        nonlocal calls
        calls += 1
        if calls == 3:
            started.set()
        await anyio.sleep_forever()

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, hang))
    gen.observers.append(OpenTelemetryObserver(tracer_provider=provider))
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(3, EnvLedger()), True)
            await started.wait()
            scope.cancel()
    assert leaks.open == {}
    spans = list(exporter.get_finished_spans())
    (batch,) = [s for s in spans if s.name == "skyrl.generate"]
    assert batch.status.status_code == StatusCode.ERROR
    rollouts = _children(spans, batch)
    assert len(rollouts) == 3
    for rollout in rollouts:
        assert rollout.status.description == "cancelled"
        (attempt,) = _children(spans, rollout)
        assert attempt.status.description == "cancelled"
        names = [s.name for s in _children(spans, attempt)]
        assert names == ["skyrl.env.init", "skyrl.turn", "skyrl.env.close", "skyrl.finish_session"]


def test_without_opentelemetry_the_error_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_otel(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(ImportError, match=r"pip install 'skyrl-structured\[otel\]'"):
        OpenTelemetryObserver()
