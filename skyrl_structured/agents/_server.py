"""The capture endpoint: an OpenAI-compatible HTTP server (127.0.0.1 by default), in the caller's event loop.

Routes, under a session's base URL ``http://HOST:PORT/sessions/<key>/v1`` (or under ``/v1`` with
``Authorization: Bearer <key>`` or ``x-api-key: <key>``): ``POST /chat/completions``, ``POST /responses``
(the OpenAI Responses API, translated by :mod:`._responses`), ``GET /models``, and Anthropic's
``POST /messages`` and ``/messages/count_tokens`` (:mod:`._anthropic`: the ``anthropic`` client's
``base_url`` is the session's root, without ``/v1``). A session has a
public id (the engine's session id, in traces and logs) and a secret key (its only credential, in
its base URL): each is 128+ bits from :mod:`secrets`, neither derived from the other or from another
session's. Sessions are opened and closed by :meth:`CaptureServer.session`; a closed session keeps
no state but a bounded record (its id and rollout's name) so that a late request hears which
rollout ended, with a status no agent's client retries (404, ``x-should-retry: false``). Once the
endpoint itself has closed, its port answers so for as long as an agent thread abandoned on it still
runs (:mod:`._tombstone`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._episode.calls import engine_call
from .._http import Request, Response, serve
from .._runtime.cleanup import run_cleanups
from .._runtime.completion import Completion
from .._runtime.contexts import BatchContext, RolloutContext
from .._runtime.pauses import use_clock
from .._runtime.sessions import SessionEnd
from ..config import AgentEndpointSettings, ResilienceSettings
from ..observe import RolloutObserver, RolloutRef
from ..types import InferenceClient, InferenceEngineInput, TrajectoryID
from . import _anthropic, _responses
from ._capture import (
    SURROGATE_ESCAPE,
    APIError,
    CallRecord,
    Capture,
    Prepared,
    check_encodable,
    engine_sampling_params,
)
from ._chat import chat_completion_body, chat_completion_stream
from ._tombstone import Afterlife

__all__ = ["CaptureServer", "CaptureSession", "serve_capture"]

logger = logging.getLogger(__name__)

_MAX_BODY = 32 * 1024 * 1024
#: Ended sessions remembered by key, so a late request hears which rollout ended (older ones are only unknown):
#: a bound, not a timer.
_TOMBSTONES = 65536
#: Hosts that are this machine only: listening there needs no warning.
_LOOPBACK = ("127.", "::1", "localhost")
#: How long a closing session waits, by default, for its cancelled requests to end and for the engine's
#: ``finish_session`` (each shielded): a hung engine cannot keep a rollout from ending. The generator
#: passes its ``env_cleanup_timeout_s``; this is that knob's default.
_CLEANUP_BOUND_S: float = ResilienceSettings.env_cleanup_timeout_s


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
    #: The session's Responses API responses, for a later ``previous_response_id``; dropped when it closes.
    responses: dict[str, _responses.Remembered] = field(default_factory=dict)
    #: The endpoint's abandoned agent calls (its server's): set by :meth:`CaptureServer.session`.
    _afterlife: Afterlife = field(default_factory=Afterlife, repr=False)
    _inflight: set[anyio.CancelScope] = field(default_factory=set)
    #: Set once the last in-flight request of a closed session has ended (made by :meth:`_drain`).
    _drained: anyio.Event | None = None

    @property
    def calls(self) -> list[CallRecord]:
        return self.capture.calls

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
        self.responses.clear()
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


def _error_response(error: APIError, shape: Callable[[APIError], Any] = APIError.body) -> Response:
    """``error`` answered in an API's error shape (OpenAI's unless ``shape`` says otherwise)."""
    return Response(error.status, json.dumps(shape(error)).encode(), headers=error.headers)


def _error_answer(status: int, message: str) -> Response:
    """The HTTP layer's own answers (a malformed request, a body over the limit), in OpenAI's error shape."""
    return _error_response(APIError(status, message))


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
        #: Open sessions by key, and ended ones' (id, rollout) by key.
        self._sessions: dict[str, CaptureSession] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: The agent calls abandoned on this endpoint, and its tombstone once closed (see :mod:`._tombstone`).
        self.afterlife = Afterlife()

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
        key = secrets.token_urlsafe(24)  # 192 bits, the credential
        if context is None:
            context = RolloutContext(
                BatchContext(generator=self, client=self.client, default_params={}), RolloutRef(0, 1, None)
            )
        session_id = _engine_session_id(context.ref.trajectory_id)
        context.ref = dataclasses.replace(context.ref, session_id=session_id)
        session = CaptureSession(
            id=session_id,
            api_key=key,
            rollout=rollout,
            base_url=f"{self.url}/sessions/{key}/v1",
            capture=Capture(self.tokenizer, self.chat_template_kwargs),
            sampling_params=sampling_params,
            context=context,
            _afterlife=self.afterlife,
        )
        self._sessions[key] = session
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
            del self._sessions[key]
            self._ended[key] = (session_id, rollout)
            while len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)
            if session.engine_requests:
                await run_cleanups([SessionEnd(context, session_id)], limit_s=cleanup_timeout_s, error=error)

    # ------------------------------------------------------------------ routes

    async def _route(self, request: Request) -> Response:
        """Answer one request, whatever happens: an exception of this endpoint is a 500 naming the rollout."""
        session: CaptureSession | None = None
        shape: Callable[[APIError], Any] = APIError.body
        try:
            method, path, raw_body = request.method, request.path, request.body
            path_key, bearer, route = _split_path(path, request)
            anthropic = route in (_anthropic.MESSAGES, _anthropic.COUNT_TOKENS)
            shape = _error_shape(route)
            if _misplaced(route):
                raise APIError(
                    404,
                    f"no route `{path}`: an anthropic client's base_url is the session's root, without /v1 "
                    "(the chat base URL minus its /v1)",
                )
            if route == "/models":
                if method != "GET":
                    raise APIError(405, f"`{method} {path}`: use GET")
                return Response.json(200, self._models())
            if route not in ("/chat/completions", "/responses") and not anthropic:
                raise APIError(
                    404,
                    f"no route `{path}`; the endpoint serves <base_url>/chat/completions, /responses and /models, "
                    "and Anthropic's /v1/messages under the session's root",
                )
            if method != "POST":
                raise APIError(405, f"`{method} {path}`: use POST")
            session = self._lookup(path_key, bearer)
            try:
                body = json.loads(raw_body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object")
            if SURROGATE_ESCAPE.search(raw_body):
                check_encodable(body)
            if route == "/responses":
                return await self._responses(session, body)
            if anthropic:
                return await self._messages(session, body, count_only=route == _anthropic.COUNT_TOKENS)
            return await self._chat(session, body)
        except APIError as error:
            return _error_response(error, shape)
        except Exception as exc:
            whose = f"rollout {session.rollout}" if session is not None else "no session"
            logger.exception("capture endpoint: answering a request of %s failed", whose)
            return _error_response(
                APIError(500, f"the capture endpoint failed on a request of {whose}: {type(exc).__name__}: {exc}"),
                shape,
            )

    def _models(self) -> dict[str, Any]:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "skyrl-structured"}
        return {"object": "list", "data": [card]}

    def _lookup(self, path_key: str | None, bearer: str | None) -> CaptureSession:
        """The one open session the request names, by the key in its path or else its bearer key.

        A bearer key that names another session (open or ended) than the path's is refused (403): a
        request reaches exactly one session, with that session's own key.
        """
        key = path_key if path_key is not None else bearer
        if key is None:
            raise APIError(
                404,
                "no capture session named: use the session's base URL (<endpoint>/sessions/<key>/v1) or send its "
                "API key as `Authorization: Bearer <key>`",
            )
        if path_key is not None and bearer is not None and bearer != path_key and self._known(bearer):
            raise APIError(
                403,
                "this request names two capture sessions, one in its URL and another by its API key; "
                "send the session's own key (or none) on its base URL",
            )
        session = self._sessions.get(key)
        if session is not None and not session.closed:
            return session
        ended = (session.id, session.rollout) if session is not None else self._ended.get(key)
        if ended is not None:
            raise _rollout_ended(ended)
        raise APIError(404, f"capture session `{key}` is unknown or closed")

    def _closed_answer(self, request: Request | None) -> Response:
        """What the closed endpoint's port answers every request (None: a malformed one) from its tombstone's thread.

        The ended session's 404 (``rollout_ended``, ``x-should-retry: false``), naming the rollout when
        the request names a session this endpoint served, in the error shape of the request's API.
        """
        if request is None:
            return _error_response(_rollout_ended(None))
        path_key, bearer, route = _split_path(request.path, request)
        key = path_key if path_key is not None else bearer
        ended = self._ended.get(key) if key is not None else None
        return _error_response(_rollout_ended(ended, endpoint_closed=True), _error_shape(route))

    def _known(self, key: str) -> bool:
        return key in self._sessions or key in self._ended

    async def _chat(self, session: CaptureSession, body: dict[str, Any]) -> Response:
        params = engine_sampling_params(body, session.sampling_params)
        call = await self._sample(session, session.capture.prepare(body), params)
        completion = chat_completion_body(
            call,
            completion_id=f"chatcmpl-{session.id}-{len(session.calls) - 1}",
            model=str(body.get("model") or self.model),
            created=int(time.time()),
            parse_tools=bool(body.get("tools")),
        )
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return Response.events((chat_completion_stream(completion, include_usage=usage),))
        return Response.json(200, completion)

    async def _responses(self, session: CaptureSession, body: dict[str, Any]) -> Response:
        """``POST /responses``: the request as the common conversation, the captured call as a ``response``."""
        request = _responses.chat_request(body, session.responses)
        params = _responses.sampling_params(request, session.sampling_params)
        call = await self._sample(session, session.capture.prepare(request.chat), params)
        response_id = f"resp_{session.id}_{len(session.calls) - 1}"
        response = _responses.response_body(
            call, request, response_id=response_id, model=str(body.get("model") or self.model), created=int(time.time())
        )
        session.responses[response_id] = _responses.remembered(request, response)
        if request.stream:
            return Response.events((_responses.response_stream(response),))
        return Response.json(200, response)

    async def _messages(self, session: CaptureSession, body: dict[str, Any], *, count_only: bool) -> Response:
        """Anthropic's ``/messages`` (or ``/messages/count_tokens``: the prompt's length, nothing sampled)."""
        request = _anthropic.messages_request(body)
        params = engine_sampling_params(request.chat, session.sampling_params)
        prepared = session.capture.prepare(request.chat)
        if count_only:
            return Response.json(200, {"input_tokens": len(prepared.prompt_ids)})
        call = await self._sample(session, prepared, params)
        message = _anthropic.message_body(
            call,
            request,
            message_id=f"msg_{session.id}_{len(session.calls) - 1}",
            model=str(body.get("model") or self.model),
            tokenizer=self.tokenizer,
        )
        if request.stream:
            return Response.events((_anthropic.message_stream(message),))
        return Response.json(200, message)

    async def _sample(self, session: CaptureSession, prepared: Prepared, params: dict[str, Any]) -> CallRecord:
        """Send a prepared call to the engine and record it: what every API's route answers from.

        Raises:
            APIError: 500 when the engine fails; 499 when the session closed while the call was in flight.
        """
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
                raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", final=True) from None
            finally:
                session._request_ended(scope)
            if not session.closed:  # else the reply raced the close: the rollout no longer takes it (499)
                return session.capture.record(prepared, sampled, logprobs, stop_reason, text)
        raise APIError(
            499,
            f"rollout {session.rollout} ended ({session.close_reason}) while this request was in flight; "
            "the engine request was cancelled",
        )


def _rollout_ended(ended: tuple[str, str] | None, *, endpoint_closed: bool = False) -> APIError:
    """The answer of an ended session (its ``(id, rollout)``; None: any of a closed endpoint's), which no client
    retries: 404, type ``rollout_ended``, ``x-should-retry: false`` (design rule 22)."""
    if ended is None:
        message = (
            "this capture endpoint has closed: the generate() call (or generator.serving() block) that served it "
            "has ended, and every rollout with it; stop the agent"
        )
    elif endpoint_closed:
        message = (
            f"capture session {ended[0]} is closed: its rollout {ended[1]} has ended, and so has the generate() "
            "call (or generator.serving() block) that served it; stop the agent"
        )
    else:
        message = f"capture session {ended[0]} is closed: its rollout {ended[1]} has ended; stop the agent"
    return APIError(404, message, kind="rollout_ended")


def _misplaced(route: str) -> bool:
    """An ``anthropic`` client given the chat base URL (it calls ``.../v1/v1/messages``)."""
    return route.startswith("/v1" + _anthropic.MESSAGES)


def _error_shape(route: str) -> Callable[[APIError], Any]:
    """The error shape of a route's API: Anthropic's on the Messages routes (a misplaced one too), else OpenAI's."""
    if route in (_anthropic.MESSAGES, _anthropic.COUNT_TOKENS) or _misplaced(route):
        return _anthropic.error_body
    return APIError.body


def _split_path(path: str, request: Request) -> tuple[str | None, str | None, str]:
    """``(key in the path, header key, route after /v1)`` of ``/sessions/<key>/v1/...`` or ``/v1/...``.

    The header key is ``Authorization: Bearer <key>``'s, else ``x-api-key``'s (Claude-Code-style clients).
    """
    auth = request.header("authorization") or ""
    bearer = auth[len("bearer ") :].strip() or None if auth.lower().startswith("bearer ") else None
    bearer = bearer or (request.header("x-api-key") or "").strip() or None
    parts = path.rstrip("/").split("/")
    if len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1":
        return parts[2], bearer, "/" + "/".join(parts[4:])
    if len(parts) >= 2 and parts[1] == "v1":
        return None, bearer, "/" + "/".join(parts[2:])
    return None, bearer, path


@asynccontextmanager
async def serve_capture(
    client: InferenceClient,
    tokenizer: Any,
    *,
    model: str = "skyrl-agent",
    chat_template_kwargs: dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    url: str | None = None,
    close_timeout_s: float = _CLEANUP_BOUND_S,
) -> AsyncIterator[CaptureServer]:
    """Serve a capture endpoint in front of ``client`` until the block exits.

    It listens on ``host``:``port`` (port 0: a free one) and gives agents ``url`` (``{port}`` in it
    becomes the port bound; None: ``http://host:port``) as the root of their base URLs: the
    ``generator.agent_endpoint_*`` knobs (:class:`~skyrl_structured.config.AgentEndpointSettings`).
    A failing ``accept`` (out of file descriptors) is retried, never raised. On exit, however the
    block ends (a caller's cancellation included), the requests being answered are answered (a closed
    session's 499) before their connections close, waiting at most ``close_timeout_s``.

    Raises:
        ImportError: h11 is missing (``pip install 'skyrl-structured[http]'``).
        ValueError: a bad setting (see :class:`~skyrl_structured.config.AgentEndpointSettings`).
    """
    from ..engines._optional import import_optional

    import_optional("h11", "http", needed_by="serve_capture")
    settings = AgentEndpointSettings(agent_endpoint_host=host, agent_endpoint_port=port, agent_endpoint_url=url)
    server = CaptureServer(client, tokenizer, model=model, chat_template_kwargs=chat_template_kwargs)
    what = "capture endpoint"
    async with serve(
        server._route,
        _error_answer,
        what=what,
        max_body=_MAX_BODY,
        host=host,
        port=port,
        close_timeout_s=close_timeout_s,
    ) as http:
        server.port = http.port
        server.url = _advertised_url(settings, server.port)
        if not host.startswith(_LOOPBACK):
            logger.info(
                "capture endpoint listening on %s port %d beyond loopback, given to agents as %s: each session's key "
                "is its only credential, sent in plain HTTP",
                host,
                server.port,
                server.url,
            )
        try:
            yield server
        finally:
            # Agent threads abandoned on the endpoint may call again: its port answers them until they return.
            # The tombstone duplicates the listening sockets before the server closes them.
            server.afterlife.bury(http.sockets, server._closed_answer, what=what)


def _advertised_url(settings: AgentEndpointSettings, port: int) -> str:
    """The endpoint's root URL as agents are given it: the configured one with ``{port}`` filled, or host:port."""
    if settings.agent_endpoint_url is not None:
        return settings.agent_endpoint_url.replace("{port}", str(port)).rstrip("/")
    host = settings.agent_endpoint_host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _engine_session_id(trajectory_id: TrajectoryID | None) -> str:
    """A capture session's id (public): 128 random bits, after ``"<instance_id>_<repetition_id>~"`` for a
    rollout with a trajectory id, so that routing over several servers
    (:func:`~skyrl_structured.engines.routing.session_group`) places the session with its prompt group."""
    token = secrets.token_hex(16)
    if trajectory_id is None:
        return token
    return f"{trajectory_id.instance_id}_{trajectory_id.repetition_id}~{token}"
