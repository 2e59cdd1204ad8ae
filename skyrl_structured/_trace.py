"""``TraceRecorder``: every rollout of a batch as a Chrome trace-event timeline (Perfetto, ``chrome://tracing``).

The recorder is an observer. Each ``generate()`` call is one process of the trace (``pid`` 1, 2,
... per call) and each rollout one track in it (``tid`` = the rollout's index), holding nested
spans::

    rollout 12                                   trajectory id, attempts, tokens, stop reason, error
      attempt 1                                  outcome, error
        env.make   env.init   engine   env.step   engine   env.step ...   env.close   finish_session
      backoff                                    before a retry: the jittered sleep
      attempt 2 ...

A failed attempt also gets an instant event named for its exception type (``ConnectionError``,
``TimeoutError``, a straggler cut's ``StragglerCutError``), in the ``failure`` category.

Spans are written as complete (``"ph": "X"``) events with integer microsecond timestamps, taken
when a span ends, so a trace never holds an unmatched begin: what is still open when a batch
ends (a cancelled backoff, say) is closed there and marked ``unfinished``. The trace format is
Google's "Trace Event Format" document; Perfetto (https://ui.perfetto.dev) opens the file as is.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .observe import CleanupKind, CleanupOutcome, EnvMethod, RolloutObserver, RolloutRef
from .types import ROLLOUT_ERROR_STOP_REASON

__all__ = ["TraceRecorder"]

#: The track's span names, by what they cover (categories group them in Perfetto's search and in plots).
_ENV_SPAN = {"init": "env.init", "step": "env.step"}
_CLEANUP_SPAN: dict[str, str] = {"env_close": "env.close", "finish_session": "finish_session"}


class _Span:
    """An open span: what its complete event will say once it ends."""

    __slots__ = ("args", "cat", "name", "start_us")

    def __init__(self, name: str, cat: str, start_us: int, args: dict[str, Any]) -> None:
        self.name = name
        self.cat = cat
        self.start_us = start_us
        self.args = args


#: A span that ended: (pid, tid, name, cat, start_us, end_us, args), made a trace event when asked for.
_Ended = tuple[int, int, str, str, int, int, dict[str, Any]]


def _id_text(trajectory_id: Any) -> str | None:
    if trajectory_id is None:
        return None
    to_string = getattr(trajectory_id, "to_string", None)
    return str(to_string()) if callable(to_string) else str(trajectory_id)


def _error_text(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class TraceRecorder(RolloutObserver):
    """Records every rollout's spans; :meth:`trace` returns the trace-event JSON, :meth:`write` saves it.

    Add it to ``generator.observers``; it keeps recording across ``generate()`` calls, one trace
    process per call. It costs one clock read and one small object per span (a few per turn),
    on the event loop's thread, like every observer.

    Args:
        clock: nanoseconds from a monotonic clock (``time.perf_counter_ns``, a test's own clock).
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        self._origin_ns: int | None = None
        # Ended spans are kept as tuples and become dicts only when the trace is asked for: a
        # few per turn, on the event loop's thread.
        self._records: list[dict[str, Any] | _Ended] = []
        #: The open spans of each rollout of the current batch, outermost first.
        self._open: dict[int, list[_Span]] = {}
        self._batch = 0

    # ------------------------------------------------------------------ the trace

    def trace(self) -> dict[str, Any]:
        """The trace so far, as the JSON object Perfetto and ``chrome://tracing`` open."""
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    @property
    def events(self) -> list[dict[str, Any]]:
        """The trace's events so far (metadata, complete spans, instants), in the order they were recorded."""
        return [_as_event(record) if isinstance(record, tuple) else record for record in self._records]

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`trace` to ``path`` (atomically: a reader never sees half a file) and return it."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(self.trace(), separators=(",", ":")), encoding="utf-8")
        partial.replace(target)
        return target

    # ------------------------------------------------------------------ spans

    def _now_us(self) -> int:
        return (self._clock() - (self._origin_ns or 0)) // 1000

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._records.append({"ph": "M", "name": name, "pid": self._batch, "tid": tid, "args": args})

    def _push(self, index: int, name: str, cat: str, args: dict[str, Any]) -> None:
        stack = self._open.get(index)
        if stack is None:
            stack = self._open[index] = []
        stack.append(_Span(name, cat, self._now_us(), args))

    def _end(self, index: int, span: _Span, end_us: int) -> None:
        self._records.append((self._batch, index, span.name, span.cat, span.start_us, end_us, span.args))

    def _close(self, index: int, name: str, args: dict[str, Any] | None = None) -> None:
        """End the innermost open span called ``name``, and the spans inside it (marked ``unfinished``).

        Nothing happens when no such span is open (an event of a rollout this recorder never saw start).
        """
        stack = self._open.get(index)
        if not stack:
            return
        top = stack[-1]
        if top.name != name and all(span.name != name for span in stack):
            return
        end_us = self._now_us()
        while True:
            span = stack.pop()
            if span.name == name:
                if args:
                    span.args.update(args)
                self._end(index, span, end_us)
                return
            span.args["unfinished"] = True
            self._end(index, span, end_us)

    def _close_inside_attempt(self, index: int) -> None:
        """End what is still open inside the rollout's attempt (a span its failure left open), as ``unfinished``."""
        stack = self._open.get(index)
        if not stack:
            return
        end_us = self._now_us()
        while stack and stack[-1].cat not in ("attempt", "rollout"):
            span = stack.pop()
            span.args["unfinished"] = True
            self._end(index, span, end_us)

    def _attempt(self, rollout: RolloutRef) -> str:
        return f"attempt {rollout.attempt}"

    # ------------------------------------------------------------------ the events

    def batch_started(self, size: int) -> None:
        if self._origin_ns is None:
            self._origin_ns = self._clock()
        self._batch += 1
        self._open = {}
        self._meta("process_name", 0, {"name": f"generate() #{self._batch}: {size} rollouts"})
        self._meta("process_sort_index", 0, {"sort_index": self._batch})

    def attempt_started(self, rollout: RolloutRef) -> None:
        index = rollout.index
        stack = self._open.get(index)
        if not stack:
            self._meta("thread_name", index, {"name": f"rollout {index}"})
            self._meta("thread_sort_index", index, {"sort_index": index})
            self._push(index, f"rollout {index}", "rollout", {"trajectory_id": _id_text(rollout.trajectory_id)})
            stack = self._open[index]
        else:
            self._close(index, "backoff")
        # The rollout's figures are its last attempt's: counted afresh by each attempt.
        stack[0].args.update(attempts=rollout.attempt, response_tokens=0)
        self._push(index, self._attempt(rollout), "attempt", {"attempt": rollout.attempt})
        self._push(index, "env.make", "env", {})

    def env_opened(self, rollout: RolloutRef) -> None:
        self._close(rollout.index, "env.make")

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        self._push(rollout.index, _ENV_SPAN[method], "env", {"turn": turn})

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: BaseException | None) -> None:
        self._close(rollout.index, _ENV_SPAN[method], None if error is None else {"error": _error_text(error)})

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        self._push(rollout.index, "engine", "engine", {"turn": turn, "prompt_tokens": prompt_tokens})

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        index = rollout.index
        if error is not None:
            self._close(index, "engine", {"error": _error_text(error)})
            return
        self._close(index, "engine", {"response_tokens": response_tokens, "stop_reason": stop_reason})
        stack = self._open.get(index)
        if stack:
            totals = stack[0].args
            totals["response_tokens"] = totals.get("response_tokens", 0) + (response_tokens or 0)
            totals["stop_reason"] = stop_reason

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        self._close_inside_attempt(rollout.index)
        self._push(rollout.index, _CLEANUP_SPAN[kind], "cleanup", {})

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        args: dict[str, Any] = {"outcome": outcome}
        if error is not None:
            args["error"] = _error_text(error)
        self._close(rollout.index, _CLEANUP_SPAN[kind], args)

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._close(rollout.index, self._attempt(rollout), {"outcome": "ok"})

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        index = rollout.index
        text = _error_text(error)
        self._close(index, self._attempt(rollout), {"outcome": "failed", "error": text, "timed_out": timed_out})
        stack = self._open.get(index)
        if stack and not will_retry:
            stack[0].args.update(stop_reason=ROLLOUT_ERROR_STOP_REASON, error=text)
        self._records.append(
            {
                "ph": "i",
                "s": "t",
                "name": type(error).__name__,
                "cat": "failure",
                "pid": self._batch,
                "tid": index,
                "ts": self._now_us(),
                "args": {"attempt": rollout.attempt, "error": text, "timed_out": timed_out, "will_retry": will_retry},
            }
        )

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self._close(rollout.index, self._attempt(rollout), {"outcome": "cancelled"})
        self._close(rollout.index, f"rollout {rollout.index}", {"outcome": "cancelled"})

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        args = {"delay_s": round(delay, 6), "next_attempt": rollout.attempt + 1}
        self._push(rollout.index, "backoff", "backoff", args)

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self._close(rollout.index, f"rollout {rollout.index}", {"failed": failed})

    def batch_finished(self, size: int, failed: int) -> None:
        self._close_all()

    def batch_aborted(self, size: int, error: BaseException) -> None:
        self._records.append(
            {
                "ph": "i",
                "s": "p",
                "name": f"batch aborted: {type(error).__name__}",
                "cat": "failure",
                "pid": self._batch,
                "tid": 0,
                "ts": self._now_us(),
                "args": {"error": _error_text(error)},
            }
        )
        self._close_all()

    def _close_all(self) -> None:
        end_us = self._now_us()
        for index in sorted(self._open):
            stack = self._open[index]
            while stack:
                span = stack.pop()
                span.args["unfinished"] = True
                self._end(index, span, end_us)
        self._open = {}


def _as_event(record: _Ended) -> dict[str, Any]:
    pid, tid, name, cat, start_us, end_us, args = record
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": start_us,
        "dur": end_us - start_us,
        "args": args,
    }
