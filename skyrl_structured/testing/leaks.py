"""A leak tracker: what a ``generate()`` call left behind that it should not have.

:class:`LeakTracker` takes a baseline when created and reports, against it:

- **environments**: every environment created through an id from :meth:`LeakTracker.track_env`
  must be closed exactly once, and never while one of its own calls was still running;
- **inference sessions**: every session id seen in a ``generate`` request made through
  :meth:`LeakTracker.track_engine` must later get a ``finish_session`` call (a session used again
  after being finished, as a retry does, must be finished again). A ``finish_session`` call counts
  whatever it returned or raised: the generator did its part;
- **tasks**: tasks of the running event loop that did not exist at the baseline and are still
  unfinished (asyncio: ``asyncio.all_tasks()``; trio: the whole task tree from the root task).
  Only checked inside the event loop the baseline was taken in: outside it the loop's runner has
  already cancelled anything left over;
- **threads**: environment calls still running in worker threads
  (:func:`skyrl_structured.envs.active_env_thread_calls` above its baseline, e.g. a ``step`` or
  ``close`` the generator had to abandon); pool worker threads (anyio, trio, executors) busy
  running code that were idle at the baseline; and any other thread started since the baseline
  that is still alive. Idle pool workers are never leaks: pools keep them for reuse. tqdm's
  monitor thread is never a leak either: tqdm starts it with the first progress bar (even a
  disabled one) and keeps it for the life of the process.
- **processes** (``processes=True``, Linux): descendants of this process started since the baseline
  and still running, named with their pid and command line: a sandbox an environment started and
  its ``close`` did not stop (see :mod:`._processes` for what is never counted).

Threads and processes finish on their own schedule, so their checks are retried for up to
``grace_s`` seconds before they count; tasks, environments and sessions are judged at once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Any

import anyio

from ..engines._wrapper import EngineWrapper
from ..envs import active_env_thread_calls
from ..types import InferenceClient
from ._census import current_backend, describe_task, live_tasks, loop_identity, thread_states
from ._processes import ProcessCensus
from ._wrappers import register_wrapper_env, unregister_wrapper_env
from .envs import EnvLedger

__all__ = ["LeakTracker", "TrackedEngine"]


def _is_thread_leak(line: str) -> bool:
    """Whether ``line`` is one of :meth:`LeakTracker.thread_leaks`' (a thread busy or alive, a call running)."""
    return line.startswith("thread ") or "environment calls are still running" in line


def _is_process_leak(line: str) -> bool:
    """Whether ``line`` is one of :meth:`LeakTracker.process_leaks`' (a process left running)."""
    return line.startswith("process left running")


def _is_tqdm_monitor(thread: threading.Thread) -> bool:
    monitor = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", None)
    return monitor is not None and isinstance(thread, monitor)


class TrackedEngine(EngineWrapper):
    """An inference client that reports session starts and finishes to a :class:`LeakTracker`.

    Every other attribute is the wrapped engine's.
    """

    def __init__(self, engine: InferenceClient, tracker: LeakTracker) -> None:
        super().__init__(engine)
        self.tracker = tracker

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        for session_id in input_batch.get("session_ids") or ():
            if session_id is not None:
                self.tracker._session_event(session_id, started=True)
        return await super().generate(input_batch, *args, **kwargs)

    async def finish_session(self, session_id: Hashable) -> None:
        self.tracker._session_event(session_id, started=False)
        await super().finish_session(session_id)


