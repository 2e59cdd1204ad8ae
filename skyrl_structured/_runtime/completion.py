"""One-shot completion: a value or an error set once from any thread, awaited on the event loop.

A blocking env call in a worker thread (:class:`~skyrl_structured.envs._threads.EnvCall`) and a
request to an env worker process or actor (:class:`~skyrl_structured.envs._pool.Reply`) both end
this way: some thread settles the outcome, every waiter on the event loop (asyncio or trio) wakes
through the loop's coalescing :class:`~skyrl_structured._runtime.wakers.LoopWaker`, and done-callbacks
run there. The first outcome wins; later ones are ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .native import loop_waiter
from .wakers import LoopWaker, Scheduler, current_waker

logger = logging.getLogger(__name__)

T = TypeVar("T")

_Callbacks = list[tuple[Scheduler, Callable[[], None]]]


class Completion(Generic[T]):
    """An outcome settled once (:meth:`settle`), from any thread; waited for on the event loop.

    Subclasses that keep state of their own next to the outcome (a thread call's running/skipped
    state) change it under :attr:`_lock` together with :meth:`_finish`, then call :meth:`_notify`
    outside the lock.
    """

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_value", "_waker")

    def __init__(self, waker: LoopWaker | None = None) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: _Callbacks = []
        #: The loop waiters wake on; looked up at the first :meth:`wait` when not given.
        self._waker = waker

    @property
    def done(self) -> bool:
        """True once the outcome is set."""
        return self._done

    def settle(self, value: T | None, error: BaseException | None = None) -> bool:
        """Set the outcome (``error``, else ``value``) unless it is set already; wake the waiters.

        Returns whether this call set it. Safe from any thread.
        """
        with self._lock:
            if self._done:
                return False
            callbacks = self._finish(value, error)
        self._notify(callbacks)
        return True

    def _finish(self, value: T | None, error: BaseException | None) -> _Callbacks:
        """Under :attr:`_lock`: record the outcome and take the callbacks to notify."""
        self._value, self._error, self._done = value, error, True
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    @staticmethod
    def _notify(callbacks: _Callbacks) -> None:
        for schedule, callback in callbacks:
            # The loop may be gone (its generate() returned long ago): nobody is waiting then.
            try:
                schedule(callback)
            except Exception:
                logger.debug("a completion arrived after its event loop closed", exc_info=True)

    def add_done_callback(self, schedule: Scheduler, callback: Callable[[], None]) -> bool:
        """Have ``schedule`` run ``callback`` once done; False (and nothing kept) if it already is."""
        with self._lock:
            if self._done:
                return False
            self._callbacks.append((schedule, callback))
            return True

    async def wait(self) -> None:
        """Wait until the outcome is set. Cancellation leaves the work alone: the caller decides."""
        waker = self._waker
        if waker is None:
            waker = self._waker = current_waker()
        if waker.loop is not None:
            wake, woken = loop_waiter(waker.loop)
            if self.add_done_callback(waker, wake):
                await woken
            return
        event = waker.event_class()
        if self.add_done_callback(waker, event.set):
            await event.wait()

    def result(self) -> T:
        """The value, or the error raised again."""
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
