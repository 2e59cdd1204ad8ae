"""The loop's coalesced wake-up on its own: ``LoopWaker``, ``current_waker``, ``loop_scheduler``, ``loop_waiter``.

Worker threads (env calls, remote env replies) hand their completions to the event loop through
it. What the env layer relies on: a completion queued from any thread runs in the loop's thread;
a burst costs the loop one wake-up, not one per callback; a worker never waits for a busy loop
and never fails on a closed one; one callback that raises does not lose the others.

To make a burst deterministic the loop's own thread is held (a blocking ``join`` on it) while
the threads queue: nothing can be drained until it lets go.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio

from skyrl_structured._runtime.native import loop_waiter
from skyrl_structured._runtime.wakers import LoopWaker, current_waker, loop_scheduler

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches.
GENEROUS_S = 60.0


class CountingToken:
    """The running loop's token with its thread-safe call-soon counted: how many wake-ups a waker asked for."""

    def __init__(self, native: Any) -> None:
        self.native_token = self
        self._schedule: Callable[[Callable[[], None]], object] = (
            getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon
        )
        self._lock = threading.Lock()
        self.wakeups = 0

    def run_sync_soon(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self.wakeups += 1
        self._schedule(callback)


def counted_waker() -> tuple[LoopWaker, CountingToken]:
    token = CountingToken(anyio.lowlevel.current_token().native_token)
    return LoopWaker(token), token


def while_the_loop_is_held(*bursts: Callable[[], None]) -> None:
    """Run each burst in its own thread and wait for all of them here, in the loop's thread: the loop drains nothing."""
    threads = [threading.Thread(target=burst, daemon=True) for burst in bursts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GENEROUS_S)
    # A waker that waited for the (held) loop would still be blocked here.
    assert not any(thread.is_alive() for thread in threads)


async def test_one_waker_per_loop_holding_the_loops_cheapest_way_to_wait(anyio_backend):
    waker = current_waker()
    assert current_waker() is waker
    assert loop_scheduler() is waker
    assert waker.token.native_token is anyio.lowlevel.current_token().native_token
    if sniffio.current_async_library() == "asyncio":
        assert waker.loop is asyncio.get_running_loop()  # waits on a bare future
    else:
        import trio

        assert waker.loop is None
        assert waker.event_class is trio.Event  # trio's own event, not anyio's wrapper
    backend = sniffio.current_async_library()

    def in_another_loop() -> int:
        async def there() -> int:
            return id(current_waker())

        return anyio.run(there, backend=backend)

    assert await anyio.to_thread.run_sync(in_another_loop) != id(waker)


async def test_a_completion_from_another_thread_is_delivered_in_the_loops_thread(anyio_backend):
    waker = current_waker()
    loop_thread = threading.get_ident()
    ran_in: list[int] = []

    def completed() -> None:
        ran_in.append(threading.get_ident())

    # The two ways an env call's waiter waits (EnvCall.wait): a bare asyncio future, else an event.
    if waker.loop is not None:
        wake, woken = loop_waiter(waker.loop)

        def deliver() -> None:
            completed()
            wake()

        threading.Thread(target=waker, args=(deliver,), daemon=True).start()
        with anyio.fail_after(GENEROUS_S):
            await woken
    else:
        event = waker.event_class()

        def deliver() -> None:
            completed()
            event.set()

        threading.Thread(target=waker, args=(deliver,), daemon=True).start()
        with anyio.fail_after(GENEROUS_S):
            await event.wait()
    assert ran_in == [loop_thread]


async def test_a_burst_from_other_threads_costs_the_loop_one_wake_up(anyio_backend):
    waker, token = counted_waker()
    ran: list[tuple[str, int]] = []
    drained = anyio.Event()

    def burst(name: str, size: int) -> Callable[[], None]:
        def queue() -> None:
            for i in range(size):
                waker(partial(ran.append, (name, i)))

        return queue

    while_the_loop_is_held(burst("a", 50), burst("b", 50), burst("c", 50))
    waker(drained.set)  # queued last, from the loop's own thread: runs once the rest have
    with anyio.fail_after(GENEROUS_S):
        await drained.wait()
    assert token.wakeups == 1
    assert len(ran) == 150
    for name in "abc":  # each thread's callbacks run in the order it queued them
        assert [i for n, i in ran if n == name] == list(range(50))

    # The drain disarmed the waker: the next burst asks for a wake-up of its own.
    again = anyio.Event()
    while_the_loop_is_held(burst("d", 10))
    waker(again.set)
    with anyio.fail_after(GENEROUS_S):
        await again.wait()
    assert token.wakeups == 2
    assert [i for n, i in ran if n == "d"] == list(range(10))


async def test_a_callback_that_raises_is_logged_and_the_rest_of_its_burst_still_runs(anyio_backend, caplog):
    waker, _ = counted_waker()
    ran: list[str] = []
    drained = anyio.Event()

    def broken() -> None:
        raise ValueError("a broken completion callback")

    def queue() -> None:
        waker(partial(ran.append, "before"))
        waker(broken)
        waker(partial(ran.append, "after"))

    while_the_loop_is_held(queue)
    waker(drained.set)
    with anyio.fail_after(GENEROUS_S):
        await drained.wait()
    assert ran == ["before", "after"]
    failed = [r for r in caplog.records if r.name == "skyrl_structured._runtime.wakers" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failed] == ["an environment call's completion callback failed"]
    assert failed[0].exc_info is not None
    assert isinstance(failed[0].exc_info[1], ValueError)


async def test_after_its_loop_is_gone_a_waker_drops_callbacks_without_raising(anyio_backend):
    backend = sniffio.current_async_library()

    def wakers_of_a_finished_loop() -> tuple[LoopWaker, LoopWaker, CountingToken]:
        async def there() -> tuple[LoopWaker, LoopWaker, CountingToken]:
            counted, token = counted_waker()
            return current_waker(), counted, token

        return anyio.run(there, backend=backend)

    waker, counted, token = await anyio.to_thread.run_sync(wakers_of_a_finished_loop)
    ran: list[str] = []
    for _ in range(2):
        waker(partial(ran.append, "late"))  # a close that returned after generate() did: nobody waits
        counted(partial(ran.append, "late"))
    assert ran == []
    # Each late callback tried to wake the loop again: a failed wake-up does not leave the waker armed.
    assert token.wakeups == 2


def test_a_loop_waiter_wakes_once_and_leaves_a_cancelled_wait_alone():
    loop = asyncio.new_event_loop()
    try:
        wake, woken = loop_waiter(loop)
        assert isinstance(woken, asyncio.Future)
        wake()
        assert woken.done()
        assert woken.result() is None
        wake()  # a second completion is harmless
        wake, cancelled = loop_waiter(loop)
        assert isinstance(cancelled, asyncio.Future)
        cancelled.cancel()  # its waiter was cancelled
        wake()
        assert cancelled.cancelled()
    finally:
        loop.close()
