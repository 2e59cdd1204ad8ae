"""A capture session: one rollout's view of the endpoint, its calls and its in-flight requests (design rule 19)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._runtime.completion import Completion
from .._runtime.contexts import RolloutContext
from ._capture import CallRecord, Capture
from ._tombstone import Afterlife

__all__ = ["CaptureSession"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class CaptureSession:
    """One rollout's view of the endpoint: its base URL, API key, and the calls captured so far.

    ``id`` is public (the engine's session id, in traces and observers); ``api_key`` is the secret that
    reaches the session, in its ``base_url`` or as ``Authorization: Bearer <api_key>``.

    ``closed`` is set once, by the scope that opened it; ``close_reason`` says why (``"ended"``,
    ``"cancelled"``, ``"failed"``). ``context`` is the rollout attempt the session belongs to: its
    requests run in the server's tasks, not the rollout's, so they reach the attempt's observers
    (``engine_call_*``), time splits, sampling seed, pause clock and engine client through it.
    """

    id: str
    api_key: str
    rollout: str
    base_url: str
    capture: Capture
    sampling_params: dict[str, Any] | None
    context: RolloutContext
    closed: bool = False
    close_reason: str | None = None
    #: How many times the session was closed: 1 after its scope exits, whatever the path.
    closes: int = 0
    #: Engine requests sent for this session (answered or not): the engine session is finished if any.
    engine_requests: int = 0
    #: Each wire API's state in this session, by API name (Responses: its stored responses); dropped when it closes.
    stores: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The endpoint's abandoned agent calls (its server's): set by :meth:`CaptureServer.session`.
    _afterlife: Afterlife = field(default_factory=Afterlife, repr=False)
    _inflight: set[anyio.CancelScope] = field(default_factory=set)
    #: The endpoint worker serving the session (``agent_endpoint_workers``), by index; None: the trainer's loop.
    worker: int | None = None
    #: Why the session was lost before its close (its endpoint worker died): its rollout fails with it.
    lost: BaseException | None = None
    #: The scope of the session's body, which :meth:`lose` cancels (pooled sessions).
    _body: anyio.CancelScope | None = field(default=None, repr=False)
    #: Called once by :meth:`close` with its reason (a pooled session tells its worker), and what that
    #: started: the worker's answer, with what it captured.
    on_close: Callable[[str], None] | None = field(default=None, repr=False)
    closing: Completion[Any] | None = field(default=None, repr=False)
    #: Set once the last in-flight request of a closed session has ended (made by :meth:`_drain`).
    _drained: anyio.Event | None = None

    @property
    def calls(self) -> list[CallRecord]:
        return self.capture.calls

    @property
    def responses(self) -> dict[str, Any]:
        """The session's stored Responses API responses, for a later ``previous_response_id``."""
        return self.stores.setdefault("responses", {})

    @property
    def anthropic_base_url(self) -> str:
        """The official ``anthropic`` client's ``base_url`` for this session: its root, without ``/v1``.

        That client appends ``/v1/messages`` itself (``ANTHROPIC_BASE_URL`` for a command agent).
        """
        return self.base_url.removesuffix("/v1")

    def close(self, reason: str) -> None:
        """End the session now (idempotent): in-flight requests are cancelled and answer 499."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.closes += 1
        self.stores.clear()
        for scope in list(self._inflight):
            scope.cancel()
        if self.on_close is not None:
            self.on_close(reason)

    def lose(self, error: BaseException) -> None:
        """The session's endpoint worker died: its body and engine calls are cancelled, its rollout fails with
        ``error`` (in the event loop's thread)."""
        if self.lost is not None or self.closed:
            return
        self.lost = error
        if self._body is not None:
            self._body.cancel()
        for scope in list(self._inflight):
            scope.cancel()

    def outlived_by(self, call: Completion[Any]) -> None:
        """An agent call abandoned by this session's rollout still runs: the endpoint's port keeps answering
        (once the endpoint has closed, with the ended session's 404) until ``call`` has returned."""
        self._afterlife.hold(call)

    def _request_ended(self, scope: anyio.CancelScope) -> None:
        self._inflight.discard(scope)
        if not self._inflight and self._drained is not None:
            self._drained.set()

    async def _drain(self, limit_s: float) -> bool:
        """Wait (shielded, at most ``limit_s``) until the requests the close cancelled have ended; whether they did.

        So nothing of the session outlives its scope: each request's ``engine_call_finished`` is
        told, and its engine task cancelled, before the rollout's attempt ends.
        """
        if not self._inflight:
            return True
        self._drained = anyio.Event()
        with anyio.move_on_after(limit_s, shield=True) as bound:
            await self._drained.wait()
        if bound.cancelled_caught:
            logger.warning(
                "%d request(s) of rollout %s's capture session did not end within %g s of its close; left running",
                len(self._inflight),
                self.rollout,
                limit_s,
            )
            return False
        return True
