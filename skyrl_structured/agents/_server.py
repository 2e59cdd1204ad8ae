"""The capture endpoint: an OpenAI-compatible HTTP server (127.0.0.1 by default), in the caller's event loop.

Routes, under a session's base URL ``http://HOST:PORT/sessions/<key>/v1`` (or under ``/v1`` with
``Authorization: Bearer <key>`` or ``x-api-key: <key>``), come from the registry of wire APIs
(:mod:`._wire`): ``POST /chat/completions`` and ``GET /models``, ``POST /responses``, ``POST /completions``,
and Anthropic's ``POST /messages`` and ``/messages/count_tokens`` (the ``anthropic`` client's
``base_url`` is the session's root, without ``/v1``). One handler answers them all: the request in its
API's shape -> the typed conversation (or a raw prompt) -> the capture's branches -> the engine -> the
reply, stream or error in its API's shape. A session has a
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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from .._episode.calls import engine_call
from .._http import Request, Response
from .._runtime.cleanup import run_cleanups
from .._runtime.contexts import BatchContext, RolloutContext
from .._runtime.pauses import use_clock
from .._runtime.sessions import SessionEnd
from ..config import ResilienceSettings
from ..observe import RolloutObserver, RolloutRef
from ..types import InferenceClient, InferenceEngineInput
from ._capture import CallRecord, CallTag, Capture, Prepared
from ._conversation import render
from ._routes import (
    ROUTE_LIST,
    _engine_session_id,
    _number,
    closed_in_flight,
    error_shape,
    json_body,
    misplaced,
    request_parts,
    rollout_ended,
    split_path,
)
from ._rows import call_tag
from ._session import CaptureSession
from ._tombstone import Afterlife
from ._wire import (
    ROUTES,
    APIError,
    ContextLengthError,
    Exchange,
    Route,
    WireAPI,
    context_refusal,
)

__all__ = ["CaptureServer", "CaptureSession"]

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


#: ``sampler(session, prepared, sampling, prompt_param) -> CallRecord``: one call sampled and recorded.
Sampler = Callable[[CaptureSession, Prepared, dict[str, Any], str], Awaitable[CallRecord]]


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
        context_length: int | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        #: The engine's context length when known: a longer prompt is refused before any engine call.
        self.context_length = context_length
        self.url = ""
        self.port = 0
        #: Open sessions by key, and ended ones' (id, rollout) by key.
        self._sessions: dict[str, CaptureSession] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: The agent calls abandoned on this endpoint, and its tombstone once closed (see :mod:`._tombstone`).
        self.afterlife = Afterlife()
        #: How a prepared call is sampled and recorded: the engine in this loop (an endpoint worker's samples
        #: through the trainer instead, :mod:`._worker`).
        self.sampler: Sampler = self._sample
        #: The endpoint worker processes serving this endpoint's sessions (None: served in this loop).
        self.pool: Any = None
        #: The calls of pooled sessions the trainer runs (see :mod:`._pooled`), set while attached.
        self.attachment: Any = None
        #: An endpoint worker's: no ``generate()`` or ``serving()`` holds its pool now (ended sessions' answers
        #: then say the endpoint has closed, as a tombstone's do).
        self.detached = False

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
        if self.pool is not None:  # sessions served by endpoint worker processes (agent_endpoint_workers)
            from ._pooled import pooled_session

            async with pooled_session(
                self, rollout, sampling_params=sampling_params, context=context, cleanup_timeout_s=cleanup_timeout_s
            ) as pooled:
                yield pooled
            return
        key = secrets.token_urlsafe(24)  # 192 bits, the credential
        context = self.rollout_context(context)
        session = self.open_session(key, str(context.ref.session_id), rollout, sampling_params, context=context)
        session.base_url = f"{self.url}/sessions/{key}/v1"
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
            self.end_session(key)
            if session.engine_requests:
                await run_cleanups([SessionEnd(context, session_id=session.id)], limit_s=cleanup_timeout_s, error=error)

    def rollout_context(self, context: RolloutContext | None) -> RolloutContext:
        """The rollout attempt a new session belongs to (a context of its own when None), its ref given a fresh
        engine session id."""
        if context is None:
            context = RolloutContext(
                BatchContext(generator=self, client=self.client, default_params={}), RolloutRef(0, 1, None)
            )
        context.ref = dataclasses.replace(context.ref, session_id=_engine_session_id(context.ref.trajectory_id))
        return context

    def open_session(
        self,
        key: str,
        session_id: str,
        rollout: str,
        sampling_params: dict[str, Any] | None,
        *,
        context: RolloutContext | None = None,
    ) -> CaptureSession:
        """A session this endpoint answers from now on, by ``key`` (an endpoint worker's, or :meth:`session`'s)."""
        if context is None:
            context = RolloutContext(
                BatchContext(generator=self, client=self.client, default_params={}), RolloutRef(0, 1, None)
            )
        session = CaptureSession(
            id=session_id,
            api_key=key,
            rollout=rollout,
            base_url="",
            capture=Capture(self.tokenizer, self.chat_template_kwargs),
            sampling_params=sampling_params,
            context=context,
            _afterlife=self.afterlife,
        )
        self._sessions[key] = session
        return session

    def end_session(self, key: str) -> None:
        """Forget a closed session but for the bounded record a late request hears which rollout ended from."""
        session = self._sessions.pop(key)
        self.remember_ended(key, session.id, session.rollout)

    def remember_ended(self, key: str, session_id: str, rollout: str) -> None:
        self._ended[key] = (session_id, rollout)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    # ------------------------------------------------------------------ the one handler

    async def _route(self, request: Request) -> Response:
        """Answer one request, whatever happens: an exception of this endpoint is a 500 naming the rollout."""
        session: CaptureSession | None = None
        shape: Callable[[APIError], Any] = APIError.body
        try:
            method, path, headers = request_parts(request)
            path_key, bearer, route_path = split_path(path, headers)
            shape = error_shape(route_path)
            if misplaced(route_path):
                raise APIError(
                    404,
                    f"no route `{path}`: an anthropic client's base_url is the session's root, without /v1 "
                    "(the chat base URL minus its /v1)",
                )
            found = ROUTES.get(route_path)
            if found is None:
                raise APIError(404, f"no route `{path}`; the endpoint serves {ROUTE_LIST} under a session's base URL")
            api, route = found
            if method != route.method:
                raise APIError(405, f"`{method} {path}`: use {route.method}")
            if route.action == "models":
                return Response.json(200, self._models())
            session = self._lookup(path_key, bearer)
            body = json_body(request.body)
            tag = call_tag(headers, body.get("model"), self.model)  # which conversation: for the row (issue 45)
            return await self._answer(session, api, route, body, tag)
        except APIError as error:
            return _error_response(error, shape)
        except Exception as exc:
            whose = f"rollout {session.rollout}" if session is not None else "no session"
            logger.exception("capture endpoint: answering a request of %s failed", whose)
            return _error_response(
                APIError(500, f"the capture endpoint failed on a request of {whose}: {type(exc).__name__}: {exc}"),
                shape,
            )

    async def _answer(
        self, session: CaptureSession, api: WireAPI, route: Route, body: dict[str, Any], tag: CallTag
    ) -> Response:
        """Parse the request in its API's shape, prepare it on the session's branches, sample, answer in its shape."""
        exchange = Exchange(
            session_id=session.id,
            index=len(session.calls),
            model=str(body.get("model") or self.model),
            created=int(time.time()),
            tokenizer=self.tokenizer,
            base_sampling=session.sampling_params,
            store=session.stores.setdefault(api.name, {}),
        )
        turn = api.parse(body, exchange)
        capture = session.capture
        turns = 1 + sum(message.role == "assistant" for message in turn.conversation.messages)
        if isinstance(turn.prompt, tuple):  # token ids (legacy completions): never re-tokenized
            prepared = capture.prepare_ids(turn.prompt, turns=turns, tag=tag)
        elif turn.prompt is not None:  # a raw text prompt: tokenized as it is, no template
            prepared = capture.prepare(turn.prompt, turns=turns, tag=tag)
        else:
            rendered = render(self.tokenizer, turn.conversation, capture.chat_template_kwargs)
            prepared = capture.prepare(rendered, turns=turns, tag=tag)
        if route.action == "count":
            assert api.count is not None  # a count route's API counts
            return Response.json(200, api.count(len(prepared.prompt_ids)))
        if self.context_length is not None and len(prepared.prompt_ids) > self.context_length:
            raise ContextLengthError(len(prepared.prompt_ids), self.context_length, turn.prompt_param)
        call = await self.sampler(session, prepared, dict(turn.conversation.sampling), turn.prompt_param)
        exchange.index = _number(session.calls, call)
        reply = api.reply(call, turn, exchange)
        if turn.stream:
            return Response.events((api.stream(reply, turn),))
        return Response.json(200, reply)

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
            raise rollout_ended(ended, endpoint_closed=self.detached)
        raise APIError(404, f"capture session `{key}` is unknown or closed")

    def _closed_answer(self, request: Request | None) -> Response:
        """What the closed endpoint's port answers every request (None: a malformed one) from its tombstone's thread.

        The ended session's 404 (``rollout_ended``, ``x-should-retry: false``), naming the rollout when
        the request names a session this endpoint served, in the error shape of the request's API.
        """
        if request is None:
            return _error_response(rollout_ended(None))
        _, path, headers = request_parts(request)
        path_key, bearer, route = split_path(path, headers)
        key = path_key if path_key is not None else bearer
        ended = self._ended.get(key) if key is not None else None
        return _error_response(rollout_ended(ended, endpoint_closed=True), error_shape(route))

    def _known(self, key: str) -> bool:
        return key in self._sessions or key in self._ended

    async def _sample(
        self, session: CaptureSession, prepared: Prepared, params: dict[str, Any], prompt_param: str
    ) -> CallRecord:
        """Send a prepared call to the engine and record it: what every API's route answers from (in-loop)."""
        text, sampled, stop_reason, logprobs = await self.engine_sample(
            session, prepared.prompt_ids, params, prompt_param
        )
        return session.capture.record(prepared, sampled, logprobs, stop_reason, text)

    async def engine_sample(
        self, session: CaptureSession, prompt_ids: list[int], params: dict[str, Any], prompt_param: str
    ) -> tuple[str, list[int], str, list[float] | None]:
        """One engine call of a session (seeded, on the rollout's pause clock, heard by its observers):
        ``(text, sampled ids, stop reason, logprobs)``, returned only while the session is open.

        Raises:
            ContextLengthError: the engine refused the prompt as longer than its context (400).
            APIError: 500 when the engine fails otherwise; 499 when the session closed while the call was in flight.
        """
        context = session.context
        turn = session.engine_requests
        request: InferenceEngineInput = {
            "prompt_token_ids": [prompt_ids],
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
                        context, turn, len(prompt_ids), lambda: context.client.generate(request)
                    )
            except Exception as exc:
                refusal = context_refusal(exc, len(prompt_ids), prompt_param)
                if refusal is not None:
                    raise refusal from None
                logger.warning("capture endpoint: the engine failed for rollout %s: %r", session.rollout, exc)
                raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", final=True) from None
            finally:
                session._request_ended(scope)
            if not session.closed:  # else the reply raced the close: the rollout no longer takes it (499)
                return text, sampled, stop_reason, logprobs
        raise closed_in_flight(session)
