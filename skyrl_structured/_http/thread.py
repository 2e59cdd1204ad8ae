"""The same server core in a daemon thread of its own, on its own (asyncio) event loop.

For a server that must outlive the event loop that opened its port: the agents' tombstone keeps a
closed capture endpoint's port answering while agent threads abandoned on it still run
(:mod:`skyrl_structured.agents._tombstone`). :class:`ServerThread` serves duplicates of existing
listening sockets, so the port never refuses a connection and the kernel's backlog is kept; it
never blocks the thread that starts or stops it, and :meth:`ServerThread.stop` closes the port
soon, from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Sequence

import anyio
import anyio.abc

from .connection import ErrorAnswer
from .messages import Request, Response
from .server import serve

__all__ = ["ServerThread"]

logger = logging.getLogger(__name__)

#: How long a stopping thread waits for the answers being sent (they are made at once: a slow reader's bound).
_STOP_S = 1.0


class ServerThread:
    """One daemon thread serving duplicates of ``sockets`` with a synchronous ``respond(request)``.

    Every request gets ``respond``'s answer with ``Connection: close`` (a malformed one, or one over
    ``max_body``, gets ``error``'s), once it has been read to its end, so the connection closes
    without resetting an answer the client has not read. ``answered`` counts the answers made.

    Raises:
        OSError: the sockets could not be duplicated (nothing is left open).
    """

    def __init__(
        self,
        sockets: Sequence[socket.socket],
        respond: Callable[[Request], Response],
        error: ErrorAnswer,
        *,
        what: str,
        name: str,
        max_body: int,
    ) -> None:
        self._respond = respond
        self._error = error
        self._what = what
        self._max_body = max_body
        self._sockets: list[socket.socket] = []
        try:
            for one in sockets:
                self._sockets.append(one.dup())
            self._wake, self._waker = socket.socketpair()
        except OSError:
            for one in self._sockets:
                one.close()
            raise
        self._wake.setblocking(False)
        self._waker.setblocking(False)
        self.port = int(self._sockets[0].getsockname()[1]) if self._sockets else 0
        #: Requests answered so far.
        self.answered = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Close the port soon (the thread closes it and exits); from any thread, idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            with contextlib.suppress(OSError):  # a full buffer: a byte is already waiting
                self._waker.send(b"\0")

    def join(self, timeout_s: float) -> bool:
        """Wait (blocking) until the thread has closed the port; whether it has."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _run(self) -> None:
        try:
            anyio.run(self._main, backend="asyncio")
        except Exception:  # never expected: the port then closes, as without this thread
            logger.exception("%s: the server thread failed", self._what)
        finally:
            for one in self._sockets:
                one.close()
            with self._lock:
                self._stopping = True
                self._wake.close()
                self._waker.close()

    async def _main(self) -> None:
        listeners = [await anyio.abc.SocketListener.from_socket(one) for one in self._sockets]
        async with serve(
            self._answer,
            self._error,
            what=self._what,
            max_body=self._max_body,
            listeners=listeners,
            close_timeout_s=_STOP_S,
            close_each=True,
        ):
            await anyio.wait_readable(self._wake)

    async def _answer(self, request: Request) -> Response:
        response = self._respond(request)
        self.answered += 1
        return response
