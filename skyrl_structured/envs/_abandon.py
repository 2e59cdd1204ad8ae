"""The one abandoned-work policy: wait for the call in flight, then close; past the bound, chain or kill.

An env's close runs inside the cleanup engine's shielded scope
(:func:`~skyrl_structured._runtime.cleanup.run_cleanups`), bounded by ``env_cleanup_timeout_s``.
:func:`close_after_in_flight` is what every executor's close does there: wait for a call the rollout
left running (so a close never races a step), then close, and when that bound cancels either wait,
hand what still runs to a strategy, the one thing executors do differently:

- :class:`ChainClose` (threads): a thread cannot be stopped, so the close runs in the stuck call's
  thread as soon as that call returns, and stays counted as live until it has;
- :class:`KillWorker` (worker processes, Ray actors): the worker is killed, its envs fail with
  :class:`~skyrl_structured.EnvWorkerError`, and the pool replaces it.

Killing is only ever for a bound of the rollout's own (DESIGN rule 17): cleanup's
``env_cleanup_timeout_s`` here, or its ``rollout_timeout_s`` for a call in flight
(:func:`kill_worker`, from :mod:`~skyrl_structured.envs._remote`); a caller's deadline or cancel
around ``generate()`` only ever leads to a close.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._runtime.cleanup import CleanupStats
from .._runtime.completion import Completion
from ._pool import Reply, Transport
from ._threads import EnvCall, EnvThreadPool

__all__ = ["AbandonStrategy", "ChainClose", "KillWorker", "close_after_in_flight", "kill_worker"]

C = TypeVar("C", bound=Completion[Any], covariant=True)


class AbandonStrategy(Protocol[C]):
    """How an executor starts an env's close, and what it does with work cleanup stopped waiting for."""

    def start_close(self) -> C | None:
        """Submit the env's close now; None when there is nothing left to close."""
        ...

    def abandon(self, running: Completion[Any], *, close_started: bool) -> None:
        """Cleanup's bound ran out while ``running`` (the call in flight, or the close) had not returned.

        ``close_started`` is False while the close was still to come (``running`` is the stuck call).
        """
        ...


async def close_after_in_flight(in_flight: Completion[Any] | None, strategy: AbandonStrategy[C]) -> C | None:
    """Wait for ``in_flight`` (a call the rollout left running), then close; the close's outcome.

    Run inside the cleanup engine's shielded scope, so only its bound (``env_cleanup_timeout_s``)
    cancels the waits; cancelled, the work still running goes to ``strategy.abandon`` and the
    cancellation propagates (the engine reports the timeout).
    """
    running = in_flight
    close: C | None = None
    try:
        if running is not None and not running.done:
            await running.wait()
        close = strategy.start_close()
        running = close
        if close is not None and not close.done:
            await close.wait()
    except BaseException:
        if running is not None:
            strategy.abandon(running, close_started=close is not None)
        raise
    return close


class ChainClose:
    """Threads: the close is chained after the stuck call, in its thread, and runs when it returns."""

    __slots__ = ("_pool", "close", "late")

    def __init__(self, pool: EnvThreadPool, close: EnvCall[Any]) -> None:
        self._pool = pool
        #: The env's close, not yet submitted.
        self.close = close
        #: The close once cleanup stopped waiting for it: it still runs (the env stays live until then).
        self.late: EnvCall[Any] | None = None

    def start_close(self) -> EnvCall[Any]:
        self._pool.submit(self.close)
        return self.close

    def abandon(self, running: Completion[Any], *, close_started: bool) -> None:
        self.late = self.close  # set first: the close may start in its thread at once
        if not close_started:
            assert isinstance(running, EnvCall)
            running.then(self.close, self._pool)


def kill_worker(worker: Transport, what: str, why: str, stats: CleanupStats) -> None:
    """Kill ``worker`` because ``what`` still ran past ``why`` (a bound named with its value); counted once."""
    if worker.kill(f"{what} was still running past {why}"):
        stats.env_workers_killed += 1


class KillWorker:
    """Worker processes and Ray actors: past the bound, the env's worker is killed."""

    __slots__ = ("_bound_s", "_start", "_stats", "_worker")

    def __init__(
        self, worker: Transport, start: Callable[[], Reply | None], stats: CleanupStats, bound_s: float
    ) -> None:
        self._worker = worker
        self._start = start
        self._stats = stats
        #: ``env_cleanup_timeout_s``, for the log line.
        self._bound_s = bound_s

    def start_close(self) -> Reply | None:
        return self._start()

    def abandon(self, running: Completion[Any], *, close_started: bool) -> None:
        if not running.done:
            assert isinstance(running, Reply)
            kill_worker(self._worker, running.what, f"env_cleanup_timeout_s={self._bound_s:g}s", self._stats)
        elif not close_started:
            self._start()  # the stuck call returned as the bound ran out: the close still goes (unwaited)
