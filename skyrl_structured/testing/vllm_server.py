"""A real HTTP server on 127.0.0.1 speaking vLLM's OpenAI-compatible completions protocol.

For tests of anything that talks to ``vllm serve`` (``HTTPEngine``, SkyRL's clients, your own),
without a GPU. Generation is delegated to any inference client (``TransformersEngine.tiny()``,
a :class:`~skyrl_structured.testing.ScriptedEngine`, ...)::

    async with serve_vllm(TransformersEngine.tiny(), model="tiny") as server:
        engine = HTTPEngine(server.url, model="tiny")

It runs in the caller's event loop (asyncio or trio) on anyio and h11, answers
``POST /v1/completions`` (token-id or text prompts, ``return_token_ids``, ``logprobs``, the
sampling fields), ``GET /health`` and ``GET /v1/models``, and, for vision-language rollouts,
``POST /v1/chat/completions/render`` (an engine with ``render_chat_completion``, such as
:class:`~skyrl_structured.testing.ScriptedVLMEngine`), ``POST /inference/v1/generate`` (token ids
and image ``features`` in, token ids out) and ``POST /detokenize``; errors as vLLM shapes them
(``{"error": {"message", "type", "param", "code"}}``). Like vLLM, it aborts a generation whose
client disconnected. Every request is recorded in ``server.requests`` with its outcome, and an
``intercept`` hook can answer a request itself (an error status, a malformed body, a hang).

The protocol handling here is written independently of the client in
:mod:`skyrl_structured.engines.completions`, from vLLM's source, so that a test of one against
the other checks both against vLLM's field names.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

__all__ = ["RawResponse", "ServedRequest", "VLLMServer", "serve_vllm"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 * 1024 * 1024


@dataclass
class RawResponse:
    """An answer given verbatim (from an ``intercept`` hook)."""

    status: int
    body: bytes = b""
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

    def _decide(self, outcome: str, status: int | None = None) -> None:
        if self.outcome == "pending":
            self.outcome = outcome
            self.status = status
        self.finished.set()


Intercept = Callable[[ServedRequest], "RawResponse | Awaitable[RawResponse | None] | None"]


class VLLMServer:
    """The server's state: its URL, the requests it saw. Create it with :func:`serve_vllm`."""

    def __init__(self, engine: Any, *, model: str, tokenizer: Any, intercept: Intercept | None) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.intercept = intercept
        self.requests: list[ServedRequest] = []
        self.url = ""
        self.port = 0

    def completions(self) -> list[ServedRequest]:
        """The ``POST /v1/completions`` requests received so far."""
        return [r for r in self.requests if r.path == "/v1/completions"]

    # ------------------------------------------------------------------ HTTP plumbing

    async def _handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        try:
            await self._serve_connection(stream)
        except Exception:  # one bad connection must not take the server down
            logger.exception("test vLLM server: connection handler failed")

    async def _serve_connection(self, stream: anyio.abc.ByteStream) -> None:
        import h11

        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                try:
                    incoming = await self._read_request(conn, stream)
                except h11.RemoteProtocolError:
                    return
                if incoming is None:
                    return
                request, raw_body = incoming
                answer = await self._answer_watching(conn, stream, request, raw_body)
                if answer is None:
                    return
                try:
                    await self._send(conn, stream, answer)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, h11.LocalProtocolError):
                    return
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return

    @staticmethod
    async def _receive(conn: Any, stream: anyio.abc.ByteStream) -> None:
        try:
            data = await stream.receive(65536)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            data = b""
        conn.receive_data(data)

    async def _read_request(self, conn: Any, stream: anyio.abc.ByteStream) -> tuple[Any, bytes] | None:
        import h11

        request = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                await self._receive(conn, stream)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_BODY:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    async def _answer_watching(
        self, conn: Any, stream: anyio.abc.ByteStream, request: Any, raw_body: bytes
    ) -> RawResponse | None:
        """Answer the request while watching the connection: a disconnect cancels the work (as vLLM does)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        record = ServedRequest(
            method=request.method.decode(),
            path=request.target.decode().split("?", 1)[0],
            headers=headers,
            body=_json_or_raw(raw_body),
        )
        self.requests.append(record)
        answer: RawResponse | None = None

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            try:
                data = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                data = b""
            if not data:
                record._decide("client_disconnected")
                scope.cancel()
                return
            conn.receive_data(data)  # a pipelined next request: keep it for the next cycle

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch_disconnect, group.cancel_scope)
                answer = await self._answer(record)
                group.cancel_scope.cancel()
        finally:
            if answer is None:
                record._decide("client_disconnected")
        return answer

    @staticmethod
    async def _send(conn: Any, stream: anyio.abc.ByteStream, answer: RawResponse) -> None:
        import h11

        headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
        for event in (h11.Response(status_code=answer.status, headers=headers), h11.Data(data=answer.body)):
            await stream.send(conn.send(event))
        await stream.send(conn.send(h11.EndOfMessage()))

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
        payload = {
            "request_id": f"render-{uuid.uuid4().hex}",
            "model": self.model,
            "token_ids": list(rendered["token_ids"]),
            "features": rendered.get("features"),
            "sampling_params": {},
            "stream": False,
        }
        return RawResponse(200, json.dumps(payload).encode())

    async def _generate_tokens(self, record: ServedRequest) -> RawResponse:
        """``/inference/v1/generate``: token ids and the render's ``features`` in, token ids out (no text)."""
        body = record.body
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(map(_is_token, ids)):
            return RawResponse.vllm_error(400, "`token_ids` must be a non-empty list of token ids", "BadRequestError")
        raw_params = body.get("sampling_params")
        if not isinstance(raw_params, dict):
            return RawResponse.vllm_error(400, "`sampling_params` must be an object", "BadRequestError")
        try:
            params = _sampling_params(raw_params)
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
        out_ids = list(output["response_ids"][0])
        logprobs = None
        if params["logprobs"] is not None:
            values = output["response_logprobs"][0]
            logprobs = {
                "content": [
                    {"token_id": t, "logprob": max(float(v), -9999.0)} for t, v in zip(out_ids, values, strict=True)
                ]
            }
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": output["stop_reasons"][0], "token_ids": out_ids}
        payload = {"request_id": f"gen-{uuid.uuid4().hex}", "choices": [choice], "prompt_logprobs": None}
        return RawResponse(200, json.dumps(payload).encode())

    async def _detokenize(self, record: ServedRequest) -> RawResponse:
        tokens = record.body.get("tokens")
        if self.tokenizer is None or not isinstance(tokens, list) or not all(map(_is_token, tokens)):
            return RawResponse.vllm_error(400, "`tokens` must be a list of token ids (the server needs a tokenizer)")
        return RawResponse(200, json.dumps({"prompt": str(self.tokenizer.decode(tokens))}).encode())

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(p, list) and p and all(map(_is_token, p)) for p in prompt)
        ):
            return [list(p) for p in prompt]
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; start the server with tokenizer=...")
            return [list(self.tokenizer.encode(prompt))]
        raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")

    async def _completions(self, record: ServedRequest) -> RawResponse:
        body = record.body
        requested_model = body.get("model")
        if body.get("stream"):
            return RawResponse.vllm_error(400, "this test server does not stream", "BadRequestError")
        try:
            prompts = self._prompts(body)
            params = _sampling_params(body)
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
            payload = self._completion_payload(body, prompts, output)
        except Exception as exc:  # an engine answer of the wrong shape (lengths, keys): the engine's bug
            return RawResponse.vllm_error(500, f"the engine's output could not be served: {exc!r}")
        return RawResponse(200, json.dumps(payload).encode())

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def _completion_payload(self, body: dict[str, Any], prompts: list[list[int]], output: Any) -> dict[str, Any]:
        with_ids = bool(body.get("return_token_ids"))
        want_logprobs = body.get("logprobs") is not None
        choices = []
        completion_tokens = 0
        for i, prompt in enumerate(prompts):
            ids = list(output["response_ids"][i])
            logprobs = None
            if want_logprobs:
                values = [max(float(v), -9999.0) for v in output["response_logprobs"][i]]
                tokens = [self._token_text(t) for t in ids]
                offsets, position = [], 0
                for token in tokens:
                    offsets.append(position)
                    position += len(token)
                logprobs = {
                    "text_offset": offsets,
                    "token_logprobs": values,
                    "tokens": tokens,
                    "top_logprobs": [{tok: val} for tok, val in zip(tokens, values, strict=True)],
                }
            choices.append(
                {
                    "index": i,
                    "text": output["responses"][i],
                    "logprobs": logprobs,
                    "finish_reason": output["stop_reasons"][i],
                    "stop_reason": None,
                    "token_ids": ids if with_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if with_ids else None,
                }
            )
            completion_tokens += len(ids)
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_or_raw(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's request fields to an engine's sampling dict, with vLLM's own defaults for absent fields."""
    if body.get("n", 1) != 1:
        raise ValueError("this test server supports n=1 only")
    stop = body.get("stop")
    params: dict[str, Any] = {
        "max_tokens": body.get("max_tokens") if body.get("max_tokens") is not None else 16,
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "top_k": body.get("top_k") if body.get("top_k") is not None else 0,
        "min_p": body.get("min_p") if body.get("min_p") is not None else 0.0,
        "repetition_penalty": body.get("repetition_penalty") if body.get("repetition_penalty") is not None else 1.0,
        "seed": body.get("seed"),
        "stop": [stop] if isinstance(stop, str) else (stop or None),
        "stop_token_ids": body.get("stop_token_ids") or None,
        "logprobs": body.get("logprobs"),
        "min_tokens": body.get("min_tokens", 0),
        "include_stop_str_in_output": bool(body.get("include_stop_str_in_output", False)),
        "skip_special_tokens": bool(body.get("skip_special_tokens", True)),
    }
    return params


@asynccontextmanager
async def serve_vllm(
    engine: Any,
    *,
    model: str = "test-model",
    tokenizer: Any = None,
    intercept: Intercept | None = None,
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
        host, port: where to listen; port 0 picks a free one (see ``server.port``/``server.url``).

    Raises:
        ImportError: h11 is missing (it comes with ``pip install 'skyrl-structured[http]'``).
    """
    from ..engines._optional import import_optional

    import_optional("h11", "http", needed_by="serve_vllm")
    server = VLLMServer(engine, model=model, tokenizer=tokenizer, intercept=intercept)
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    server.port = int(listener.extra(SocketAttribute.local_port))
    server.url = f"http://{host}:{server.port}"
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, server._handle_connection, group)
            try:
                yield server
            finally:
                group.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
