"""A closed capture endpoint keeps answering while agent threads abandoned on it still run.

Design rule 22: an ended session answers with a status its clients do not retry. While the endpoint
is up it does so itself (404 ``rollout_ended``, ``x-should-retry: false``). But the endpoint closes
with the ``generate()`` call that opened it (SkyRL's trainer calls ``generate()`` without
``generator.serving()``), and a sync agent abandoned in its worker thread
(:mod:`skyrl_structured.agents._threads`) may call again after that. A refused connection is what
the ``openai`` client and LiteLLM retry (mini-swe-agent on LiteLLM for about four minutes), and all
that time the thread keeps its place in ``max_agent_threads``.

So an endpoint keeps, in an :class:`Afterlife`, the agent calls abandoned on it. When it closes while
one still runs, its listening sockets go to a :class:`Tombstone` before the endpoint's listener
closes: duplicates of their descriptors, so the port never refuses a connection and the kernel's
backlog of connections not yet accepted is kept. The tombstone is one daemon thread that answers
every request with the ended session's 404 and ``Connection: close``, never blocks anyone (its
sockets are non-blocking, served by one selector), and closes the port as soon as the last of those
calls has returned, or when the generator is closed (``aclose()``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._runtime.completion import Completion
from ..engines._h11_server import Answer

__all__ = ["Afterlife", "Tombstone"]

logger = logging.getLogger(__name__)

_CHUNK = 65536
#: How long accepting pauses when the process is out of file descriptors (a connection closing frees one).
_ACCEPT_PAUSE_S = 0.1
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: How long stopping a tombstone waits for its thread to close the port (it never blocks: a hang bound).
_JOIN_S = 10.0

#: ``respond(request)``: the answer to an h11 ``Request``, or to a malformed request (None).
Respond = Callable[[Any], Answer]


def _now(callback: Callable[[], None]) -> None:
    """A scheduler that runs a done-callback at once, in the thread that settled the call."""
    callback()


class Afterlife:
    """The agent calls abandoned on one endpoint, and its :class:`Tombstone` once it has closed. Thread-safe.

    The calls end in their worker threads, possibly after the event loop that abandoned them has
    gone, so their ends are heard in those threads, not on the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._tombstone: Tombstone | None = None

    @property
    def running(self) -> int:
        """Abandoned calls on this endpoint that have not returned yet."""
        return self._running

    @property
    def tombstone(self) -> Tombstone | None:
        """The tombstone answering for the closed endpoint now, if any."""
        return self._tombstone

    def hold(self, call: Completion[Any]) -> None:
        """Keep the endpoint's port answering until ``call`` (an abandoned agent call) has returned."""
        with self._lock:
            self._running += 1
        if not call.add_done_callback(_now, self._returned):
            self._returned()

    def _returned(self) -> None:
        with self._lock:
            self._running -= 1
            tombstone = self._tombstone if self._running == 0 else None
            if tombstone is not None:
                self._tombstone = None
        if tombstone is not None:
            tombstone.stop()

    def bury(self, sockets: Sequence[socket.socket], respond: Respond, *, what: str) -> Tombstone | None:
        """On the endpoint's close, before its listener closes: keep ``sockets`` answering while calls still run.

        Returns the tombstone started, or None: no abandoned call runs, or the sockets could not be
        duplicated (logged; the port then closes with the endpoint).
        """
        with self._lock:
            if self._closed or self._running == 0:
                self._closed = True
                return None
            self._closed = True
            try:
                self._tombstone = Tombstone(sockets, respond, what=what)
            except OSError as exc:
                logger.warning(
                    "%s: could not keep the port answering for %d abandoned agent call(s) (%r); their next "
                    "calls meet a refused connection",
                    what,
                    self._running,
                    exc,
                )
            return self._tombstone

    def stop(self) -> Tombstone | None:
        """Stop the tombstone now, whatever still runs (the generator is closed); returns it, to join."""
        with self._lock:
            tombstone, self._tombstone = self._tombstone, None
        if tombstone is not None:
            tombstone.stop()
        return tombstone


class _Client:
    """One accepted connection: its h11 state, the request read so far, the answer left to send."""

    __slots__ = ("conn", "out", "request", "sock")

    def __init__(self, sock: socket.socket, conn: Any) -> None:
        self.sock = sock
        self.conn = conn
        self.request: Any = None
        self.out = b""


