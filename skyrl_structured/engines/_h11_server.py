"""The HTTP/1.1 plumbing of the servers this package runs on anyio and h11, in the caller's event loop.

Two servers use it: the agents' capture endpoint (:mod:`skyrl_structured.agents`) and the test kit's
vLLM-compatible server (:mod:`skyrl_structured.testing.vllm_server`). Each gives
:func:`serve_connection` a ``respond(request, body)`` coroutine; this module reads the requests of
one keep-alive connection, answers them in turn, and cancels the ``respond`` in progress when the
client goes away (as vLLM aborts a generation whose client disconnected).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.abc

__all__ = ["Answer", "serve_connection"]

logger = logging.getLogger(__name__)

_CHUNK = 65536


class Answer(Protocol):
    """What a server answers one request with: a status and a complete body."""

    @property
    def status(self) -> int: ...

    @property
    def body(self) -> bytes: ...

    @property
    def content_type(self) -> str: ...


#: ``respond(request, body)``: the h11 ``Request`` and its body; None closes the connection unanswered.
Respond = Callable[[Any, bytes], Awaitable[Answer | None]]


async def serve_connection(stream: anyio.abc.ByteStream, respond: Respond, *, max_body: int, what: str) -> None:
    """Serve one connection until either side closes it; a handler error is logged, never raised.

    ``max_body`` bounds a request body (a larger one closes the connection); ``what`` names the
    server in the log line of a failed connection.
    """
    try:
        await _serve(stream, respond, max_body)
    except Exception:  # one bad connection must not take the server down
        logger.exception("%s: a connection handler failed", what)


async def _serve(stream: anyio.abc.ByteStream, respond: Respond, max_body: int) -> None:
    import h11

    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            try:
                incoming = await _read_request(conn, stream, max_body)
            except h11.RemoteProtocolError:
                return
            if incoming is None:
                return
            answer = await _respond_watching(conn, stream, partial(respond, *incoming))
            if answer is None:
                return
            try:
                await _send(conn, stream, answer)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, h11.LocalProtocolError):
                return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _receive(conn: Any, stream: anyio.abc.ByteStream) -> bytes:
    """Feed the next bytes of ``stream`` to ``conn`` (b"" once the client has closed); returns them."""
    try:
        data = await stream.receive(_CHUNK)
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        data = b""
    conn.receive_data(data)
    return data


async def _read_request(conn: Any, stream: anyio.abc.ByteStream, max_body: int) -> tuple[Any, bytes] | None:
    import h11

    request = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            await _receive(conn, stream)
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return None
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
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


async def _send(conn: Any, stream: anyio.abc.ByteStream, answer: Answer) -> None:
    import h11

    headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
    data = conn.send(h11.Response(status_code=answer.status, headers=headers))
    data += conn.send(h11.Data(data=answer.body))
    data += conn.send(h11.EndOfMessage())
    await stream.send(data)
