"""How a :class:`~skyrl_structured._observers.trace.TraceRecorder` log becomes trace events.

The recorder only appends ``(ns, event code, rollout index, attempt, trajectory id, values...)`` while
the batch runs; :class:`TraceBuilder` replays that log, each entry at its own time, into complete
(``"ph": "X"``) events with integer microsecond timestamps, closing at a batch's end whatever is still
open (marked ``unfinished``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..types import ROLLOUT_ERROR_STOP_REASON, TrajectoryID
from .base import CleanupKind, CleanupOutcome, EnvMethod, RolloutRef

# The log's event codes, and how each entry is replayed into the builder: (builder, rollout, *values).
(
    BATCH_STARTED,
    ATTEMPT_STARTED,
    ENV_OPENED,
    ENV_CALL_STARTED,
    ENV_CALL_FINISHED,
    ENGINE_CALL_STARTED,
    ENGINE_CALL_FINISHED,
    CLEANUP_STARTED,
    CLEANUP_FINISHED,
    ATTEMPT_FINISHED,
    ATTEMPT_FAILED,
    ATTEMPT_CANCELLED,
    RETRY_BACKOFF,
    ROLLOUT_FINISHED,
    BATCH_FINISHED,
    BATCH_ABORTED,
    ROLLOUT_CUT,
    ADMISSION,
    ROUTES,
    WORKERS,
) = range(20)

#: The trace process of the agent endpoint's workers: the generator's pool, not one call's, so a process of its
#: own (a pid no batch reaches; Perfetto takes pid 0 for the kernel's swapper).
ENDPOINT_PID = 2**31 - 1

#: One slot of the endpoint workers as logged: (index, pid, port, up, sessions, restarts, sessions lost).
WorkerSlot = tuple[int, int | None, int, bool, int, int, int]


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


def id_text(trajectory_id: TrajectoryID | None) -> str | None:
    if trajectory_id is None:
        return None
    to_string = getattr(trajectory_id, "to_string", None)
    return str(to_string()) if callable(to_string) else str(trajectory_id)


class _Err(NamedTuple):
    """An exception as the trace shows it: its type's name and ``"Type: message"``."""

    name: str
    text: str


def _err(name: str | None, text: str | None) -> _Err | None:
    return None if name is None or text is None else _Err(name, text)


class _Seen:
    """An endpoint worker slot as the last reading showed it: what tells a death or a replacement."""

    __slots__ = ("down", "live_pid", "lost", "restarts", "up")

    def __init__(self, pid: int | None, up: bool, restarts: int, lost: int) -> None:
        #: The pid it last had while up (the worker a death is about).
        self.live_pid = pid if up else None
        self.up = up
        self.restarts = restarts
        self.lost = lost
        #: Its death is told and no replacement is up yet.
        self.down = not up


class TraceBuilder:
    """Turns a recorder's log into trace events: replays it, each entry at its own time."""

    def __init__(self) -> None:
        self.now_us = 0
        self._records: list[dict[str, Any] | _Ended] = []
        #: The open spans of each rollout of the current batch, outermost first.
        self._open: dict[int, list[_Span]] = {}
        #: The args of each rollout's last ended attempt and rollout spans (a cut marks them afterwards).
        self._ended: dict[tuple[int, str], dict[str, Any]] = {}
        self._batch = 0
        #: The endpoint worker slots seen so far, by index (the pool outlives the calls: never reset).
        self._workers: dict[int, _Seen] = {}

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
            self._push(index, f"rollout {index}", "rollout", {"trajectory_id": id_text(rollout.trajectory_id)})
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

    def endpoint_workers(self, slots: tuple[WorkerSlot, ...]) -> None:
        """Endpoint worker processes: each one's open sessions as a counter track, a death or a replacement as
        an instant, in a process of their own (:data:`ENDPOINT_PID`)."""
        now = self._now_us()
        if not self._workers:
            meta: tuple[tuple[str, dict[str, Any]], ...] = (
                ("process_name", {"name": "agent endpoint workers"}),
                ("process_sort_index", {"sort_index": 0}),
            )
            for name, args in meta:
                self._records.append({"ph": "M", "name": name, "pid": ENDPOINT_PID, "tid": 0, "args": args})
        sessions = {f"worker {slot[0]}": slot[4] for slot in slots}
        self._records.append(
            {
                "ph": "C",
                "name": "endpoint sessions",
                "cat": "agent_endpoint",
                "pid": ENDPOINT_PID,
                "ts": now,
                "args": sessions,
            }
        )
        for index, pid, port, up, _, restarts, lost in slots:
            seen = self._workers.get(index)
            if seen is None:
                self._workers[index] = _Seen(pid, up, restarts, lost)
                continue
            replaced = up and pid is not None and seen.live_pid is not None and pid != seen.live_pid
            if not seen.down and ((seen.up and not up) or lost > seen.lost or restarts > seen.restarts or replaced):
                self._endpoint_instant("died", {"index": index, "pid": seen.live_pid, "port": port})
                seen.down = True
            if replaced:
                args = {"index": index, "pid": pid, "port": port, "previous_pid": seen.live_pid, "restarts": restarts}
                self._endpoint_instant("replaced", args)
            if up and pid is not None:
                seen.live_pid, seen.down = pid, False
            seen.up, seen.restarts, seen.lost = up, restarts, lost

    def _endpoint_instant(self, what: str, args: dict[str, Any]) -> None:
        self._records.append(
            {
                "ph": "i",
                "s": "p",
                "name": f"endpoint worker {what}",
                "cat": "agent_endpoint",
                "pid": ENDPOINT_PID,
                "tid": 0,
                "ts": self._now_us(),
                "args": args,
            }
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


REPLAY: dict[int, Callable[..., None]] = {
    BATCH_STARTED: lambda b, r, size: b.batch_started(size),
    ATTEMPT_STARTED: TraceBuilder.attempt_started,
    ENV_OPENED: TraceBuilder.env_opened,
    ENV_CALL_STARTED: TraceBuilder.env_call_started,
    ENV_CALL_FINISHED: lambda b, r, method, turn, name, text: b.env_call_finished(r, method, turn, _err(name, text)),
    ENGINE_CALL_STARTED: TraceBuilder.engine_call_started,
    ENGINE_CALL_FINISHED: lambda b, r, turn, tokens, stop, name, text: b.engine_call_finished(
        r, turn, tokens, stop, _err(name, text)
    ),
    CLEANUP_STARTED: TraceBuilder.cleanup_started,
    CLEANUP_FINISHED: lambda b, r, kind, outcome, name, text: b.cleanup_finished(r, kind, outcome, _err(name, text)),
    ATTEMPT_FINISHED: TraceBuilder.attempt_finished,
    ATTEMPT_FAILED: lambda b, r, name, text, timed_out, will_retry: b.attempt_failed(
        r, _Err(name, text), timed_out, will_retry
    ),
    ATTEMPT_CANCELLED: TraceBuilder.attempt_cancelled,
    RETRY_BACKOFF: TraceBuilder.retry_backoff,
    ROLLOUT_FINISHED: TraceBuilder.rollout_finished,
    ROLLOUT_CUT: TraceBuilder.rollout_cut,
    BATCH_FINISHED: lambda b, r: b.batch_finished(),
    BATCH_ABORTED: lambda b, r, name, text: b.batch_aborted(_Err(name, text)),
    ADMISSION: lambda b, r, limit, previous, reason, kv: b.admission(limit, previous, reason, kv),
    ROUTES: lambda b, r, servers: b.routes(servers),
    WORKERS: lambda b, r, slots: b.endpoint_workers(slots),
}
