"""``OpenTelemetryObserver``: each batch, rollout, attempt and turn as an OpenTelemetry span.

Needs the ``otel`` extra (``pip install 'skyrl-structured[otel]'``: ``opentelemetry-api`` and
``-sdk``); the spans go wherever the tracer provider exports them (Jaeger, Tempo, an OTLP
collector). The structure is the trace recorder's, as a tree::

    skyrl.generate                      the generate() call (a child of the caller's current span)
      skyrl.rollout                     skyrl.rollout.index, skyrl.trajectory_id, skyrl.attempts
        skyrl.attempt                   skyrl.attempt; ERROR status and the exception when it failed
          skyrl.env.init
          skyrl.turn                    skyrl.turn, prompt/response tokens, stop reason
            skyrl.engine   skyrl.env.step
          skyrl.env.close   skyrl.finish_session
        skyrl.backoff                   before a retry

Every span started is ended: a cancelled attempt ends with its rollout (status ERROR,
``cancelled``), and whatever is still open when the batch ends (``batch_finished`` or
``batch_aborted``) is ended there, so no span leaks out of a cancelled ``generate()``.
"""

from __future__ import annotations

from typing import Any

from ..types import TrajectoryID
from .base import CleanupKind, CleanupOutcome, EnvMethod, RolloutObserver, RolloutRef

__all__ = ["OpenTelemetryObserver"]

_INSTALL = "OpenTelemetryObserver needs OpenTelemetry: pip install 'skyrl-structured[otel]'"


def _id_text(trajectory_id: TrajectoryID | None) -> str:
    to_string = getattr(trajectory_id, "to_string", None)
    return str(to_string()) if callable(to_string) else str(trajectory_id)


