"""The HTTP core (skyrl_structured._http): real sockets on 127.0.0.1, raw and httpx clients, asyncio and trio."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from skyrl_structured._http import Request, Response, ServerThread, serve
from tests._http import parse_answers

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches (never a verdict on speed).
HANG_S = 60.0
MAX_BODY = 1024


def shaped_error(status: int, message: str) -> Response:
    """A server's own error shape, to tell it from plain text."""
    return Response.json(status, {"error": {"code": status, "message": message}})


async def echo(request: Request) -> Response:
    payload = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "body": request.body.decode(),
        "x-tag": request.header("X-Tag"),
    }
    return Response.json(200, payload, headers=(("x-served", "yes"),))


async def raw_exchange(port: int, *parts: bytes) -> bytes:
    """Send ``parts`` on one connection (each after the previous one's interim answer, if more than one), then
    read until the server closes it."""
    data = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        with anyio.fail_after(HANG_S):
            for k, part in enumerate(parts):
                while k and data.count(b"\r\n\r\n") < k:
                    data += await stream.receive()
                await stream.send(part)
            while True:
                try:
                    data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return data


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=HANG_S).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_request_is_decoded_once_and_its_answer_framed(anyio_backend, leak_tracker):
    async with (
        leak_tracker,
        serve(echo, shaped_error, what="t", max_body=MAX_BODY) as server,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client,
    ):
        reply = await client.post("/a/b?x=1&y=2", content=b"hello", headers={"x-tag": "T"})
    assert reply.status_code == 200
    assert reply.headers["x-served"] == "yes"
    assert reply.headers["content-length"] == str(len(reply.content))
    assert reply.json() == {"method": "POST", "path": "/a/b", "query": "x=1&y=2", "body": "hello", "x-tag": "T"}
    assert await anyio.to_thread.run_sync(refused, server.port)


async def test_100_continue_is_answered_before_the_body_is_sent(anyio_backend, leak_tracker):
    async with leak_tracker, serve(echo, shaped_error, what="t", max_body=MAX_BODY) as server:
        head = b"POST /c HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n"
        data = await raw_exchange(server.port, head, b"body")
    interim, final = parse_answers(data)
    assert interim[0] == 100
    assert final[0] == 200
    assert json.loads(final[2])["body"] == "body"


async def test_a_body_over_the_limit_is_refused_413_in_the_servers_shape_and_the_connection_closed(anyio_backend):
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(200)

    async with serve(handler, shaped_error, what="t", max_body=MAX_BODY) as server:
        declared = await raw_exchange(
            server.port, f"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {MAX_BODY + 1}\r\n\r\n".encode()
        )
        chunked = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        chunked += f"{MAX_BODY + 1:x}\r\n".encode() + b"a" * (MAX_BODY + 1) + b"\r\n0\r\n\r\n"
        streamed = await raw_exchange(server.port, chunked)
    for data in (declared, streamed):
        ((status, _, body),) = parse_answers(data)  # one answer, then the server closed the connection
        assert status == 413
        assert json.loads(body)["error"]["code"] == 413
        assert f"limit of {MAX_BODY} bytes" in json.loads(body)["error"]["message"]
    assert seen == []


async def test_a_malformed_request_is_answered_400_in_the_servers_shape(anyio_backend):
    async with serve(echo, shaped_error, what="t", max_body=MAX_BODY) as server:
        data = await raw_exchange(server.port, b"NOT HTTP AT ALL\r\n\r\n")
    ((status, headers, body),) = parse_answers(data)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")