class LeakTracker:
    """Records environments, inference sessions, tasks and threads, and reports what leaked.

    Args:
        ignore_thread: threads for which this returns True are never reported (for a library
            thread you know to be harmless).
        processes: also report processes started since the baseline (descendants of this one)
            that still run (Linux): what an environment's ``close`` forgot to stop.

    Usage::

        tracker = LeakTracker()
        engine = tracker.track_engine(engine)
        env_class = tracker.track_env("my_env")   # use this id in the batch
        async with tracker:                       # task baseline here; checks everything on exit
            await generator.generate(batch)
    """

    def __init__(
        self, *, ignore_thread: Callable[[threading.Thread], bool] | None = None, processes: bool = False
    ) -> None:
        self.ledger = EnvLedger()
        self._ignore_thread = ignore_thread
        self._watch_processes = processes
        self._lock = threading.Lock()
        self._open_sessions: dict[Hashable, None] = {}
        self._started: dict[Hashable, int] = {}
        self._finished: dict[Hashable, int] = {}
        self._env_ids: list[str] = []
        #: True once an ``assert_clean*`` call ran (the pytest fixture then skips its own check).
        self.checked = False
        self.baseline()

    # ------------------------------------------------------------------ setup

    def baseline(self) -> None:
        """(Re)take the reference point: live threads, env thread calls, and (in a loop) tasks."""
        states = thread_states()
        self._threads = {s.thread for s in states}
        self._busy = {s.thread for s in states if s.busy}
        self._env_calls = active_env_thread_calls()
        self._processes = ProcessCensus() if self._watch_processes else None
        self._tasks: set[Any] | None = None
        self._loop: object | None = None
        self._baseline_tasks()

    def _baseline_tasks(self) -> None:
        if self._tasks is None and current_backend() is not None:
            self._tasks = live_tasks()
            self._loop = loop_identity()

    def track_env(self, env_class: str, env_id: str | None = None) -> str:
        """Register a wrapper of ``env_class`` whose environments this tracker watches; return its id.

        Use the returned id as ``env_class`` in the batch. Wrapping works for any registered
        environment (sync or async), including one already wrapped by the chaos kit.
        """
        self._baseline_tasks()
        wrapped = register_wrapper_env(env_class, ledgers=[self.ledger], env_id=env_id, kind="tracked")
        self._env_ids.append(wrapped)
        return wrapped

    def track_engine(self, engine: InferenceClient) -> TrackedEngine:
        """Wrap ``engine`` so that its sessions are tracked; pass the result to the generator."""
        self._baseline_tasks()
        return TrackedEngine(engine, self)

    def close(self) -> None:
        """Unregister the wrapper ids made by :meth:`track_env`."""
        for env_id in self._env_ids:
            unregister_wrapper_env(env_id)
        self._env_ids.clear()

    def _session_event(self, session_id: Hashable, *, started: bool) -> None:
        with self._lock:
            counts = self._started if started else self._finished
            counts[session_id] = counts.get(session_id, 0) + 1
            if started:
                self._open_sessions[session_id] = None
            else:
                self._open_sessions.pop(session_id, None)

    # ------------------------------------------------------------------ what was seen

    @property
    def sessions_started(self) -> dict[Hashable, int]:
        """``generate`` requests seen per session id."""
        with self._lock:
            return dict(self._started)

    @property
    def sessions_finished(self) -> dict[Hashable, int]:
        """``finish_session`` calls seen per session id."""
        with self._lock:
            return dict(self._finished)

    def open_sessions(self) -> list[Hashable]:
        """Sessions whose last event was a ``generate`` request, not a ``finish_session``."""
        with self._lock:
            return list(self._open_sessions)

    # ------------------------------------------------------------------ checks

    def _static_leaks(self) -> list[str]:
        leaks = []
        ledger = self.ledger
        if ledger.never_closed():
            leaks.append(f"{len(ledger.never_closed())} of {ledger.opened} environments were never closed")
        if ledger.closed_more_than_once():
            counts = sorted(ledger.closes[e] for e in ledger.closed_more_than_once())
            leaks.append(f"{len(counts)} environments were closed more than once ({counts} times)")
        if ledger.overlaps:
            leaks.append(f"{len(ledger.overlaps)} environments were closed while one of their calls was running")
        sessions = sorted(self.open_sessions(), key=repr)
        if sessions:
            shown = ", ".join(repr(s) for s in sessions[:10]) + (", ..." if len(sessions) > 10 else "")
            leaks.append(f"{len(sessions)} inference sessions were never finished: {shown}")
        return leaks

    def task_leaks(self) -> list[str]:
        """Tasks started since the baseline and still unfinished (empty outside the baseline's loop)."""
        if self._tasks is None or self._loop is None or loop_identity() is not self._loop:
            return []
        now = live_tasks() or set()
        return [f"task left running: {describe_task(t)}" for t in now - self._tasks]

    def thread_leaks(self) -> list[str]:
        """Environment calls still in worker threads, busy pool workers and extra live threads."""
        leaks = []
        running = active_env_thread_calls() - self._env_calls
        if running > 0:
            leaks.append(f"{running} environment calls are still running in worker threads")
        for state in thread_states():
            if _is_tqdm_monitor(state.thread) or (
                self._ignore_thread is not None and self._ignore_thread(state.thread)
            ):
                continue
            if state.pool is not None:
                if state.busy and state.thread not in self._busy:
                    leaks.append(f"thread still busy: {state.describe()}")
            elif state.thread not in self._threads and state.thread.is_alive():
                leaks.append(f"thread left running: {state.describe()}")
        return leaks

    def process_leaks(self) -> list[str]:
        """Processes started since the baseline that still run (empty unless created with ``processes=True``)."""
        return [] if self._processes is None else self._processes.leftovers()

    def _running_leaks(self) -> list[str]:
        """What may still end on its own: threads and processes."""
        return self.thread_leaks() + self.process_leaks()

    def leaks(self, *, grace_s: float = 0.0) -> list[str]:
        """Everything leaked, one line each; thread and process checks are retried for ``grace_s`` seconds.

        Waiting blocks the calling thread; inside an event loop prefer :meth:`leaks_async`.
        """
        tasks = self.task_leaks()
        deadline = time.monotonic() + grace_s
        threads = self._running_leaks()
        while threads and time.monotonic() < deadline:
            time.sleep(0.01)
            threads = self._running_leaks()
        return self._static_leaks() + tasks + threads

    async def leaks_async(self, *, grace_s: float = 1.0) -> list[str]:
        """Like :meth:`leaks`, but waits for threads and processes without blocking the event loop."""
        tasks = self.task_leaks()
        threads = self._running_leaks()
        with anyio.move_on_after(grace_s):
            while threads:
                await anyio.sleep(0.01)
                threads = self._running_leaks()
        # The last look decides: one more could catch a worker in passing after an idle look.
        return self._static_leaks() + tasks + threads

    def _report(self, leaks: list[str]) -> None:
        self.checked = True
        if leaks:
            raise AssertionError("leaks found:\n  - " + "\n  - ".join(leaks))

    def assert_clean(self, *, grace_s: float = 1.0) -> None:
        """Raise AssertionError listing every leak (see :meth:`leaks`)."""
        self._report(self.leaks(grace_s=grace_s))

    async def assert_clean_async(self, *, grace_s: float = 1.0) -> None:
        """Raise AssertionError listing every leak (see :meth:`leaks_async`)."""
        self._report(await self.leaks_async(grace_s=grace_s))

    async def __aenter__(self) -> LeakTracker:
        self._baseline_tasks()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.assert_clean_async()
