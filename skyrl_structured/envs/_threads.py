"""Worker threads for blocking environment calls, with abandoned work kept inside the bound.

One :class:`EnvThreadPool` per generator runs ``skyrl_gym``'s synchronous ``init``/``step``/``close``
in at most ``max_env_workers`` daemon threads. The policy, the same on asyncio and trio:

- the bound counts live threads: a call abandoned by its rollout (cancelled, timed out) keeps its
  thread until it returns, so no more than ``max_env_workers`` env calls ever run at once;
- a call queued but not started when its rollout gives up is skipped, except a close: a close once
  submitted always runs, however late;
- threads are daemons, started on demand, so a call that never returns cannot keep the process
  from exiting.

Completions are handed back to the event loop without blocking the worker thread and coalesced:
finished calls queue their callbacks in the loop's ``LoopWaker`` (``_runtime/wakers.py``), and only the first of a burst
schedules a wake-up (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``), which then runs
every callback queued by then. A thousand closes finishing together cost the loop one wake-up, not
a thousand, and a worker never waits for a busy or already-closed loop.

Env code that calls back into the event loop from one of these threads (``anyio.from_thread.run`` or
``run_sync``) passes the loop's token: ``token=anyio.lowlevel.current_token()``, taken on the event
loop, e.g. in the env's ``__init__`` (``skyrl_gym.make`` runs there). These are not anyio's worker
threads, and the project claims them through no private anyio state (issue 21).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .._runtime.completion import Completion
from .._runtime.wakers import LoopWaker, current_waker

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PENDING, _RUNNING, _DONE, _SKIPPED = "pending", "running", "done", "skipped"

_running_lock = threading.Lock()
_running_changed = threading.Condition(_running_lock)
_running = 0


def active_env_thread_calls() -> int:
    """Environment calls still running in worker threads (abandoned ones included)."""
    return _running


def wait_env_thread_calls(timeout_s: float) -> bool:
    """Block until no environment call runs in a worker thread (abandoned ones included).

    Waits at most ``timeout_s`` seconds and says whether they had all returned. For a shutdown
    that should let abandoned closes finish, or a test: it blocks, so from async code run it in a
    thread (``await anyio.to_thread.run_sync(wait_env_thread_calls, 10)``).
    """
    with _running_changed:
        return _running_changed.wait_for(lambda: _running == 0, timeout_s)


def _count_running(delta: int) -> None:
    global _running
    with _running_changed:
        _running += delta
        if _running == 0:
            _running_changed.notify_all()


class EnvCall(Completion[T]):
    """One blocking call for a worker thread: pending, then running, then done (or skipped).

    Its outcome is a :class:`~skyrl_structured._runtime.completion.Completion`: settled in the
    worker thread, awaited on the event loop.
    """

    __slots__ = ("_args", "_fn", "_state", "_then", "skippable")

    def __init__(
        self, fn: Callable[..., T], *args: Any, skippable: bool = True, waker: LoopWaker | None = None
    ) -> None:
        # The loop's waker; a caller that already has it (from an earlier call) skips the lookup.
        super().__init__(waker if waker is not None else current_waker())
        self._fn = fn
        self._args = args
        #: False for a close: once submitted it always runs.
        self.skippable = skippable
        self._state = _PENDING
        self._then: EnvCall[Any] | None = None

    @property
    def waker(self) -> LoopWaker:
        """The event loop this call reports back to (pass it to the next call of the same task)."""
        assert self._waker is not None
        return self._waker

    def skip(self) -> bool:
        """Make a call that has not started never start; False if it started (or cannot be skipped)."""
        with self._lock:
            if self._state != _PENDING or not self.skippable:
                return False
            self._state = _SKIPPED
            callbacks = self._finish(None, None)
        self._notify(callbacks)
        return True

    def then(self, follower: EnvCall[Any], pool: EnvThreadPool) -> None:
        """Run ``follower`` in this call's thread right after it returns (at once if it already has)."""
        with self._lock:
            if self._state in (_PENDING, _RUNNING):
                self._then = follower
                return
        pool.submit(follower)

    def run(self, *, counted: bool = False) -> None:
        """In a worker thread: run the call (unless skipped), then whatever was chained after it.

        A chained follower takes over this call's place in :func:`active_env_thread_calls`
        (``counted``), so the count never reads zero between a stuck step and its close.
        """
        with self._lock:
            if self._state != _PENDING:
                if counted:
                    _count_running(-1)
                return
            self._state = _RUNNING
        if not counted:
            _count_running(1)
        value: T | None = None
        error: BaseException | None = None
        try:
            value = self._fn(*self._args)
        except BaseException as exc:
            error = exc
        finally:
            follower = self._report(value, error)
        if follower is not None:
            follower.run(counted=True)

    def _report(self, value: T | None, error: BaseException | None) -> EnvCall[Any] | None:
        """Settle the call and hand its outcome to the loop; returns the follower to run next.

        A method of its own so that a thread inside it is seen handing off, not running env code
        (``skyrl_structured.testing``'s thread census tells the two apart by the innermost frame).
        """
        with self._lock:
            self._state = _DONE
            callbacks = self._finish(value, error)
            follower, self._then = self._then, None
        if follower is None:
            _count_running(-1)
        self._notify(callbacks)
        return follower


