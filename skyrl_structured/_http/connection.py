"""One keep-alive HTTP/1.1 connection, served with h11 on anyio: read a request, call the handler, send its answer.

Every request gets an answer and the server never raises: a malformed request is answered 400, a
body over the limit 413 (both then close the connection), a handler that raised 500, each in the
server's own error shape (its ``error(status, message)``). ``Expect: 100-continue`` is answered
here and only here. While the handler runs and while a streamed body is sent, the connection is
watched: a client that goes away cancels the handler (as vLLM aborts a generation whose client
disconnected) or the body's producer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from .messages import Request, Response

__all__ = ["ErrorAnswer", "Handler", "plain_error", "serve_connection"]

logger = logging.getLogger(__name__)

_CHUNK = 65536

#: ``handler(request)``: the answer; None closes the connection unanswered (a dropped connection).
Handler = Callable[[Request], Awaitable[Response | None]]
#: ``error(status, message)``: the server's own answer, in its API's shape, for what the handler never sees
#: or could not answer: a malformed request (400), a body over the limit (413), a handler that raised (500).
ErrorAnswer = Callable[[int, str], Response]


def plain_error(status: int, message: str) -> Response:
    """The default error answer: the message as plain text."""
    return Response(status, message.encode(), "text/plain; charset=utf-8")


def _ignore(busy: bool) -> None:
    pass


async def serve_connection(
    stream: anyio.abc.ByteStream,
    handler: Handler,
    error: ErrorAnswer = plain_error,
    *,
    max_body: int,
    what: str,
    state: Callable[[bool], None] = _ignore,
    close_each: bool = False,
) -> None:
    """Serve one connection until either side closes it; never raises (a failure is logged).

    ``max_body`` bounds a request body; ``what`` names the server in log lines; ``state(busy)``
    hears when a request starts (True) and when its answer is out (False); ``close_each`` answers
    every request with ``Connection: close`` and closes the connection after it.
    """
    try:
        await _serve(stream, handler, error, max_body, what, state, close_each)
    except Exception:  # one bad connection must not take the server down
        logger.exception("%s: a connection handler failed", what)


async def _serve(
    stream: anyio.abc.ByteStream,
    handler: Handler,
    error: ErrorAnswer,
    max_body: int,
    what: str,
    state: Callable[[bool], None],
    close_each: bool,
) -> None:
    import h11

    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            try:
                incoming = await _read_request(conn, stream, max_body, error, state)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    refusal = error(exc.error_status_hint, f"malformed HTTP request: {exc}")
                    await _send(conn, stream, refusal, close_each, what)
                return
            if incoming is None:
                return
            if isinstance(incoming, Response):  # refused before its body was read: answered, then closed
                await _send(conn, stream, incoming, close_each, what)
                return
            if not await _exchange(conn, stream, incoming, handler, error, what, close_each):
                return
            state(False)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _exchange(
    conn: Any,
    stream: anyio.abc.ByteStream,
    request: Request,
    handler: Handler,
    error: ErrorAnswer,
    what: str,
    close_each: bool,
) -> bool:
    """Answer ``request``, watching the client meanwhile; whether the answer went out whole."""
    left = False
    sent = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal left
        if not await _receive(conn, stream):  # bytes of a pipelined next request stay in conn
            left = True
            scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        try:
            response = await handler(request)
        except Exception as exc:
            logger.exception("%s: the handler of %s %s failed", what, request.method, request.path)
            response = error(500, f"{what}: the request handler failed: {type(exc).__name__}: {exc}")
        if response is not None:
            sent = await _send(conn, stream, response, close_each, what)
        group.cancel_scope.cancel()
    return sent and not left


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
) -> Request | Response | None:
    """The next request; a 413 to send when its body is over ``max_body``; None once the client left."""
    import h11

    head: Any = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            await _receive(conn, stream)
        elif isinstance(event, h11.Request):
            head = event
            state(True)
            length = _content_length(event.headers)
            if length is not None and length > max_body:
                return error(413, f"the request body ({length} bytes) is over this server's limit of {max_body} bytes")
            if conn.they_are_waiting_for_100_continue:  # the client waits for this before sending the body
                go_on = conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                if not await _write(stream, go_on):
                    return None
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return error(413, f"the request body is over this server's limit of {max_body} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return Request.decode(head.method, head.target, head.headers, bytes(body))
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has checked it is a number
    return None


async def _send(conn: Any, stream: anyio.abc.ByteStream, response: Response, close_each: bool, what: str) -> bool:
    """Send ``response``; False when the client has gone, the exchange cannot take an answer, or a stream broke."""
    import h11

    headers = [("content-type", response.content_type)]
    body = response.body
    if isinstance(body, bytes):
        headers.append(("content-length", str(len(body))))
    headers += response.headers
    if close_each:
        headers.append(("connection", "close"))
    try:
        data = conn.send(h11.Response(status_code=response.status, headers=headers))
        if isinstance(body, bytes):
            data += conn.send(h11.Data(data=body)) if body else b""
            data += conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return False
    if isinstance(body, bytes):
        return await _write(stream, data)
    return await _write(stream, data) and await _stream(conn, stream, aiter(body), what)


async def _stream(conn: Any, stream: anyio.abc.ByteStream, chunks: AsyncIterator[bytes], what: str) -> bool:
    """Send a streamed body chunk by chunk, each as it is produced; the producer is closed on every path."""
    import h11

    try:
        async for chunk in chunks:
            if chunk and not await _write(stream, conn.send(h11.Data(data=chunk))):
                return False
        return await _write(stream, conn.send(h11.EndOfMessage()))
    except Exception:
        logger.exception("%s: producing a streamed reply failed; the reply is cut short", what)
        return False
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _write(stream: anyio.abc.ByteStream, data: bytes) -> bool:
    """Write ``data``; False when the client has gone."""
    try:
        await stream.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    return True
