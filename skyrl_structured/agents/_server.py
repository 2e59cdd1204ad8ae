"""The capture endpoint: an OpenAI-compatible HTTP server on 127.0.0.1, in the caller's event loop (anyio + h11).

Routes, under a session's base URL ``http://127.0.0.1:PORT/sessions/<id>/v1`` (or under ``/v1`` with
``Authorization: Bearer <id>``): ``POST /chat/completions`` and ``GET /models``. Sessions are opened
and closed by :meth:`CaptureServer.session`; a closed session keeps no state but a bounded
tombstone (its rollout's name) so that a late request hears 410 rather than 404.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from .._episode.calls import engine_call
from .._runtime.cleanup import run_cleanups
from .._runtime.contexts import BatchContext, RolloutContext
from .._runtime.pauses import use_clock
from .._runtime.sessions import SessionEnd
from ..config import ResilienceSettings
from ..engines._h11_server import serve_connection
from ..observe import RolloutObserver, RolloutRef
from ..types import InferenceClient, InferenceEngineInput
from ._capture import (
    APIError,
    CallRecord,
    Capture,
    chat_completion_body,
    chat_completion_stream,
    engine_sampling_params,
)

__all__ = ["CaptureServer", "CaptureSession", "serve_capture"]

logger = logging.getLogger(__name__)

_MAX_BODY = 32 * 1024 * 1024
#: Ended sessions remembered for a 410 (older ones answer 404): a bound, not a timer.
_TOMBSTONES = 65536
#: How long a closing session waits, by default, for its cancelled requests to end and for the engine's
#: ``finish_session`` (each shielded): a hung engine cannot keep a rollout from ending. The generator
#: passes its ``env_cleanup_timeout_s``; this is that knob's default.
_CLEANUP_BOUND_S: float = ResilienceSettings.env_cleanup_timeout_s


@dataclass(eq=False)
class CaptureSession:
    """One rollout's view of the endpoint: its base URL, API key, and the calls captured so far.

    ``closed`` is set once, by the scope that opened it; ``close_reason`` says why (``"ended"``,
    ``"cancelled"``, ``"failed"``). ``context`` is the rollout attempt the session belongs to: its
    requests run in the server's tasks, not the rollout's, so they reach the attempt's observers
    (``engine_call_*``), time splits, sampling seed, pause clock and engine client through it.
    """

    id: str
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
    _inflight: set[anyio.CancelScope] = field(default_factory=set)
    #: Set once the last in-flight request of a closed session has ended (made by :meth:`_drain`).
    _drained: anyio.Event | None = None

    @property
    def api_key(self) -> str:
        """The API key an agent sends (any key works on the session's own base URL)."""
        return self.id

    @property
    def calls(self) -> list[CallRecord]:
        return self.capture.calls

    def close(self, reason: str) -> None:
        """End the session now (idempotent): in-flight requests are cancelled and answer 499."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.closes += 1
        for scope in list(self._inflight):
            scope.cancel()

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


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, status: int, payload: Any) -> _Response:
        return cls(status, json.dumps(payload).encode())

    @classmethod
    def error(cls, error: APIError) -> _Response:
        return cls.json(error.status, error.body())


class CaptureServer:
    """Serves every session of one generator; create it with :func:`serve_capture`."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        *,
        model: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.url = ""
        self.port = 0
        self._sessions: dict[str, CaptureSession] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._counter = itertools.count()
        self._nonce = secrets.token_hex(4)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @asynccontextmanager
    async def session(
        self,
        rollout: str,
        *,
        sampling_params: dict[str, Any] | None = None,
        context: RolloutContext | None = None,
        cleanup_timeout_s: float = _CLEANUP_BOUND_S,
    ) -> AsyncIterator[CaptureSession]:
        """A capture session for one rollout, open for the block and closed exactly once when it exits.

        ``context`` is the rollout attempt (the generator's supervisor made it); its ``ref`` gets the
        session's id. Without one the session has a context of its own, heard by no observer, and
        calls this server's client. The session is the rollout's environment to its observers and
        cleanup stats: ``env_opened`` once it exists, an ``env_close`` cleanup when it closes. On
        exit the requests still in flight are cancelled (499) and waited for (an overrun is the
        close's ``timeout``), then the engine session of the same id is finished when any request reached
        the engine, answered or cancelled: a ``finish_session`` cleanup step
        (:class:`~skyrl_structured._runtime.sessions.SessionEnd`), each wait shielded and bounded by
        ``cleanup_timeout_s``.
        """
        session_id = f"{self._nonce}-{next(self._counter)}"
        if context is None:
            context = RolloutContext(
                BatchContext(generator=self, client=self.client, default_params={}), RolloutRef(0, 1, None)
            )
        context.ref = dataclasses.replace(context.ref, session_id=session_id)
        session = CaptureSession(
            id=session_id,
            rollout=rollout,
            base_url=f"{self.url}/sessions/{session_id}/v1",
            capture=Capture(self.tokenizer, self.chat_template_kwargs),
            sampling_params=sampling_params,
            context=context,
        )
        self._sessions[session_id] = session
        # An agent's environment is its capture session: observers and the cleanup stats count it
        # opened here and closed below, as they count a gym rollout's environment.
        context.cleanup.envs_opened += 1
        context.emit(RolloutObserver.env_opened)
        reason = "ended"
        error: BaseException | None = None
        try:
            yield session
        except BaseException as exc:
            reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "failed"
            error = exc
            raise
        finally:
            context.emit(RolloutObserver.cleanup_started, "env_close")
            session.close(reason)
            if await session._drain(cleanup_timeout_s):
                context.cleanup.envs_closed += 1
                context.emit(RolloutObserver.cleanup_finished, "env_close", "ok", None)
            else:  # requests left running past the bound, as a gym env's abandoned close
                context.cleanup.env_cleanup_timeouts += 1
                context.emit(RolloutObserver.cleanup_finished, "env_close", "timeout", None)
            del self._sessions[session_id]
            self._ended[session_id] = rollout
            while len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)
            if session.engine_requests:
                await run_cleanups([SessionEnd(context, session_id)], limit_s=cleanup_timeout_s, error=error)

    # ------------------------------------------------------------------ HTTP (engines/_h11_server.py)

    async def _handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        # A client that goes away cancels _route, and with it the engine request.
        await serve_connection(stream, self._route, max_body=_MAX_BODY, what="capture endpoint")

    # ------------------------------------------------------------------ routes

    async def _route(self, request: Any, raw_body: bytes) -> _Response:
        method = request.method.decode("latin-1")
        path = request.target.decode("latin-1").split("?", 1)[0]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        try:
            session_id, route = _split_path(path, headers)
            if route == "/models":
                if method != "GET":
                    raise APIError(405, f"`{method} {path}`: use GET")
                return _Response.json(200, self._models())
            if route != "/chat/completions":
                raise APIError(404, f"no route `{path}`; the endpoint serves <base_url>/chat/completions and /models")
            if method != "POST":
                raise APIError(405, f"`{method} {path}`: use POST")
            session = self._lookup(session_id)
            try:
                body = json.loads(raw_body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object")
            return await self._chat(session, body)
        except APIError as error:
            return _Response.error(error)

    def _models(self) -> dict[str, Any]:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "skyrl-structured"}
        return {"object": "list", "data": [card]}

    def _lookup(self, session_id: str | None) -> CaptureSession:
        if session_id is None:
            raise APIError(
                404,
                "no capture session named: use the session's base URL (<endpoint>/sessions/<id>/v1) or send its "
                "API key as `Authorization: Bearer <id>`",
            )
        session = self._sessions.get(session_id)
        if session is not None and not session.closed:
            return session
        rollout = session.rollout if session is not None else self._ended.get(session_id)
        if rollout is not None:
            raise APIError(410, f"capture session `{session_id}` is closed: its rollout {rollout} has ended")
        raise APIError(404, f"capture session `{session_id}` is unknown or closed")

    async def _chat(self, session: CaptureSession, body: dict[str, Any]) -> _Response:
        params = engine_sampling_params(body, session.sampling_params)
        prepared = session.capture.prepare(body)
        context = session.context
        turn = session.engine_requests
        request: InferenceEngineInput = {
            "prompt_token_ids": [prepared.prompt_ids],
            "sampling_params": context.request_params(params, turn),  # seeded with generator.sampling_seed
            "session_ids": [session.id],
        }
        with anyio.CancelScope() as scope:
            session._inflight.add(scope)
            session.engine_requests += 1
            try:
                # The rollout's pause clock is the current one here too (HTTPEngine's request timeout stops).
                with use_clock(context.batch.pauses):
                    text, sampled, stop_reason, logprobs, _ = await engine_call(
                        context, turn, len(prepared.prompt_ids), lambda: context.client.generate(request)
                    )
            except Exception as exc:
                logger.warning("capture endpoint: the engine failed for rollout %s: %r", session.rollout, exc)
                raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}") from None
            finally:
                session._request_ended(scope)
            if not session.closed:  # else the reply raced the close: the rollout no longer takes it (499)
                call = session.capture.record(prepared, sampled, logprobs, stop_reason, text)
                completion = chat_completion_body(
                    call,
                    completion_id=f"chatcmpl-{session.id}-{len(session.calls) - 1}",
                    model=str(body.get("model") or self.model),
                    created=int(time.time()),
                    parse_tools=bool(body.get("tools")),
                )
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return _Response(200, chat_completion_stream(completion, include_usage=usage), "text/event-stream")
                return _Response.json(200, completion)
        raise APIError(
            499,
            f"rollout {session.rollout} ended ({session.close_reason}) while this request was in flight; "
            "the engine request was cancelled",
        )


