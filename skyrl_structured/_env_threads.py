"""Worker threads for blocking environment calls, with abandoned work kept inside the bound.

One :class:`EnvThreadPool` per generator runs ``skyrl_gym``'s synchronous ``init``/``step``/``close``
in at most ``max_env_workers`` daemon threads. The policy, the same on asyncio and trio:

- the bound counts live threads: a call abandoned by its rollout (cancelled, timed out) keeps its
  thread until it returns, so no more than ``max_env_workers`` env calls ever run at once;
- a call queued but not started when its rollout gives up is skipped, except a close: a close once
  submitted always runs, however late;
- threads are daemons, so a call that never returns cannot keep the process from exiting.

Completion is handed back to the event loop without blocking the worker thread (the loop's own
thread-safe callback), so a worker never waits for a busy or already-closed loop.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Something that runs a callback in the event loop's thread soon; safe to call from any thread.
Scheduler = Callable[[Callable[[], None]], object]

_claim_worker_thread: Callable[[Any, object], AbstractContextManager[Any]] | None
try:  # lets env code call anyio.from_thread.* from our threads, as from anyio's own workers
    from anyio._core._eventloop import claim_worker_thread as _claim_worker_thread
except ImportError:  # pragma: no cover - a future anyio without it: from_thread then needs a token
    _claim_worker_thread = None

_PENDING, _RUNNING, _DONE, _SKIPPED = "pending", "running", "done", "skipped"

_running_lock = threading.Lock()
_running = 0


def active_env_thread_calls() -> int:
    """Environment calls still running in worker threads (abandoned ones included)."""
    return _running


def _count_running(delta: int) -> None:
    global _running
    with _running_lock:
        _running += delta


def loop_scheduler() -> Scheduler:
    """The current event loop's thread-safe ``call soon`` (asyncio's loop or trio's token)."""
    native: Any = anyio.lowlevel.current_token().native_token
    schedule: Scheduler = getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon
    return schedule


class EnvCall(Generic[T]):
    """One blocking call for a worker thread: pending, then running, then done (or skipped)."""

    __slots__ = ("_args", "_callbacks", "_error", "_fn", "_lock", "_state", "_then", "_token", "_value", "skippable")

    def __init__(self, fn: Callable[..., T], *args: Any, skippable: bool = True) -> None:
        self._fn = fn
        self._args = args
        #: False for a close: once submitted it always runs.
        self.skippable = skippable
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[tuple[Scheduler, Callable[[], None]]] = []
        self._then: EnvCall[Any] | None = None
        self._token = anyio.lowlevel.current_token()

    @property
    def done(self) -> bool:
        """True once the call returned or raised, or was skipped before it started."""
        return self._state in (_DONE, _SKIPPED)

    @property
    def running(self) -> bool:
        return self._state == _RUNNING

    def skip(self) -> bool:
        """Make a call that has not started never start; False if it started (or cannot be skipped)."""
        with self._lock:
            if self._state != _PENDING or not self.skippable:
                return False
            self._state = _SKIPPED
            callbacks, self._callbacks = self._callbacks, []
        self._notify(callbacks)
        return True

    def then(self, follower: EnvCall[Any], pool: EnvThreadPool) -> None:
        """Run ``follower`` in this call's thread right after it returns (at once if it already has)."""
        with self._lock:
            if self._state in (_PENDING, _RUNNING):
                self._then = follower
                return
        pool.submit(follower)

    def add_done_callback(self, schedule: Scheduler, callback: Callable[[], None]) -> bool:
        """Have ``schedule`` run ``callback`` once the call is done; False (and nothing kept) if it already is."""
        with self._lock:
            if self._state in (_DONE, _SKIPPED):
                return False
            self._callbacks.append((schedule, callback))
            return True

    async def wait(self) -> None:
        """Wait until the call is done. Cancellation leaves the call alone: the caller decides."""
        event = anyio.Event()
        if self.add_done_callback(loop_scheduler(), event.set):
            await event.wait()

    def result(self) -> T:
        """The call's return value, or its exception raised again."""
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def run(self) -> None:
        """In a worker thread: run the call (unless skipped), then whatever was chained after it."""
        with self._lock:
            if self._state != _PENDING:
                return
            self._state = _RUNNING
        _count_running(1)
        try:
            claim: AbstractContextManager[Any] = nullcontext()
            if _claim_worker_thread is not None:
                claim = _claim_worker_thread(self._token.backend_class, self._token.native_token)
            with claim:
                self._value = self._fn(*self._args)
        except BaseException as exc:
            self._error = exc
        finally:
            _count_running(-1)
            with self._lock:
                self._state = _DONE
                callbacks, self._callbacks = self._callbacks, []
                follower, self._then = self._then, None
            self._notify(callbacks)
        if follower is not None:
            follower.run()

    @staticmethod
    def _notify(callbacks: list[tuple[Scheduler, Callable[[], None]]]) -> None:
        for schedule, callback in callbacks:
            # The loop may be gone (its generate() returned long ago): nobody is waiting then.
            with suppress(Exception):
                schedule(callback)


class EnvThreadPool:
    """At most ``max_workers`` daemon threads, started on demand, that exit after ``idle_s`` idle."""

    def __init__(self, max_workers: int, *, idle_s: float = 10.0, name: str = "skyrl-structured-env") -> None:
        if max_workers < 1:
            raise ValueError(f"an env thread pool needs at least one worker, got {max_workers}")
        self.max_workers = max_workers
        self._idle_s = idle_s
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[EnvCall[Any]] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._started = 0

    @property
    def threads(self) -> int:
        """Worker threads alive now (busy, abandoned or idle)."""
        return self._threads

    def submit(self, call: EnvCall[Any]) -> None:
        """Queue ``call``; a new thread starts only if no idle one can take it and the bound allows."""
        with self._cond:
            self._queue.append(call)
            if self._idle >= len(self._queue):
                self._cond.notify()
            elif self._threads < self.max_workers:
                self._threads += 1
                self._idle += 1
                self._started += 1
                thread = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
                thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if not self._cond.wait(self._idle_s) and not self._queue:
                        self._threads -= 1
                        self._idle -= 1
                        return
                call = self._queue.popleft()
                self._idle -= 1
            try:
                call.run()
            except BaseException:  # pragma: no cover - run() keeps every error; never lose the thread count
                logger.exception("an environment call escaped its worker")
            finally:
                with self._cond:
                    self._idle += 1
