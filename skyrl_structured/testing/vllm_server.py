"""A real HTTP server on 127.0.0.1 speaking vLLM's OpenAI-compatible completions protocol.

For tests of anything that talks to ``vllm serve`` (``HTTPEngine``, SkyRL's clients, your own),
without a GPU. Generation is delegated to any inference client (``TransformersEngine.tiny()``,
a :class:`~skyrl_structured.testing.ScriptedEngine`, ...)::

    async with serve_vllm(TransformersEngine.tiny(), model="tiny") as server:
        engine = HTTPEngine(server.url, model="tiny")

It runs in the caller's event loop (asyncio or trio) on the package's HTTP core (anyio and h11), answers
``POST /v1/completions`` (token-id or text prompts, ``return_token_ids``, ``logprobs``, the
sampling fields, ``stream``: server-sent events one token a chunk, as vLLM streams),
``GET /health`` and ``GET /v1/models``, and, for vision-language rollouts,
``POST /v1/chat/completions/render`` (an engine with ``render_chat_completion``, such as
:class:`~skyrl_structured.testing.ScriptedVLMEngine`), ``POST /inference/v1/generate`` (token ids
and image ``features`` in, token ids out) and ``POST /detokenize``; errors as vLLM shapes them
(``{"error": {"message", "type", "param", "code"}}``). Like vLLM, it aborts a generation whose
client disconnected. Every request is recorded in ``server.requests`` with its outcome, and an
``intercept`` hook can answer a request itself (an error status, a malformed body, a hang).

The protocol's field names and answer bodies (:mod:`._vllm_shapes`) are written independently of
the client in :mod:`skyrl_structured.engines.completions`, from vLLM's source, so that a test of one
against the other checks both against vLLM's field names.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._http import Request, Response, serve
from ._vllm_shapes import (
    completion_payload,
    generate_payload,
    is_token,
    json_or_raw,
    prompt_ids,
    render_payload,
    sampling_params,
    stream_chunks,
)

__all__ = ["RawResponse", "ServedRequest", "VLLMServer", "serve_vllm"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 * 1024 * 1024


@dataclass
class RawResponse:
    """An answer given verbatim (from an ``intercept`` hook)."""

    status: int
    #: Bytes, or (a streamed answer, sent chunked as produced) an async iterable of them.
    body: bytes | AsyncIterable[bytes] = b""
    content_type: str = "application/json"

    @classmethod
    def drop(cls) -> RawResponse:
        """No answer at all: the server closes the connection (a restart, a keep-alive it just closed)."""
        return cls(0)

    @classmethod
    def vllm_error(cls, status: int, message: str, err_type: str = "InternalServerError") -> RawResponse:
        """An error body shaped like vLLM's ``ErrorResponse``."""
        payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
        return cls(status, json.dumps(payload).encode())


