"""The runtime's bridge to the event loops' own primitives: the one runtime module that imports asyncio or trio.

Everything else goes through anyio. Two things need the backend itself (docs/architecture.md, "Backends"):

- the wake-up of an env call's completion, on the path of every env call: a bare asyncio future, or
  trio's own ``Event``, is the cheapest wait each loop has (an ``anyio.Event`` adds a layer to both);
- an async environment inside a worker process, which has no event loop of its own: it runs on an
  asyncio loop kept for its whole life (:func:`new_env_runner`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

#: An asyncio event loop (what :func:`asyncio_loop` finds behind anyio's token).
AsyncioLoop = asyncio.AbstractEventLoop
#: What keeps one asyncio loop open across blocking calls (``run`` each awaitable on it, then ``close``).
EnvRunner = asyncio.Runner


def asyncio_loop(native_token: Any) -> AsyncioLoop | None:
    """The asyncio loop behind anyio's ``current_token().native_token``, or None on another backend."""
    return native_token if isinstance(native_token, asyncio.AbstractEventLoop) else None


def native_event_class(native_token: Any) -> Callable[[], Any]:
    """The cheapest event (``set()`` and ``await wait()``) of the loop behind ``native_token``.

    trio's own ``Event`` under trio; anyio's elsewhere (on asyncio, :func:`loop_waiter` is cheaper still).
    """
    if type(native_token).__module__.startswith("trio"):
        import trio

        event_class: Callable[[], Any] = trio.Event
        return event_class
    return anyio.Event


def loop_waiter(loop: AsyncioLoop) -> tuple[Callable[[], None], Awaitable[None]]:
    """A one-shot wait on ``loop``: ``(wake, woken)``; call ``wake()`` in the loop's thread, ``await woken``.

    ``wake`` does nothing once the waiter was cancelled (a cancelled wait cancels its future).
    """
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    return wake, future


def new_env_runner() -> EnvRunner:
    """A fresh asyncio loop, kept open across calls, for one async environment in a worker process."""
    return asyncio.Runner()