class Tombstone:
    """One daemon thread answering every request on duplicates of a closed endpoint's listening sockets.

    Every request, a malformed one included, gets ``respond``'s answer with ``Connection: close``
    once it has been read to its end (so the connection closes without resetting an answer the
    client has not read); a client that leaves early is dropped. :meth:`stop` closes the port.
    """

    def __init__(self, sockets: Sequence[socket.socket], respond: Respond, *, what: str) -> None:
        import h11  # the endpoint runs on h11: it is installed

        self._h11 = h11
        self._respond = respond
        self._what = what
        self._fallback = respond(None)  # what a failing ``respond`` is replaced with, made before any request
        self._listeners: list[socket.socket] = []
        try:
            for one in sockets:
                self._listeners.append(one.dup())
            self._wake, self._waker = socket.socketpair()
        except OSError:
            for one in self._listeners:
                one.close()
            raise
        for one in (*self._listeners, self._wake, self._waker):
            one.setblocking(False)
        self.port = int(self._listeners[0].getsockname()[1]) if self._listeners else 0
        #: Requests answered so far.
        self.answered = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._clients: dict[socket.socket, _Client] = {}
        self.thread = threading.Thread(target=self._run, name=f"skyrl-structured-tombstone-{self.port}", daemon=True)
        self.thread.start()
        logger.debug("%s: closed with abandoned agent calls running; port %d answers for it", what, self.port)

    def stop(self) -> None:
        """Close the port soon (the thread closes it and exits); from any thread, idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            with contextlib.suppress(OSError):  # a full buffer: a byte is already waiting
                self._waker.send(b"\0")

    def join(self, timeout_s: float = _JOIN_S) -> bool:
        """Wait (blocking) until the thread has closed the port; whether it has."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._wake, selectors.EVENT_READ)
            for listener in self._listeners:
                selector.register(listener, selectors.EVENT_READ)
            self._loop(selector)
        except Exception:  # never expected: the port then closes, as without a tombstone
            logger.exception("%s: the tombstone answering for the closed endpoint failed", self._what)
        finally:
            for sock in [*self._clients, *self._listeners]:
                sock.close()
            self._clients.clear()
            selector.close()
            with self._lock:
                self._stopping = True
                self._wake.close()
                self._waker.close()
            logger.debug("%s: port %d closed after %d late request(s)", self._what, self.port, self.answered)

    def _loop(self, selector: selectors.BaseSelector) -> None:
        paused: list[socket.socket] = []
        resume_at = 0.0
        while True:
            timeout = max(0.0, resume_at - time.monotonic()) if paused else None
            for key, events in selector.select(timeout):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._wake:
                    return
                client = self._clients.get(sock)
                if client is not None:
                    try:
                        self._serve(selector, client, events)
                    except Exception:  # one bad connection must not close the port
                        logger.exception("%s: answering a late connection failed", self._what)
                        self._drop(selector, client)
                elif sock in self._listeners and not self._accept(selector, sock):
                    selector.unregister(sock)  # out of descriptors: a level-triggered listener would spin
                    paused.append(sock)
                    resume_at = time.monotonic() + _ACCEPT_PAUSE_S
            if paused and time.monotonic() >= resume_at:
                for sock in paused:
                    selector.register(sock, selectors.EVENT_READ)
                paused.clear()

    def _accept(self, selector: selectors.BaseSelector, listener: socket.socket) -> bool:
        """Accept what is waiting; False when out of file descriptors (accepting pauses)."""
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    logger.warning("%s: accepting a late connection failed: %r; pausing", self._what, exc)
                    return False
                return True  # a connection reset before it was accepted
            sock.setblocking(False)
            self._clients[sock] = _Client(sock, self._h11.Connection(self._h11.SERVER))
            selector.register(sock, selectors.EVENT_READ)

    def _serve(self, selector: selectors.BaseSelector, client: _Client, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(selector, client)
            return
        try:
            data = client.sock.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        h11 = self._h11
        client.conn.receive_data(data)
        while client.sock in self._clients:
            try:
                event = client.conn.next_event()
            except h11.RemoteProtocolError:
                self._answer(selector, client, None)
                return
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.Request):
                client.request = event
                if client.conn.they_are_waiting_for_100_continue:
                    go_on = client.conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                    self._send(selector, client, go_on)
            elif isinstance(event, h11.EndOfMessage):
                self._answer(selector, client, client.request)
                return
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                self._drop(selector, client)
                return

    def _answer(self, selector: selectors.BaseSelector, client: _Client, request: Any) -> None:
        h11 = self._h11
        try:
            answer = self._respond(request)
        except Exception:
            logger.exception("%s: answering a late request failed; answered with the ended endpoint's 404", self._what)
            answer = self._fallback
        headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
        headers += [*getattr(answer, "headers", ()), ("connection", "close")]
        try:
            data = client.conn.send(h11.Response(status_code=answer.status, headers=headers))
            data += client.conn.send(h11.Data(data=answer.body))
            data += client.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # the exchange cannot take an answer any more
            self._drop(selector, client)
            return
        self.answered += 1
        logger.debug("%s: answered a late request with %d (%d so far)", self._what, answer.status, self.answered)
        self._send(selector, client, data)

    def _send(self, selector: selectors.BaseSelector, client: _Client, data: bytes) -> None:
        client.out += data
        self._flush(selector, client)

    def _flush(self, selector: selectors.BaseSelector, client: _Client) -> None:
        """Send what is pending; close once the final answer is out, wait for the socket to drain otherwise."""
        try:
            sent = client.sock.send(client.out) if client.out else 0
        except BlockingIOError:
            sent = 0
        except OSError:  # the client has gone
            self._drop(selector, client)
            return
        client.out = client.out[sent:]
        done = client.conn.our_state is self._h11.MUST_CLOSE or client.conn.our_state is self._h11.CLOSED
        if not client.out and done:
            self._drop(selector, client)
            return
        selector.modify(client.sock, selectors.EVENT_WRITE if client.out else selectors.EVENT_READ)

    def _drop(self, selector: selectors.BaseSelector, client: _Client) -> None:
        if self._clients.pop(client.sock, None) is None:
            return
        selector.unregister(client.sock)
        client.sock.close()