class OpenTelemetryObserver(RolloutObserver):
    """Emits OpenTelemetry spans for every rollout (see the module docstring for the tree).

    Args:
        tracer_provider: where the spans go; None uses the global provider
            (``opentelemetry.trace.set_tracer_provider``).

    Raises:
        ImportError: OpenTelemetry is not installed (the message gives the ``pip install`` line).
    """

    def __init__(self, tracer_provider: Any | None = None) -> None:
        try:
            from opentelemetry import context as otel_context
            from opentelemetry import trace
        except ImportError as exc:
            raise ImportError(_INSTALL) from exc
        self._trace = trace
        self._context = otel_context
        self._tracer = trace.get_tracer("skyrl_structured", tracer_provider=tracer_provider)
        self._batch: Any | None = None
        #: Per rollout index: its open spans, outermost (the rollout's) first, as (name, span).
        self._open: dict[int, list[tuple[str, Any]]] = {}

    # ------------------------------------------------------------------ spans

    def _start(self, name: str, parent: Any | None, attributes: dict[str, Any]) -> Any:
        context = self._trace.set_span_in_context(parent) if parent is not None else self._context.get_current()
        return self._tracer.start_span(name, context=context, attributes=attributes)

    def _push(self, index: int, name: str, attributes: dict[str, Any]) -> None:
        stack = self._open.setdefault(index, [])
        parent = stack[-1][1] if stack else self._batch
        stack.append((name, self._start(name, parent, attributes)))

    def _pop(self, index: int, name: str, error: BaseException | None = None, **attributes: Any) -> None:
        """End the innermost open span ``name`` (and, first, any span still open inside it)."""
        stack = self._open.get(index)
        if not stack or all(open_name != name for open_name, _ in stack):
            return
        while stack:
            open_name, span = stack.pop()
            if open_name != name:
                self._fail(span, "ended with its parent", None)
                span.end()
                continue
            if attributes:
                span.set_attributes({k: v for k, v in attributes.items() if v is not None})
            if error is not None:
                self._fail(span, f"{type(error).__name__}: {error}", error)
            span.end()
            return

    def _fail(self, span: Any, description: str, error: BaseException | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, description))

    def _end_all(self) -> None:
        for stack in self._open.values():
            while stack:
                _, span = stack.pop()
                self._fail(span, "unfinished when the batch ended", None)
                span.end()
        self._open = {}

    # ------------------------------------------------------------------ the events

    def batch_started(self, size: int) -> None:
        self._end_all()
        self._batch = self._start("skyrl.generate", None, {"skyrl.batch.size": size})

    def attempt_started(self, rollout: RolloutRef) -> None:
        index = rollout.index
        if not self._open.get(index):
            attributes: dict[str, Any] = {"skyrl.rollout.index": index}
            if rollout.trajectory_id is not None:
                attributes["skyrl.trajectory_id"] = _id_text(rollout.trajectory_id)
            self._push(index, "skyrl.rollout", attributes)
        else:
            self._pop(index, "skyrl.backoff")
        self._push(index, "skyrl.attempt", {"skyrl.rollout.index": index, "skyrl.attempt": rollout.attempt})

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        self._push(rollout.index, f"skyrl.env.{method}", {"skyrl.turn": turn})

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: BaseException | None) -> None:
        self._pop(rollout.index, f"skyrl.env.{method}", error)
        if method == "step":
            self._pop(rollout.index, "skyrl.turn", error)

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        self._push(rollout.index, "skyrl.turn", {"skyrl.turn": turn, "skyrl.prompt_tokens": prompt_tokens})
        self._push(rollout.index, "skyrl.engine", {"skyrl.turn": turn})

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        self._pop(rollout.index, "skyrl.engine", error, **{"skyrl.response_tokens": response_tokens})
        stack = self._open.get(rollout.index)
        if stack and stack[-1][0] == "skyrl.turn":
            turn_span = stack[-1][1]
            if response_tokens is not None:
                turn_span.set_attribute("skyrl.response_tokens", response_tokens)
            if stop_reason is not None:
                turn_span.set_attribute("skyrl.stop_reason", stop_reason)
            if error is not None:
                self._pop(rollout.index, "skyrl.turn", error)

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        stack = self._open.get(rollout.index)
        if stack and stack[-1][0] == "skyrl.turn":  # a turn cut short (the step never ran)
            self._pop(rollout.index, "skyrl.turn")
        name = "skyrl.env.close" if kind == "env_close" else "skyrl.finish_session"
        self._push(rollout.index, name, {})

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        name = "skyrl.env.close" if kind == "env_close" else "skyrl.finish_session"
        self._pop(rollout.index, name, error, **{"skyrl.cleanup.outcome": outcome})

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._pop(rollout.index, "skyrl.attempt")

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        attributes = {"skyrl.timed_out": timed_out, "skyrl.will_retry": will_retry}
        self._pop(rollout.index, "skyrl.attempt", error, **attributes)
        if not will_retry:
            stack = self._open.get(rollout.index)
            if stack:
                stack[0][1].set_attribute("skyrl.error.type", type(error).__name__)

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        stack = self._open.get(rollout.index)
        while stack:
            _, span = stack.pop()
            self._fail(span, "cancelled", None)
            span.end()

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        self._push(rollout.index, "skyrl.backoff", {"skyrl.backoff_s": delay})

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        stack = self._open.get(rollout.index)
        if not stack:
            return
        rollout_span = stack[0][1]
        rollout_span.set_attributes({"skyrl.attempts": rollout.attempt, "skyrl.failed": failed})
        if failed:
            self._fail(rollout_span, "the rollout failed", None)
        self._pop(rollout.index, "skyrl.rollout")

    def batch_finished(self, size: int, failed: int) -> None:
        self._end_all()
        if self._batch is not None:
            self._batch.set_attribute("skyrl.batch.failed", failed)
            self._batch.end()
            self._batch = None

    def batch_aborted(self, size: int, error: BaseException) -> None:
        self._end_all()
        if self._batch is not None:
            self._fail(self._batch, f"{type(error).__name__}: {error}", None)
            self._batch.end()
            self._batch = None
