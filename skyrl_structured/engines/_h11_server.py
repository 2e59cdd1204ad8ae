"""The HTTP/1.1 plumbing of the servers this package runs on anyio and h11, in the caller's event loop.

Two servers use it: the agents' capture endpoint (:mod:`skyrl_structured.agents`) and the test kit's
vLLM-compatible server (:mod:`skyrl_structured.testing.vllm_server`). Each gives
:func:`serve_connection` a ``respond(request, body)`` coroutine; this module reads the requests of
one keep-alive connection, answers them in turn, and cancels the ``respond`` in progress when the
client goes away (as vLLM aborts a generation whose client disconnected).

What a maintained server would otherwise do, done here: every request gets an answer (a malformed one
400, a body over the limit 413, a ``respond`` that raised 500, in the server's error shape),
``Expect: 100-continue`` is answered ``100 Continue``, a failing ``accept`` (out of file descriptors)
is logged once and retried after a backoff (:func:`accept_forever`), and :class:`Connections` closes
gracefully: a request being answered when the server closes is answered first.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.abc

__all__ = ["Answer", "Connections", "accept_forever", "serve_connection"]

logger = logging.getLogger(__name__)

_CHUNK = 65536
#: The first pause after a failed ``accept``, doubled per failure up to the last: the process is out of
#: file descriptors (or memory) and a connection closing elsewhere frees one.
_ACCEPT_BACKOFF_S = (0.01, 1.0)
#: Errors of ``accept`` that say the process or the system is out of a resource, not that the listener broke.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Answer(Protocol):
    """What a server answers one request with: a status and a complete body.

    An answer may also carry ``headers`` (a sequence of ``(name, value)`` pairs), sent after the content type.
    """

    @property
    def status(self) -> int: ...

    @property
    def body(self) -> bytes: ...

    @property
    def content_type(self) -> str: ...


#: ``respond(request, body)``: the h11 ``Request`` and its body; None closes the connection unanswered.
Respond = Callable[[Any, bytes], Awaitable[Answer | None]]
#: ``error(status, message)``: the server's own error answer, in its API's shape, for what ``respond`` never
#: sees: a malformed request (400), a body over the limit (413), a ``respond`` that raised (500).
ErrorAnswer = Callable[[int, str], Answer]


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

    respond: Respond
    error: ErrorAnswer
    max_body: int
    #: The server's name in log lines.
    what: str
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
                    self.respond,
                    self.error,
                    max_body=self.max_body,
                    what=self.what,
                    state=partial(self._mark, connection),
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
            if bound.cancelled_caught:
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


async def serve_connection(
    stream: anyio.abc.ByteStream,
    respond: Respond,
    error: ErrorAnswer | None = None,
    *,
    max_body: int,
    what: str,
    state: Callable[[bool], None] | None = None,
) -> None:
    """Serve one connection until either side closes it; a handler error is answered (500) and logged, never raised.

    ``error`` builds the server's own error answers (without one they are plain text); ``max_body``
    bounds a request body (a larger one is answered 413 and the connection closed); ``what`` names
    the server in log lines; ``state(busy)`` hears when a request starts (True) and is answered (False).
    """
    try:
        await _serve(stream, respond, error or _plain_error, max_body, what, state or _ignore)
    except Exception:  # one bad connection must not take the server down
        logger.exception("%s: a connection handler failed", what)


@dataclass(frozen=True)
class _PlainError:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


def _plain_error(status: int, message: str) -> Answer:
    return _PlainError(status, message.encode())


def _ignore(busy: bool) -> None:
    pass


async def _serve(
    stream: anyio.abc.ByteStream,
    respond: Respond,
    error: ErrorAnswer,
    max_body: int,
    what: str,
    state: Callable[[bool], None],
) -> None:
    import h11

    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            try:
                incoming = await _read_request(conn, stream, max_body, error, state)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await _send_quietly(conn, stream, error(exc.error_status_hint, f"malformed HTTP request: {exc}"))
                return
            if incoming is None:
                return
            if not isinstance(incoming, tuple):  # refused before its body was read: answered, then closed
                await _send_quietly(conn, stream, incoming)
                return
            try:
                answer = await _respond_watching(conn, stream, partial(respond, *incoming))
            except Exception as exc:
                logger.exception("%s: the handler of %s failed", what, _target(incoming[0]))
                answer = error(500, f"{what}: the request handler failed: {type(exc).__name__}: {exc}")
            if answer is None:
                return
            if not await _send_quietly(conn, stream, answer):
                return
            state(False)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


def _target(request: Any) -> str:
    return f"{request.method.decode('latin-1')} {request.target.decode('latin-1')}"


async def _receive(conn: Any, stream: anyio.abc.ByteStream) -> bytes:
    """Feed the next bytes of ``stream`` to ``conn`` (b"" once the client has closed); returns them."""
    try:
        data = await stream.receive(_CHUNK)
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        data = b""
    conn.receive_data(data)
    return data


async def _read_request(
    conn: Any, stream: anyio.abc.ByteStream, max_body: int, error: ErrorAnswer, state: Callable[[bool], None]
) -> tuple[Any, bytes] | Answer | None:
    """The next request and its body; a 413 to send when its body is over ``max_body``; None once the client left."""
    import h11

    request = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            await _receive(conn, stream)
        elif isinstance(event, h11.Request):
            request = event
            state(True)
            length = _content_length(event.headers)
            if length is not None and length > max_body:
                return error(413, f"the request body ({length} bytes) is over this server's limit of {max_body} bytes")
            if conn.they_are_waiting_for_100_continue:  # the client waits for this before sending the body
                go_on = conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                if not await _send_data(stream, go_on):
                    return None
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return error(413, f"the request body is over this server's limit of {max_body} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has checked it is a number
    return None


async def _respond_watching(
    conn: Any, stream: anyio.abc.ByteStream, respond: Callable[[], Awaitable[Answer | None]]
) -> Answer | None:
    """``respond()``, cancelled if the client closes the connection meanwhile (then None)."""
    answer: Answer | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        if not await _receive(conn, stream):  # bytes of a pipelined next request stay in conn
            scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        answer = await respond()
        group.cancel_scope.cancel()
    return answer


async def _send_quietly(conn: Any, stream: anyio.abc.ByteStream, answer: Answer) -> bool:
    """Send ``answer``; False when the client has gone (or the exchange cannot take an answer any more)."""
    import h11

    headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
    headers += list(getattr(answer, "headers", ()))
    try:
        data = conn.send(h11.Response(status_code=answer.status, headers=headers))
        data += conn.send(h11.Data(data=answer.body))
        data += conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return False
    return await _send_data(stream, data)


async def _send_data(stream: anyio.abc.ByteStream, data: bytes) -> bool:
    """Write ``data``; False when the client has gone."""
    try:
        await stream.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    return True