def _split_path(path: str, headers: dict[str, str]) -> tuple[str | None, str]:
    """``(session id or None, route after /v1)`` from ``/sessions/<id>/v1/...`` or ``/v1/...`` + bearer key."""
    parts = path.rstrip("/").split("/")
    if len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1":
        return parts[2], "/" + "/".join(parts[4:])
    if len(parts) >= 2 and parts[1] == "v1":
        auth = headers.get("authorization", "")
        key = auth[len("bearer ") :].strip() if auth.lower().startswith("bearer ") else None
        return key or None, "/" + "/".join(parts[2:])
    return None, path


@asynccontextmanager
async def serve_capture(
    client: InferenceClient,
    tokenizer: Any,
    *,
    model: str = "skyrl-agent",
    chat_template_kwargs: dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[CaptureServer]:
    """Serve a capture endpoint in front of ``client`` until the block exits (port 0: a free one).

    Raises:
        ImportError: h11 is missing (``pip install 'skyrl-structured[http]'``).
    """
    from ..engines._optional import import_optional

    import_optional("h11", "http", needed_by="serve_capture")
    server = CaptureServer(client, tokenizer, model=model, chat_template_kwargs=chat_template_kwargs)
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    server.port = int(listener.extra(SocketAttribute.local_port))
    server.url = f"http://{host}:{server.port}"
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, server._handle_connection, group)
            try:
                yield server
            except Exception as exc:  # re-raised below as itself, not wrapped in the task group's ExceptionGroup
                failure = exc
            finally:
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
