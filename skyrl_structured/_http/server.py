"""The HTTP server of this package: listen, accept with backoff, serve each connection, close gracefully.

One entry point, :func:`serve`, used by the agents' capture endpoint, the test kit's vLLM server
and (in a thread of its own, :mod:`.thread`) the closed endpoint's tombstone. It runs in the
caller's event loop, asyncio or trio. What it guarantees:

- a failing ``accept`` never ends it: out of file descriptors (``EMFILE``) or memory, the
  connection waits in the kernel's backlog while accepting backs off (:func:`accept_forever`);
- closing it answers what it is answering: each connection runs shielded from the server's own
  cancellation, idle ones close at once and busy ones once answered, waiting at most
  ``close_timeout_s`` (:class:`Connections`);
- an exception of the ``async with`` block is re-raised as itself, not in an exception group.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from .connection import ErrorAnswer, Handler, plain_error, serve_connection

__all__ = ["Connections", "Server", "accept_forever", "serve"]

logger = logging.getLogger(__name__)

#: The first pause after a failed ``accept``, doubled per failure up to the last: the process is out of
#: file descriptors (or memory) and a connection closing elsewhere frees one.
_ACCEPT_BACKOFF_S = (0.01, 1.0)
#: Errors of ``accept`` that say the process or the system is out of a resource, not that the listener broke.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(eq=False)
class _Connection:
    scope: anyio.CancelScope
    #: Between the head of a request and the last byte of its answer.
    busy: bool = False


@dataclass(eq=False)
class Connections:
    """The open connections of one server, so that closing it answers what it is answering.

    Each connection runs shielded from the server's own cancellation: when the server's scope is
    cancelled (a caller cancelled ``generate()``), a request in flight still gets the answer its
    handler gives (the capture endpoint's 499 when its session closes), then its connection closes.
    :meth:`close` closes idle connections at once and waits, at most ``limit_s``, for the busy ones.
    """

    handler: Handler
    error: ErrorAnswer
    max_body: int
    #: The server's name in log lines.
    what: str
    close_each: bool = False
    _open: set[_Connection] = field(default_factory=set)
    _closing: bool = False
    _quiet: anyio.Event | None = None

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        """Serve one connection until either side closes it (or :meth:`close` does); never raises."""
        connection = _Connection(anyio.CancelScope(shield=True))
        if self._closing:
            connection.scope.cancel()
        self._open.add(connection)
        try:
            with connection.scope:
                await serve_connection(
                    stream,
                    self.handler,
                    self.error,
                    max_body=self.max_body,
                    what=self.what,
                    state=partial(self._mark, connection),
                    close_each=self.close_each,
                )
        finally:
            self._open.discard(connection)
            self._settle()

    def _mark(self, connection: _Connection, busy: bool) -> None:
        connection.busy = busy
        if not busy and self._closing:
            connection.scope.cancel()

    def _settle(self) -> None:
        if self._quiet is not None and not any(c.busy for c in self._open):
            self._quiet.set()

    async def close(self, limit_s: float) -> None:
        """Close every connection: idle ones now, busy ones once answered (shielded, at most ``limit_s``)."""
        self._closing = True
        for connection in list(self._open):
            if not connection.busy:
                connection.scope.cancel()
        if any(c.busy for c in self._open):
            self._quiet = anyio.Event()
            with anyio.move_on_after(limit_s, shield=True) as bound:
                await self._quiet.wait()
            if bound.cancelled_caught and limit_s > 0:
                logger.warning(
                    "%s: %d request(s) still unanswered %g s after the server began closing; their connections "
                    "are closed",
                    self.what,
                    sum(c.busy for c in self._open),
                    limit_s,
                )
        for connection in list(self._open):
            connection.scope.cancel()


async def accept_forever(
    listener: anyio.abc.SocketListener,
    handle: Callable[[anyio.abc.SocketStream], Coroutine[Any, Any, None]],
    group: anyio.abc.TaskGroup,
    *,
    what: str,
) -> None:
    """Accept connections until cancelled, each served by ``handle`` in ``group``.

    A failing ``accept`` never ends the server: out of file descriptors (``EMFILE``, ``ENFILE``) or
    memory, the connection waits in the kernel's backlog while this loop backs off (10 ms doubling
    to 1 s) and retries; the first failure of a run of them is logged as a warning, the recovery as
    info. A closed listener ends the loop.
    """
    failures = 0
    pause = _ACCEPT_BACKOFF_S[0]
    while True:
        try:
            stream = await listener.accept()
        except anyio.ClosedResourceError:
            return
        except (OSError, anyio.BrokenResourceError) as exc:
            cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc
            code = getattr(cause, "errno", None)
            if failures == 0:
                hint = " (raise the file limit: ulimit -n)" if code in (errno.EMFILE, errno.ENFILE) else ""
                level = logging.WARNING if code in _RESOURCE_ERRNOS else logging.ERROR
                logger.log(level, "%s: accepting a connection failed: %r%s; retrying with backoff", what, cause, hint)
            failures += 1
            await anyio.sleep(pause)
            pause = min(pause * 2, _ACCEPT_BACKOFF_S[1])
            continue
        if failures:
            logger.info("%s: accepting connections again after %d failed attempt(s)", what, failures)
            failures, pause = 0, _ACCEPT_BACKOFF_S[0]
        group.start_soon(handle, stream)


@dataclass(eq=False)
class Server:
    """A running :func:`serve`: where it listens."""

    listeners: Sequence[anyio.abc.SocketListener]
    #: The port of the first listener (all of them, for a host name that resolves to several addresses).
    port: int

    @property
    def sockets(self) -> list[socket.socket]:
        """The listening sockets themselves (to duplicate: the tombstone keeps a closed server's port)."""
        return [one.extra(SocketAttribute.raw_socket) for one in self.listeners]


@asynccontextmanager
async def serve(
    handler: Handler,
    error: ErrorAnswer = plain_error,
    *,
    what: str,
    max_body: int,
    host: str = "127.0.0.1",
    port: int = 0,
    listeners: Sequence[anyio.abc.SocketListener] | None = None,
    close_timeout_s: float = 0.0,
    close_each: bool = False,
) -> AsyncIterator[Server]:
    """Serve ``handler`` until the block exits, on ``host``:``port`` (port 0: a free one) or on ``listeners``.

    ``handler(request)`` answers each :class:`~.messages.Request` with a :class:`~.messages.Response`
    (None: close the connection unanswered); ``error(status, message)`` is the server's own answer
    in its API's shape (400, 413, 500). ``what`` names the server in log lines; ``max_body`` bounds a
    request body. On exit, however the block ends, the listeners close first, then idle connections,
    and busy ones once answered (at most ``close_timeout_s``; 0: at once). ``close_each`` answers every
    request with ``Connection: close``. Listeners passed in are owned: they are closed on exit.

    Raises:
        OSError: the address cannot be bound.
    """
    if listeners is None:
        multi = await anyio.create_tcp_listener(local_host=host, local_port=port)
        listeners = [one for one in multi.listeners if isinstance(one, anyio.abc.SocketListener)]
    server = Server(listeners, int(listeners[0].extra(SocketAttribute.local_port)) if listeners else 0)
    connections = Connections(handler, error, max_body, what, close_each)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            for one in listeners:
                group.start_soon(partial(accept_forever, one, connections.handle, group, what=what))
            try:
                yield server
            except Exception as exc:  # re-raised below as itself, not wrapped in the task group's ExceptionGroup
                failure = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await _close_all(listeners)
                    await connections.close(close_timeout_s)
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        with anyio.CancelScope(shield=True):
            await _close_all(listeners)


async def _close_all(listeners: Sequence[anyio.abc.SocketListener]) -> None:
    for one in listeners:
        await one.aclose()