@dataclass
class ServedRequest:
    """One request the server received, and what became of it.

    ``outcome`` is ``"pending"`` until it is decided, then ``"completed"`` (a 2xx answer was
    produced), ``"error"`` (a 4xx/5xx answer), ``"intercepted"`` (the hook answered) or
    ``"client_disconnected"`` (the client went away first; generation was cancelled) or
    ``"dropped"`` (the hook answered :meth:`RawResponse.drop`: the connection was closed unanswered).
    ``finished`` is set when the outcome is decided.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    outcome: str = "pending"
    status: int | None = None
    finished: anyio.Event = field(default_factory=anyio.Event)
    #: For a streamed completion (``"stream": true``): the token ids of the chunks sent so far.
    streamed_token_ids: list[int] = field(default_factory=list)

    def _decide(self, outcome: str, status: int | None = None) -> None:
        if self.outcome == "pending":
            self.outcome = outcome
            self.status = status
        self.finished.set()


Intercept = Callable[[ServedRequest], "RawResponse | Awaitable[RawResponse | None] | None"]
#: ``on_chunk(request, sent)``: called before each chunk of a streamed completion after the first, with the
#: number of tokens sent so far; it may wait (a slow generation) or block (a request cut mid-stream).
OnChunk = Callable[[ServedRequest, int], Awaitable[None]]


class VLLMServer:
    """The server's state: its URL, the requests it saw. Create it with :func:`serve_vllm`."""

    def __init__(
        self, engine: Any, *, model: str, tokenizer: Any, intercept: Intercept | None, on_chunk: OnChunk | None = None
    ) -> None:
        self.engine = engine
        self.on_chunk = on_chunk
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.intercept = intercept
        self.requests: list[ServedRequest] = []
        self.url = ""
        self.port = 0

    def completions(self) -> list[ServedRequest]:
        """The ``POST /v1/completions`` requests received so far."""
        return [r for r in self.requests if r.path == "/v1/completions"]

    # ------------------------------------------------------------------ HTTP (skyrl_structured._http)

    async def _respond(self, request: Request) -> Response | None:
        """Record the request and answer it; a client that disconnects first cancels the work (as vLLM does)."""
        record = ServedRequest(
            method=request.method, path=request.path, headers=request.header_map(), body=json_or_raw(request.body)
        )
        self.requests.append(record)
        answer: RawResponse | None = None
        try:
            answer = await self._answer(record)
        finally:
            if answer is None:  # cancelled by the client's disconnect (a dropped answer is decided already)
                record._decide("client_disconnected")
        return Response(answer.status, answer.body, answer.content_type) if answer is not None else None

    # ------------------------------------------------------------------ routes

    async def _answer(self, record: ServedRequest) -> RawResponse | None:
        if self.intercept is not None:
            try:
                hooked = self.intercept(record)
                if inspect.isawaitable(hooked):
                    hooked = await hooked
            except Exception as exc:
                hooked = RawResponse.vllm_error(500, f"intercept hook failed: {exc!r}")
            if hooked is not None and hooked.status == 0:
                record._decide("dropped")
                return None
            if hooked is not None:
                record._decide("intercepted", hooked.status)
                return hooked
        answer = await self._route(record)
        if isinstance(answer.body, bytes):  # a stream decides its outcome once it has ended
            record._decide("completed" if answer.status < 400 else "error", answer.status)
        return answer

    async def _route(self, record: ServedRequest) -> RawResponse:
        if record.path == "/health" and record.method == "GET":
            return RawResponse(200, b"", "text/plain")
        if record.path == "/v1/models" and record.method == "GET":
            card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm"}
            return RawResponse(200, json.dumps({"object": "list", "data": [card]}).encode())
        handlers = {
            "/v1/completions": self._completions,
            "/v1/chat/completions/render": self._render,
            "/inference/v1/generate": self._generate_tokens,
            "/detokenize": self._detokenize,
        }
        handler = handlers.get(record.path)
        if handler is None:
            return RawResponse(404, json.dumps({"detail": "Not Found"}).encode())
        if record.method != "POST":
            return RawResponse(405, json.dumps({"detail": "Method Not Allowed"}).encode())
        body = record.body
        if not isinstance(body, dict):
            return RawResponse.vllm_error(400, "the request body is not a JSON object", "BadRequestError")
        requested_model = body.get("model")
        if requested_model is not None and requested_model != self.model:
            return RawResponse.vllm_error(404, f"The model `{requested_model}` does not exist.", "NotFoundError")
        return await handler(record)

    async def _render(self, record: ServedRequest) -> RawResponse:
        """``/v1/chat/completions/render``: the engine's ``render_chat_completion``, as vLLM's render route answers."""
        render = getattr(self.engine, "render_chat_completion", None)
        if render is None:
            return RawResponse.vllm_error(400, "this server's engine cannot render chat requests", "BadRequestError")
        body = dict(record.body)
        if not isinstance(body.get("messages"), list):
            return RawResponse.vllm_error(400, "`messages` must be a list of chat messages", "BadRequestError")
        try:
            rendered = await render({"json": body})
        except ValueError as exc:
            return RawResponse.vllm_error(400, str(exc), "BadRequestError")
        return RawResponse(200, json.dumps(render_payload(rendered, self.model)).encode())

    async def _generate_tokens(self, record: ServedRequest) -> RawResponse:
        """``/inference/v1/generate``: token ids and the render's ``features`` in, token ids out (no text)."""
        body = record.body
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(map(is_token, ids)):
            return RawResponse.vllm_error(400, "`token_ids` must be a non-empty list of token ids", "BadRequestError")
        raw_params = body.get("sampling_params")
        if not isinstance(raw_params, dict):
            return RawResponse.vllm_error(400, "`sampling_params` must be an object", "BadRequestError")
        try:
            params = sampling_params(raw_params)
        except ValueError as exc:
            return RawResponse.vllm_error(400, str(exc), "BadRequestError")
        features = body.get("features")
        engine_input = {
            "prompt_token_ids": [list(ids)],
            "sampling_params": params,
            "session_ids": [record.headers.get("x-session-id")],
            "mm_features": [features] if features is not None else None,
            "cache_salt": body.get("cache_salt"),
        }
        try:
            output = await self.engine.generate(engine_input, model=body.get("model") or self.model)
        except ValueError as exc:
            return RawResponse.vllm_error(400, str(exc), "BadRequestError")
        except Exception as exc:
            logger.warning("test vLLM server: the engine failed: %r", exc)
            return RawResponse.vllm_error(500, f"{type(exc).__name__}: {exc}")
        return RawResponse(200, json.dumps(generate_payload(output, params)).encode())

    async def _detokenize(self, record: ServedRequest) -> RawResponse:
        tokens = record.body.get("tokens")
        if self.tokenizer is None or not isinstance(tokens, list) or not all(map(is_token, tokens)):
            return RawResponse.vllm_error(400, "`tokens` must be a list of token ids (the server needs a tokenizer)")
        return RawResponse(200, json.dumps({"prompt": str(self.tokenizer.decode(tokens))}).encode())

    async def _completions(self, record: ServedRequest) -> RawResponse:
        body = record.body
        requested_model = body.get("model")
        try:
            prompts = prompt_ids(body, self.tokenizer)
            params = sampling_params(body)
        except ValueError as exc:
            return RawResponse.vllm_error(400, str(exc), "BadRequestError")
        session = record.headers.get("x-session-id")
        engine_input = {
            "prompt_token_ids": prompts,
            "sampling_params": params,
            "session_ids": [session] * len(prompts),
            "cache_salt": body.get("cache_salt"),
        }
        try:
            output = await self.engine.generate(engine_input, model=requested_model or self.model)
        except ValueError as exc:
            return RawResponse.vllm_error(400, str(exc), "BadRequestError")
        except Exception as exc:
            logger.warning("test vLLM server: the engine failed: %r", exc)
            return RawResponse.vllm_error(500, f"{type(exc).__name__}: {exc}")
        try:
            payload = completion_payload(body, prompts, output, model=self.model, tokenizer=self.tokenizer)
        except Exception as exc:  # an engine answer of the wrong shape (lengths, keys): the engine's bug
            return RawResponse.vllm_error(500, f"the engine's output could not be served: {exc!r}")
        if body.get("stream"):
            return RawResponse(200, self._stream(record, payload), "text/event-stream")
        return RawResponse(200, json.dumps(payload).encode())

    async def _stream(self, record: ServedRequest, payload: dict[str, Any]) -> AsyncIterator[bytes]:
        """The answer as vLLM streams it, one token a chunk; a client that leaves cancels it (vLLM's abort)."""
        ended = False
        try:
            for k, (ids, chunk) in enumerate(stream_chunks(payload)):
                if k and self.on_chunk is not None:
                    await self.on_chunk(record, len(record.streamed_token_ids))
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                record.streamed_token_ids += ids  # written: the core asks for the next chunk once it is out
            yield b"data: [DONE]\n\n"
            ended = True
        finally:  # ended whole, or cut by the client's disconnect (the core cancels and closes this producer)
            record._decide("completed" if ended else "client_disconnected", 200 if ended else None)


