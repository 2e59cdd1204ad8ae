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
``TimeoutError``), in the ``failure`` category. A rollout the straggler cutoff ended is no failure:
its attempt and rollout spans say ``"outcome": "cut"`` and it gets a ``straggler cut`` instant in
the ``cut`` category; any other cancelled attempt (an interrupt, the caller's cancel) says
``"outcome": "cancelled"``.

With ``max_concurrent_rollouts="auto"``, the admission limit and the fullest engine server's
KV-cache usage are counter tracks (``"ph": "C"``, ``admission limit`` and ``kv cache usage``,
category ``admission``) of the batch running when they were read, and each change of the limit is
a process-wide instant named ``admission <reason>`` (``admission grow``, ``admission cut_preempted``).
With an inference client that routes over several servers, each server's sessions and load are
counter tracks too (``engine sessions`` and ``engine load``, one series per server URL, category
``routing``), read about once a second.

While the batch runs, :class:`TraceRecorder` only logs the events (cheap, see its docstring);
:class:`_TraceBuilder` replays the log into complete (``"ph": "X"``) events with integer
microsecond timestamps, so a trace never holds an unmatched begin: what is still open when a
batch ends (a cancelled backoff, say) is closed there and marked ``unfinished``. The trace format
is Google's "Trace Event Format" document; Perfetto (https://ui.perfetto.dev) opens the file as is.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..types import ROLLOUT_ERROR_STOP_REASON, TrajectoryID
from .base import (
    CleanupKind,
    CleanupOutcome,
    EngineRoute,
    EnvMethod,
    FinishedTrajectory,
    RolloutObserver,
    RolloutRef,
)

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


def _id_text(trajectory_id: TrajectoryID | None) -> str | None:
    if trajectory_id is None:
        return None
    to_string = getattr(trajectory_id, "to_string", None)
    return str(to_string()) if callable(to_string) else str(trajectory_id)


def _error_text(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class _Err(NamedTuple):
    """An exception as the trace shows it: its type's name and ``"Type: message"``."""

    name: str
    text: str


class TraceRecorder(RolloutObserver):
    """Records every rollout's spans; :meth:`trace` returns the trace-event JSON, :meth:`write` saves it.

    Add it to ``generator.observers``; it keeps recording across ``generate()`` calls, one trace
    process per call. While the batch runs it only logs each event with a clock reading, as a
    tuple of numbers and strings appended to a list on the event loop's thread (the garbage
    collector stops tracking such tuples, so a long log does not slow collections down); the
    spans are built from that log when the trace is asked for. An exception is logged as its type
    name and message, so the log keeps no traceback (and no rollout's frames) alive.

    Args:
        clock: nanoseconds from a monotonic clock (``time.perf_counter_ns``, a test's own clock).
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        #: (ns, event, rollout index, attempt, trajectory id text, the event's own values...)
        self._log: list[tuple[Any, ...]] = []

    # ------------------------------------------------------------------ the trace

    def trace(self) -> dict[str, Any]:
        """The trace so far, as the JSON object Perfetto and ``chrome://tracing`` open."""
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    @property
    def events(self) -> list[dict[str, Any]]:
        """The trace's events so far (metadata, complete spans, instants), in the order they ended."""
        builder = _TraceBuilder()
        origin = self._log[0][0] if self._log else 0
        for when, event, index, attempt, trajectory_id, *values in list(self._log):
            builder.now_us = (when - origin) // 1000
            _REPLAY[event](builder, RolloutRef(index, attempt, trajectory_id), *values)
        return builder.events()

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`trace` to ``path`` (atomically: a reader never sees half a file) and return it."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(self.trace(), separators=(",", ":")), encoding="utf-8")
        partial.replace(target)
        return target

    # ------------------------------------------------------------------ the events, logged

    def batch_started(self, size: int) -> None:
        self._log.append((self._clock(), _BATCH_STARTED, -1, 0, None, size))

    def attempt_started(self, rollout: RolloutRef) -> None:
        trajectory_id = _id_text(rollout.trajectory_id) if rollout.attempt == 1 else None
        self._log.append((self._clock(), _ATTEMPT_STARTED, rollout.index, rollout.attempt, trajectory_id))

    def env_opened(self, rollout: RolloutRef) -> None:
        self._log.append((self._clock(), _ENV_OPENED, rollout.index, rollout.attempt, None))

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        self._log.append((self._clock(), _ENV_CALL_STARTED, rollout.index, rollout.attempt, None, method, turn))

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: BaseException | None) -> None:
        name, text = _failure(error)
        entry = (self._clock(), _ENV_CALL_FINISHED, rollout.index, rollout.attempt, None, method, turn, name, text)
        self._log.append(entry)

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        entry = (self._clock(), _ENGINE_CALL_STARTED, rollout.index, rollout.attempt, None, turn, prompt_tokens)
        self._log.append(entry)

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        name, text = _failure(error)
        ref = rollout.index, rollout.attempt, None
        self._log.append((self._clock(), _ENGINE_CALL_FINISHED, *ref, turn, response_tokens, stop_reason, name, text))

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        self._log.append((self._clock(), _CLEANUP_STARTED, rollout.index, rollout.attempt, None, kind))

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        name, text = _failure(error)
        ref = rollout.index, rollout.attempt, None
        self._log.append((self._clock(), _CLEANUP_FINISHED, *ref, kind, outcome, name, text))

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._log.append((self._clock(), _ATTEMPT_FINISHED, rollout.index, rollout.attempt, None))

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        name, text = _failure(error)
        ref = rollout.index, rollout.attempt, None
        self._log.append((self._clock(), _ATTEMPT_FAILED, *ref, name, text, timed_out, will_retry))

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self._log.append((self._clock(), _ATTEMPT_CANCELLED, rollout.index, rollout.attempt, None))

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        self._log.append((self._clock(), _RETRY_BACKOFF, rollout.index, rollout.attempt, None, delay))

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        if trajectory.cut:  # only a cut: every other outcome is told by the attempt's own event
            self._log.append((self._clock(), _ROLLOUT_CUT, rollout.index, rollout.attempt, None, trajectory.error))

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self._log.append((self._clock(), _ROLLOUT_FINISHED, rollout.index, rollout.attempt, None, failed))

    def batch_finished(self, size: int, failed: int) -> None:
        self._log.append((self._clock(), _BATCH_FINISHED, -1, 0, None))

    def batch_aborted(self, size: int, error: BaseException) -> None:
        name, text = _failure(error)
        self._log.append((self._clock(), _BATCH_ABORTED, -1, 0, None, name, text))

    def admission_decided(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        self._log.append((self._clock(), _ADMISSION, -1, 0, None, limit, previous, reason, kv_cache_usage))

    def engine_routes_read(self, routes: Sequence[EngineRoute]) -> None:
        servers = tuple((route.server, route.sessions, route.load) for route in routes)
        self._log.append((self._clock(), _ROUTES, -1, 0, None, servers))


def _failure(error: BaseException | None) -> tuple[str | None, str | None]:
    return (None, None) if error is None else (type(error).__name__, _error_text(error))


def _err(name: str | None, text: str | None) -> _Err | None:
    return None if name is None or text is None else _Err(name, text)


class _TraceBuilder:
    """Turns a recorder's log into trace events: replays it, each entry at its own time."""

    def __init__(self) -> None:
        self.now_us = 0
        self._records: list[dict[str, Any] | _Ended] = []
        #: The open spans of each rollout of the current batch, outermost first.
        self._open: dict[int, list[_Span]] = {}
        #: The args of each rollout's last ended attempt and rollout spans (a cut marks them afterwards).
        self._ended: dict[tuple[int, str], dict[str, Any]] = {}
        self._batch = 0

    def events(self) -> list[dict[str, Any]]:
        return [_as_event(record) if isinstance(record, tuple) else record for record in self._records]

    # ------------------------------------------------------------------ spans

    def _now_us(self) -> int:
        return self.now_us

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._records.append({"ph": "M", "name": name, "pid": self._batch, "tid": tid, "args": args})

    def _push(self, index: int, name: str, cat: str, args: dict[str, Any]) -> None:
        stack = self._open.get(index)
        if stack is None:
            stack = self._open[index] = []
        stack.append(_Span(name, cat, self._now_us(), args))

    def _end(self, index: int, span: _Span, end_us: int) -> None:
        self._records.append((self._batch, index, span.name, span.cat, span.start_us, end_us, span.args))
        if span.cat in ("attempt", "rollout"):
            self._ended[index, span.cat] = span.args

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
        self._batch += 1
        self._open = {}
        self._ended = {}
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

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: _Err | None) -> None:
        self._close(rollout.index, _ENV_SPAN[method], None if error is None else {"error": error.text})

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        self._push(rollout.index, "engine", "engine", {"turn": turn, "prompt_tokens": prompt_tokens})

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: _Err | None,
    ) -> None:
        index = rollout.index
        if error is not None:
            self._close(index, "engine", {"error": error.text})
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
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: _Err | None
    ) -> None:
        args: dict[str, Any] = {"outcome": outcome}
        if error is not None:
            args["error"] = error.text
        self._close(rollout.index, _CLEANUP_SPAN[kind], args)

    def attempt_finished(self, rollout: RolloutRef) -> None:
        self._close(rollout.index, self._attempt(rollout), {"outcome": "ok"})

    def attempt_failed(self, rollout: RolloutRef, error: _Err, timed_out: bool, will_retry: bool) -> None:
        index = rollout.index
        text = error.text
        self._close(index, self._attempt(rollout), {"outcome": "failed", "error": text, "timed_out": timed_out})
        stack = self._open.get(index)
        if stack and not will_retry:
            stack[0].args.update(stop_reason=ROLLOUT_ERROR_STOP_REASON, error=text)
        self._records.append(
            {
                "ph": "i",
                "s": "t",
                "name": error.name,
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

    def rollout_cut(self, rollout: RolloutRef, error: str) -> None:
        """The straggler cutoff ended the rollout: its closed spans say so, and an instant marks it."""
        index = rollout.index
        for cat in ("attempt", "rollout"):
            args = self._ended.get((index, cat))
            if args is not None:
                args["outcome"] = "cut"
                if cat == "rollout":
                    args.update(stop_reason=ROLLOUT_ERROR_STOP_REASON, error=error)
        self._records.append(
            {
                "ph": "i",
                "s": "t",
                "name": "straggler cut",
                "cat": "cut",
                "pid": self._batch,
                "tid": index,
                "ts": self._now_us(),
                "args": {"attempt": rollout.attempt, "error": error},
            }
        )

    def rollout_finished(self, rollout: RolloutRef, failed: bool) -> None:
        self._close(rollout.index, f"rollout {rollout.index}", {"failed": failed})

    def admission(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        """``max_concurrent_rollouts="auto"``: the limit and the KV usage as counter tracks, a change as an instant."""
        now = self._now_us()
        counters: list[tuple[str, dict[str, Any]]] = [("admission limit", {"limit": limit})]
        if kv_cache_usage is not None:
            counters.append(("kv cache usage", {"usage": round(kv_cache_usage, 4)}))
        for name, args in counters:
            self._records.append(
                {"ph": "C", "name": name, "cat": "admission", "pid": self._batch, "ts": now, "args": args}
            )
        if limit != previous:
            self._records.append(
                {
                    "ph": "i",
                    "s": "p",
                    "name": f"admission {reason}",
                    "cat": "admission",
                    "pid": self._batch,
                    "tid": 0,
                    "ts": now,
                    "args": {"limit": limit, "previous": previous, "reason": reason},
                }
            )

    def routes(self, servers: tuple[tuple[str, int, float], ...]) -> None:
        """Routing over several servers: each one's sessions and load as counter tracks."""
        now = self._now_us()
        for name, args in (
            ("engine sessions", {server: sessions for server, sessions, _ in servers}),
            ("engine load", {server: round(load, 4) for server, _, load in servers}),
        ):
            self._records.append(
                {"ph": "C", "name": name, "cat": "routing", "pid": self._batch, "ts": now, "args": args}
            )

    def batch_finished(self) -> None:
        self._close_all()

    def batch_aborted(self, error: _Err) -> None:
        self._records.append(
            {
                "ph": "i",
                "s": "p",
                "name": f"batch aborted: {error.name}",
                "cat": "failure",
                "pid": self._batch,
                "tid": 0,
                "ts": self._now_us(),
                "args": {"error": error.text},
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


# The log's event codes, and how each entry is replayed into the builder: (builder, rollout, *values).
(
    _BATCH_STARTED,
    _ATTEMPT_STARTED,
    _ENV_OPENED,
    _ENV_CALL_STARTED,
    _ENV_CALL_FINISHED,
    _ENGINE_CALL_STARTED,
    _ENGINE_CALL_FINISHED,
    _CLEANUP_STARTED,
    _CLEANUP_FINISHED,
    _ATTEMPT_FINISHED,
    _ATTEMPT_FAILED,
    _ATTEMPT_CANCELLED,
    _RETRY_BACKOFF,
    _ROLLOUT_FINISHED,
    _BATCH_FINISHED,
    _BATCH_ABORTED,
    _ROLLOUT_CUT,
    _ADMISSION,
    _ROUTES,
) = range(19)

_REPLAY: dict[int, Callable[..., None]] = {
    _BATCH_STARTED: lambda b, r, size: b.batch_started(size),
    _ATTEMPT_STARTED: _TraceBuilder.attempt_started,
    _ENV_OPENED: _TraceBuilder.env_opened,
    _ENV_CALL_STARTED: _TraceBuilder.env_call_started,
    _ENV_CALL_FINISHED: lambda b, r, method, turn, name, text: b.env_call_finished(r, method, turn, _err(name, text)),
    _ENGINE_CALL_STARTED: _TraceBuilder.engine_call_started,
    _ENGINE_CALL_FINISHED: lambda b, r, turn, tokens, stop, name, text: b.engine_call_finished(
        r, turn, tokens, stop, _err(name, text)
    ),
    _CLEANUP_STARTED: _TraceBuilder.cleanup_started,
    _CLEANUP_FINISHED: lambda b, r, kind, outcome, name, text: b.cleanup_finished(r, kind, outcome, _err(name, text)),
    _ATTEMPT_FINISHED: _TraceBuilder.attempt_finished,
    _ATTEMPT_FAILED: lambda b, r, name, text, timed_out, will_retry: b.attempt_failed(
        r, _Err(name, text), timed_out, will_retry
    ),
    _ATTEMPT_CANCELLED: _TraceBuilder.attempt_cancelled,
    _RETRY_BACKOFF: _TraceBuilder.retry_backoff,
    _ROLLOUT_FINISHED: _TraceBuilder.rollout_finished,
    _ROLLOUT_CUT: _TraceBuilder.rollout_cut,
    _BATCH_FINISHED: lambda b, r: b.batch_finished(),
    _BATCH_ABORTED: lambda b, r, name, text: b.batch_aborted(_Err(name, text)),
    _ADMISSION: lambda b, r, limit, previous, reason, kv: b.admission(limit, previous, reason, kv),
    _ROUTES: lambda b, r, servers: b.routes(servers),
}
