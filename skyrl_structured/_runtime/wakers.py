"""The event loop's coalesced wake-up from other threads.

Worker threads (env calls, remote env replies) hand completions back to the event loop through
one :class:`LoopWaker` per loop: the first callback of a burst schedules one wake-up (asyncio's
``call_soon_threadsafe``, trio's ``run_sync_soon``), later ones join its queue, and a worker never
waits for a busy or already-closed loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from .native import AsyncioLoop, asyncio_loop, native_event_class

logger = logging.getLogger(__name__)

#: Something that runs a callback in the event loop's thread soon; safe to call from any thread.
Scheduler = Callable[[Callable[[], None]], object]


class LoopWaker:
    """One event loop's coalesced wake-up: callbacks queued from any thread, run by one drain.

    The first callback queued while no drain is pending schedules one with the loop's thread-safe
    call-soon; later ones only join the queue. The drain takes everything queued so far and runs it
    in the loop's thread. If the loop is gone, the callbacks are dropped: nobody waits on them.
    It also keeps what every call needs from its loop, looked up once per run: the anyio token
    and the cheapest native way to wait.
    """

    __slots__ = ("_armed", "_lock", "_pending", "_schedule", "event_class", "loop", "token")

    def __init__(self, token: Any) -> None:
        native: Any = token.native_token
        self.token = token
        self._schedule: Scheduler = getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._armed = False
        #: The asyncio loop (waits on a bare future), or None.
        self.loop: AsyncioLoop | None = asyncio_loop(native)
        #: Otherwise an event class with ``set()`` and ``await wait()``: trio's own, or anyio's.
        self.event_class: Callable[[], Any] = native_event_class(native)

    def __call__(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(callback)
            if self._armed:
                return
            self._armed = True
        try:
            self._schedule(self._drain)
        except Exception:  # the loop is closed (asyncio) or its run finished (trio)
            with self._lock:
                self._pending.clear()
                self._armed = False

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._armed = False
        for callback in batch:
            try:
                callback()
            except Exception:  # pragma: no cover - our callbacks set events; never crash trio's run
                logger.exception("an environment call's completion callback failed")


_wakers: anyio.lowlevel.RunVar[LoopWaker] = anyio.lowlevel.RunVar("skyrl_structured_env_waker")


def current_waker() -> LoopWaker:
    try:
        return _wakers.get()
    except LookupError:
        waker = LoopWaker(anyio.lowlevel.current_token())
        _wakers.set(waker)
        return waker


def loop_scheduler() -> Scheduler:
    """The current event loop's coalescing thread-safe ``call soon`` (one wake-up per burst)."""
    return current_waker()