class EnvThreadPool:
    """At most ``max_workers`` daemon threads, started on demand, that exit after ``idle_s`` idle.

    Wake-ups are chained rather than one per call: a call queued while no thread is on its way
    wakes (or starts) one thread; a thread that takes a call and finds more queued wakes the next.
    A burst of a thousand cheap calls (the closes after a cancellation) so wakes a handful of threads
    instead of making a thousand threads fight for the GIL, while blocking calls still fan out to
    every allowed thread within a few thread switches.
    """

    def __init__(self, max_workers: int, *, idle_s: float = 10.0, name: str = "skyrl-structured-env") -> None:
        if max_workers < 1:
            raise ValueError(f"an env thread pool needs at least one worker, got {max_workers}")
        self.max_workers = max_workers
        self._idle_s = idle_s
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[EnvCall[Any]] = collections.deque()
        self._threads = 0
        self._sleeping = 0  # threads waiting for work
        self._waking = 0  # threads notified or started that have not yet looked at the queue
        self._started = 0

    @property
    def threads(self) -> int:
        """Worker threads alive now (busy, abandoned or idle)."""
        return self._threads

    def submit(self, call: EnvCall[Any]) -> None:
        """Queue ``call``; wake or start a thread for it unless one is already on its way."""
        with self._cond:
            self._queue.append(call)
            if self._waking:
                return
            start = self._wake_one()
        if start:
            self._start()

    def _wake_one(self) -> bool:
        """Under the lock: notify a sleeping thread, or say that a new one is to start (False: at the bound)."""
        if self._sleeping > self._waking:
            self._waking += 1
            self._cond.notify()
            return False
        if self._threads < self.max_workers:
            self._threads += 1
            self._waking += 1
            self._started += 1
            return True
        return False

    def _arrived(self) -> None:
        """Under the lock: a thread that was started or woke up (notified or not) is here.

        Never below zero: a thread that woke on its own timeout may take another's count, which only
        makes the next call wake one thread more, never leaves a queued call with no thread coming.
        """
        if self._waking > 0:
            self._waking -= 1

    def _start(self) -> None:
        threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()

    def _work(self) -> None:
        cond, work = self._cond, self._queue
        cond.acquire()
        try:
            self._arrived()  # started: was on its way, now here
            while True:
                while not work:
                    self._sleeping += 1
                    try:
                        notified = cond.wait(self._idle_s)
                    finally:
                        self._sleeping -= 1
                    self._arrived()
                    if not notified and not work:
                        self._threads -= 1
                        return
                call = work.popleft()
                start = bool(work) and not self._waking and self._wake_one()
                cond.release()
                try:
                    if start:
                        self._start()
                    call.run()
                except BaseException:  # pragma: no cover - run() keeps every error; never lose the thread count
                    logger.exception("an environment call escaped its worker")
                finally:
                    cond.acquire()
        finally:
            cond.release()
