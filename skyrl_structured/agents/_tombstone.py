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
backlog of connections not yet accepted is kept. The tombstone is one daemon thread running the
package's HTTP core on an event loop of its own (:class:`~skyrl_structured._http.ServerThread`): it
answers every request with the ended session's 404 and ``Connection: close``, never blocks anyone,
and closes the port as soon as the last of those calls has returned, or when the generator is
closed (``aclose()``).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._http import Request, Response, ServerThread
from .._runtime.completion import Completion

__all__ = ["Afterlife", "Tombstone"]

logger = logging.getLogger(__name__)

#: A late request's body is read to its end before it is answered, up to this (then 413: the same 404).
_MAX_BODY = 32 * 1024 * 1024
#: How long stopping a tombstone waits for its thread to close the port (it never blocks: a hang bound).
_JOIN_S = 10.0

#: ``respond(request)``: the answer to a request, or to a malformed request (None).
Respond = Callable[[Request | None], Response]


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


class Tombstone(ServerThread):
    """The closed endpoint's port, answered by the HTTP core in a daemon thread.

    See :class:`~skyrl_structured._http.ServerThread`.

    Every request, a malformed one included, gets ``respond``'s answer (the ended session's 404) with
    ``Connection: close``; a ``respond`` that raises is answered with its answer to a malformed request.
    """

    def __init__(self, sockets: Sequence[socket.socket], respond: Respond, *, what: str) -> None:
        fallback = respond(None)  # made before any request: what a failing ``respond`` is replaced with

        def error(status: int, message: str) -> Response:
            return fallback

        port = int(sockets[0].getsockname()[1]) if sockets else 0
        super().__init__(
            sockets, respond, error, what=what, name=f"skyrl-structured-tombstone-{port}", max_body=_MAX_BODY
        )
        logger.debug("%s: closed with abandoned agent calls running; port %d answers for it", what, self.port)

    def join(self, timeout_s: float = _JOIN_S) -> bool:
        """Wait (blocking) until the thread has closed the port; whether it has."""
        return super().join(timeout_s)
