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
``routing``), read about once a second. With the agent endpoint in worker processes
(``generator.agent_endpoint_workers``), a process of its own, ``agent endpoint workers`` (the pool
outlives the calls), holds each worker's open sessions as a counter track (``endpoint sessions``,
one series ``worker <index>`` per slot, category ``agent_endpoint``), read about once a second and
as soon as a worker dies or is replaced, with process-wide instants ``endpoint worker died`` (the
slot's index, the dead pid, its port) and ``endpoint worker replaced``
(the new pid and the previous one).

While the batch runs, :class:`TraceRecorder` only logs the events (cheap, see its docstring);
:class:`TraceBuilder` replays the log into complete (``"ph": "X"``) events with integer
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
from typing import Any

from ._trace_replay import (
    ADMISSION,
    ATTEMPT_CANCELLED,
    ATTEMPT_FAILED,
    ATTEMPT_FINISHED,
    ATTEMPT_STARTED,
    BATCH_ABORTED,
    BATCH_FINISHED,
    BATCH_STARTED,
    CLEANUP_FINISHED,
    CLEANUP_STARTED,
    ENGINE_CALL_FINISHED,
    ENGINE_CALL_STARTED,
    ENV_CALL_FINISHED,
    ENV_CALL_STARTED,
    ENV_OPENED,
    REPLAY,
    RETRY_BACKOFF,
    ROLLOUT_CUT,
    ROLLOUT_FINISHED,
    ROUTES,
    WORKERS,
    TraceBuilder,
    id_text,
)
from .base import (
    CleanupKind,
    CleanupOutcome,
    EndpointWorker,
    EngineRoute,
    EnvMethod,
    FinishedTrajectory,
    RolloutObserver,
    RolloutRef,
)

__all__ = ["TraceRecorder"]


def _error_text(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


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
        builder = TraceBuilder()
        origin = self._log[0][0] if self._log else 0
        for when, event, index, attempt, trajectory_id, *values in list(self._log):
            builder.now_us = (when - origin) // 1000
            REPLAY[event](builder, RolloutRef(index, attempt, trajectory_id), *values)
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
        self._log.append((self._clock(), BATCH_STARTED, -1, 0, None, size))

    def attempt_started(self, rollout: RolloutRef) -> None:
        trajectory_id = id_text(rollout.trajectory_id) if rollout.attempt == 1 else None
        self._log.append((self._clock(), ATTEMPT_STARTED, rollout.index, rollout.attempt, trajectory_id))

    def env_opened(self, rollout: RolloutRef) -> None:
        self._log.append((self._clock(), ENV_OPENED, rollout.index, rollout.attempt, None))

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        self._log.append((self._clock(), ENV_CALL_STARTED, rollout.index, rollout.attempt, None, method, turn))

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: BaseException | None) -> None:
        name, text = _failure(error)
        entry = (self._clock(), ENV_CALL_FINISHED, rollout.index, rollout.attempt, None, method, turn, name, text)
        self._log.append(entry)

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        entry = (self._clock(), ENGINE_CALL_STARTED, rollout.index, rollout.attempt, None, turn, prompt_tokens)
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
        self._log.append((self._clock(), ENGINE_CALL_FINISHED, *ref, turn, response_tokens, stop_reason, name, text))

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        self._log.append((self._clock(), CLEANUP_STARTED, rollout.index, rollout.attempt, None, kind))

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        name, text = _failure(error)
        ref = rollout.index, rollout.attempt, None
        self._log.append((self._clock(), CLEANUP_FINISHED, *ref, kind, outcome, name, text))

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._log.append((self._clock(), ATTEMPT_FINISHED, rollout.index, rollout.attempt, None))

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        name, text = _failure(error)
        ref = rollout.index, rollout.attempt, None
        self._log.append((self._clock(), ATTEMPT_FAILED, *ref, name, text, timed_out, will_retry))

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self._log.append((self._clock(), ATTEMPT_CANCELLED, rollout.index, rollout.attempt, None))

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        self._log.append((self._clock(), RETRY_BACKOFF, rollout.index, rollout.attempt, None, delay))

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        if trajectory.cut:  # only a cut: every other outcome is told by the attempt's own event
            self._log.append((self._clock(), ROLLOUT_CUT, rollout.index, rollout.attempt, None, trajectory.error))

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self._log.append((self._clock(), ROLLOUT_FINISHED, rollout.index, rollout.attempt, None, failed))

    def batch_finished(self, size: int, failed: int) -> None:
        self._log.append((self._clock(), BATCH_FINISHED, -1, 0, None))

    def batch_aborted(self, size: int, error: BaseException) -> None:
        name, text = _failure(error)
        self._log.append((self._clock(), BATCH_ABORTED, -1, 0, None, name, text))

    def admission_decided(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        self._log.append((self._clock(), ADMISSION, -1, 0, None, limit, previous, reason, kv_cache_usage))

    def engine_routes_read(self, routes: Sequence[EngineRoute]) -> None:
        servers = tuple((route.server, route.sessions, route.load) for route in routes)
        self._log.append((self._clock(), ROUTES, -1, 0, None, servers))

    def endpoint_workers_read(self, workers: Sequence[EndpointWorker]) -> None:
        slots = tuple((w.index, w.pid, w.port, w.up, w.sessions, w.restarts, w.sessions_lost) for w in workers)
        self._log.append((self._clock(), WORKERS, -1, 0, None, slots))


def _failure(error: BaseException | None) -> tuple[str | None, str | None]:
    return (None, None) if error is None else (type(error).__name__, _error_text(error))