async def test_pipelined_requests_on_one_keep_alive_connection_are_answered_in_order(anyio_backend):
    async with serve(echo, shaped_error, what="t", max_body=MAX_BODY) as server:
        requests = b"".join(f"POST /{k} HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n{k}".encode() for k in range(3))
        data = await raw_exchange(server.port, requests + b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    found = parse_answers(data)
    assert [status for status, _, _ in found] == [200] * 4
    assert [json.loads(body)["path"] for _, _, body in found] == ["/0", "/1", "/2", "/last"]
    assert [json.loads(body)["body"] for _, _, body in found] == ["0", "1", "2", ""]


async def test_a_streamed_body_goes_out_chunked_each_chunk_as_it_is_produced(anyio_backend, leak_tracker):
    next_one = [anyio.Event() for _ in range(3)]

    async def events() -> AsyncIterator[bytes]:
        for k in range(3):
            yield f"data: {k}\n\n".encode()
            await next_one[k].wait()  # the next chunk only once the client has read this one
        yield b"data: [DONE]\n\n"

    async def handler(request: Request) -> Response:
        return Response.events(events())

    got: list[bytes] = []
    async with (
        leak_tracker,
        serve(handler, shaped_error, what="t", max_body=MAX_BODY) as server,
        httpx.AsyncClient() as client,
        client.stream("GET", f"http://127.0.0.1:{server.port}/s") as reply,
    ):
        assert reply.headers["transfer-encoding"] == "chunked"
        assert reply.headers["content-type"] == "text/event-stream"
        assert "content-length" not in reply.headers
        with anyio.fail_after(HANG_S):
            async for line in reply.aiter_lines():
                if line:
                    got.append(line.encode())
                    if len(got) <= 3:
                        next_one[len(got) - 1].set()
    assert got == [b"data: 0", b"data: 1", b"data: 2", b"data: [DONE]"]


async def test_a_client_that_leaves_cancels_the_handler(anyio_backend, leak_tracker):
    started, cancelled = anyio.Event(), anyio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    async with leak_tracker, serve(handler, shaped_error, what="t", max_body=MAX_BODY) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with anyio.fail_after(HANG_S):
                await started.wait()
        with anyio.fail_after(HANG_S):
            await cancelled.wait()


async def test_a_client_that_leaves_mid_stream_cancels_the_producer(anyio_backend, leak_tracker):
    closed = anyio.Event()
    outcome: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            outcome.append("cancelled")
            raise
        finally:
            closed.set()

    async def handler(request: Request) -> Response:
        return Response.events(events())

    async with leak_tracker, serve(handler, shaped_error, what="t", max_body=MAX_BODY) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            with anyio.fail_after(HANG_S):
                while b"data: first" not in data:
                    data += await stream.receive()
        with anyio.fail_after(HANG_S):
            await closed.wait()
    assert outcome == ["cancelled"]


async def test_a_handler_that_raises_is_answered_500_in_the_servers_shape(anyio_backend, caplog):
    async def handler(request: Request) -> Response:
        raise ValueError("broken handler")

    async with serve(handler, shaped_error, what="the t server", max_body=MAX_BODY) as server, httpx.AsyncClient() as c:
        first = await c.get(f"http://127.0.0.1:{server.port}/x")
        second = await c.get(f"http://127.0.0.1:{server.port}/y")  # the connection lives on
    assert first.status_code == second.status_code == 500
    assert first.json()["error"]["message"] == "the t server: the request handler failed: ValueError: broken handler"
    assert "the handler of GET /x failed" in caplog.text


async def test_closing_answers_the_request_in_flight_first_then_closes_the_port(anyio_backend, leak_tracker):
    started, release = anyio.Event(), anyio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        await release.wait()  # shielded from the server's close: it is answered
        return Response.json(200, {"answered": True})

    replies: list[httpx.Response] = []

    async def call(port: int) -> None:
        async with httpx.AsyncClient() as client:
            replies.append(await client.get(f"http://127.0.0.1:{port}/busy"))

    async def release_once_closing(server: Any) -> None:
        # The server exposes no event for "closing began"; its listeners close first. Polled under a hang bound.
        while any(one.fileno() != -1 for one in server.sockets):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        release.set()

    async with leak_tracker, anyio.create_task_group() as group:
        async with serve(handler, shaped_error, what="t", max_body=MAX_BODY, close_timeout_s=HANG_S) as server:
            sockets = server.sockets
            group.start_soon(call, server.port)
            with anyio.fail_after(HANG_S):
                await started.wait()
            group.start_soon(release_once_closing, server)
        assert release.is_set()
        assert all(one.fileno() == -1 for one in sockets)
    assert [r.json() for r in replies] == [{"answered": True}]


async def test_a_server_thread_answers_on_duplicated_sockets_with_connection_close_until_stopped(anyio_backend):
    calls: list[str] = []

    def respond(request: Request) -> Response:
        calls.append(request.path)
        if request.path == "/raise":
            raise RuntimeError("late")
        return Response.json(404, {"path": request.path}, headers=(("x-should-retry", "false"),))

    def error(status: int, message: str) -> Response:
        return Response.json(410, {"fallback": status})

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = int(listening.getsockname()[1])
        thread = ServerThread([listening], respond, error, what="t", name=f"t-{port}", max_body=MAX_BODY)
    # The original socket is closed: the duplicate keeps the port answering.
    try:
        head = b"POST /p HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
        interim, answer = parse_answers(await raw_exchange(port, head, b"{}"))
        ((raised, _, raised_body),) = parse_answers(await raw_exchange(port, b"GET /raise HTTP/1.1\r\nhost: x\r\n\r\n"))
        ((malformed, _, _),) = parse_answers(await raw_exchange(port, b"NOT HTTP\r\n\r\n"))
    finally:
        thread.stop()
        assert await anyio.to_thread.run_sync(thread.join, HANG_S)
    assert interim[0] == 100
    assert answer[0] == 404
    assert answer[1]["connection"] == "close"
    assert answer[1]["x-should-retry"] == "false"
    assert json.loads(answer[2]) == {"path": "/p"}
    assert (raised, json.loads(raised_body)) == (410, {"fallback": 500})
    assert malformed == 410
    assert calls == ["/p", "/raise"]
    assert thread.answered == 1
    assert await anyio.to_thread.run_sync(refused, port)