@asynccontextmanager
async def serve_vllm(
    engine: Any,
    *,
    model: str = "test-model",
    tokenizer: Any = None,
    intercept: Intercept | None = None,
    on_chunk: OnChunk | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[VLLMServer]:
    """Serve ``engine`` over vLLM's completions protocol until the block exits.

    Args:
        engine: any inference client (``generate``/``finish_session``).
        model: the served model name; requests naming another get vLLM's 404.
        tokenizer: decodes token strings for ``logprobs.tokens`` and encodes text prompts;
            default: ``engine.tokenizer`` if it has one.
        intercept: called with each request first; a :class:`RawResponse` it returns (or awaits)
            is sent instead of the normal answer (:meth:`RawResponse.drop` closes the connection
            unanswered). It may also block (a hung server).
        on_chunk: awaited before each chunk of a streamed completion (``"stream": true``) after the
            first, with the request and the tokens sent so far (``request.streamed_token_ids``): to
            pace a stream or hold it mid-way.
        host, port: where to listen; port 0 picks a free one (see ``server.port``/``server.url``).

    Raises:
        ImportError: h11 is missing (it comes with ``pip install 'skyrl-structured[http]'``).
    """
    from ..engines._optional import import_optional

    import_optional("h11", "http", needed_by="serve_vllm")
    server = VLLMServer(engine, model=model, tokenizer=tokenizer, intercept=intercept, on_chunk=on_chunk)
    # Closing cancels what is in flight at once (close_timeout_s=0): a test's hung intercept never holds it up.
    async with serve(server._respond, what="test vLLM server", max_body=_MAX_BODY, host=host, port=port) as http:
        server.port = http.port
        server.url = f"http://{host}:{server.port}"
        yield server
