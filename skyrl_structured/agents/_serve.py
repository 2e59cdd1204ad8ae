"""``serve_capture``: one capture endpoint block, in the trainer's loop or on endpoint worker processes.

Apart from :mod:`._server` so that the worker process's code (which runs a :class:`~._server.CaptureServer`)
never imports back the pool that starts it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._http import serve
from ..config import AgentEndpointSettings
from ..types import InferenceClient
from ._pool_start import START_S, make_pool, worker_spec
from ._pooled import attached
from ._routes import _advertised_url
from ._server import _CLEANUP_BOUND_S, _LOOPBACK, _MAX_BODY, CaptureServer, _error_answer

if TYPE_CHECKING:
    from ._workers import CaptureWorkers

__all__ = ["serve_capture"]

logger = logging.getLogger(__name__)


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
    context_length: int | None = None,
    workers: int | CaptureWorkers = 0,
) -> AsyncIterator[CaptureServer]:
    """Serve a capture endpoint in front of ``client`` until the block exits.

    It listens on ``host``:``port`` (port 0: a free one) and gives agents ``url`` (``{port}`` in it
    becomes the port bound; None: ``http://host:port``) as the root of their base URLs: the
    ``generator.agent_endpoint_*`` knobs (:class:`~skyrl_structured.config.AgentEndpointSettings`).
    A failing ``accept`` (out of file descriptors) is retried, never raised. On exit, however the
    block ends (a caller's cancellation included), the requests being answered are answered (a closed
    session's 499) before their connections close, waiting at most ``close_timeout_s``.

    ``context_length`` is the served model's context (vLLM's ``max_model_len``) when the caller knows it:
    a prompt longer than it is answered in its API's own error (OpenAI's 400 ``context_length_exceeded``,
    Anthropic's 400 "prompt is too long: N tokens > M maximum") before any engine call. Without it the
    engine's own refusal of a too-long prompt is answered the same way.

    ``workers``: N > 0 serves the sessions from N endpoint worker processes started for the block, one port
    each (``url`` needs ``{port}``; a fixed ``port`` binds ``port..port+N-1``); a pool given is attached to.

    Raises:
        ImportError: h11 is missing (``pip install 'skyrl-structured[http]'``).
        ValueError: a bad setting (see :class:`~skyrl_structured.config.AgentEndpointSettings`).
    """
    from ..engines._optional import import_optional

    import_optional("h11", "http", needed_by="serve_capture")
    settings = AgentEndpointSettings(
        agent_endpoint_host=host,
        agent_endpoint_port=port,
        agent_endpoint_url=url,
        agent_endpoint_workers=workers if isinstance(workers, int) else workers.size,
    )
    if context_length is not None and (type(context_length) is not int or context_length < 1):
        raise ValueError(f"`context_length` must be a positive integer or None, got {context_length!r}")
    server = CaptureServer(
        client, tokenizer, model=model, chat_template_kwargs=chat_template_kwargs, context_length=context_length
    )
    if not isinstance(workers, int):
        async with attached(server, workers) as pooled:
            yield pooled
        return
    if workers:
        async with (
            _pool_for_block(server, workers, settings, close_timeout_s) as pool,
            attached(server, pool) as pooled,
        ):
            yield pooled
        return
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


@asynccontextmanager
async def _pool_for_block(
    server: CaptureServer, count: int, settings: AgentEndpointSettings, close_timeout_s: float
) -> AsyncIterator[CaptureWorkers]:
    """``count`` endpoint workers started for one ``serve_capture`` block, ready before it runs, stopped after it."""
    spec = worker_spec(server.tokenizer, server.model, server.chat_template_kwargs, server.context_length)
    pool = make_pool(count, settings, spec)
    pool.start()
    try:
        await anyio.to_thread.run_sync(pool.wait_ready, START_S)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(pool.shutdown)
        raise
    try:
        yield pool
    finally:
        # Agent threads abandoned on the endpoint may call again: its ports answer them until they return.
        server.afterlife.bury(pool.sockets, server._closed_answer, what="capture endpoint")
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(pool.shutdown, close_timeout_s or 1.0)
