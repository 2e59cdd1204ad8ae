"""``HTTPEngine``: one or more vLLM OpenAI-compatible servers (``vllm serve``) over HTTP.

Token-in-token-out through ``POST /v1/completions`` (the wire format is in
:mod:`skyrl_structured.engines.completions`). httpx runs on asyncio and on trio, so no bridge is
needed. Each prompt is its own request; a session (a rollout's turns) sticks to one server for
its prefix cache and is released by ``finish_session``. A server that cannot be reached (refused
or dropped connection, connect timeout) is skipped in favour of the next one; a server that
answers with an error status or an unusable body, or takes longer than ``timeout_s``, fails the
request with an :class:`~skyrl_structured.engines.EngineError` naming it. A completion request
has no side effects on the server, so retrying it elsewhere is safe.

Vision-language rollouts (:class:`~skyrl_structured.StructuredVLMGymGenerator`) also use
:meth:`HTTPEngine.render_chat_completion` (``POST /v1/chat/completions/render``), and a prompt that
carries image ``mm_features`` is generated through ``POST /inference/v1/generate``, the endpoint
that takes them (wire format in :mod:`skyrl_structured.engines.render`).

Cancelling the caller closes the request's connection; vLLM aborts a request whose client
disconnected.

:meth:`HTTPEngine.check_ready` asks every server, before any work, whether it is up
(``GET /health``) and serves the model (``GET /v1/models``), so a wrong URL or model name is one
clear error instead of a failure per request.

:meth:`HTTPEngine.engine_load` (the :class:`~skyrl_structured.engines.load.ReportsLoad` signal)
reads each server's ``GET /metrics`` at most once per ``load_interval_s``, on a connection pool of
its own, so that reading load never takes a connection a completion request is waiting for.

Where a new session goes is the ``routing`` policy's (:mod:`skyrl_structured.engines.routing`):
``group_least_loaded`` (the default) keeps a prompt group's sessions on one server and places new
groups on the least-loaded server, read from the same ``/metrics`` (with more than one server, a new
session's first request renews a reading older than ``load_interval_s``, waiting up to 0.5 s for it,
unless a read is in flight and there was one before: then it uses the last reading); ``round_robin``
takes the servers in turn. :meth:`HTTPEngine.routes` tells each server's sessions and load.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Self

import anyio
from anyio.lowlevel import RunVar

from .._runtime.pauses import PausableDeadline, current_clock
from ..types import InferenceEngineInput, InferenceEngineOutput, Tokenizer
from ._gather import gather_in_order
from ._load_reader import LoadReader
from ._optional import import_optional
from ._prompts import request_prompt_ids
from ._resource import AsyncResource
from ._status import ServerStatus, normalise_url, status_at
from ._streamed import StreamedCompletion, complete_streamed, read_stream
from .completions import Completion, completion_request, error_message, parse_completion, session_header
from .errors import EngineConnectionError, EngineHTTPError, EngineTimeoutError
from .load import EngineLoad
from .partial import partial_wanted
from .render import (
    DETOKENIZE_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    generate_request,
    parse_detokenized,
    parse_generated,
    parse_render,
)
from .routing import Router, RoutingPolicy, ServerRoute, check_routing, make_router, session_group
from .sampling import SamplingSpec, default_spec, resolve_sampling

__all__ = ["HTTPEngine", "ServerStatus"]

logger = logging.getLogger(__name__)

#: The longest a new session's first request waits for a reading of the servers' load to place it.
_PLACEMENT_READ_S = 0.5

#: Idle connections are closed after this long: under the servers' keep-alive (vLLM: 5 s).
_KEEPALIVE_EXPIRY_S = 3.0


class HTTPEngine(AsyncResource):
    """An inference client for vLLM servers.

    Args:
        base_urls: one server (``"http://host:8000"``) or several; a trailing ``/v1`` is accepted.
        model: the served model name (``vllm serve ... --served-model-name``); a ``model`` passed
            to :meth:`generate` (SkyRL passes its policy or LoRA adapter name) takes precedence.
        tokenizer: the served model's tokenizer; only needed for requests that carry chat
            ``prompts`` instead of ``prompt_token_ids``, and exposed as ``engine.tokenizer``.
        timeout_s: how long to wait for a server's answer to a completion request (it bounds the
            generation time); the clock stops while the generator whose rollout sent it is paused
            (``generator.pause()``, SkyRL's weight sync).
        connect_timeout_s: how long to wait for a connection before failing over.
        default_sampling_params: used when a request's ``sampling_params`` is None (see
            :mod:`skyrl_structured.engines.sampling`).
        max_connections: open connections across all servers; more requests wait for a free one.
        api_key: sent as ``Authorization: Bearer`` (``vllm serve --api-key``).
        headers: extra HTTP headers on every request.
        failover_cooldown_s: how long an unreachable server is tried last.
        load_interval_s: the least time between two reads of the servers' ``/metrics`` by
            :meth:`engine_load` (0: every call reads, concurrent calls still share one read).
        routing: where a new session goes: ``"group_least_loaded"`` (a prompt group's sessions
            together, new groups on the least-loaded server) or ``"round_robin"``; see
            :mod:`skyrl_structured.engines.routing`.
        session_group: the prompt group of a session id (None: it names none); default
            :func:`~skyrl_structured.engines.routing.session_group`, which reads the generator's
            ``"<instance_id>_<repetition_id>"``. A session that names none is grouped by its first prompt.

    Raises:
        ImportError: httpx is not installed (``pip install 'skyrl-structured[http]'``).
        ValueError: no URL, a URL that is not http(s), bad default sampling params, a
            negative ``load_interval_s``, or an unknown ``routing``.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        tokenizer: Tokenizer | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        default_sampling_params: Mapping[str, Any] | None = None,
        max_connections: int = 256,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        failover_cooldown_s: float = 30.0,
        load_interval_s: float = 1.0,
        routing: RoutingPolicy = "group_least_loaded",
        session_group: Callable[[Hashable | None], Hashable | None] = session_group,
    ) -> None:
        policy = check_routing(routing)
        self._httpx = import_optional("httpx", "http", needed_by="HTTPEngine")
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("base_urls is empty; give at least one vLLM server URL such as 'http://localhost:8000'")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(
                f"timeout_s and connect_timeout_s must be > 0, got timeout_s={timeout_s}, "
                f"connect_timeout_s={connect_timeout_s}"
            )
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.base_urls: tuple[str, ...] = tuple(normalise_url(u) for u in urls)
        self.model = model
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.default_sampling: SamplingSpec = default_spec(default_sampling_params)
        self.routing: RoutingPolicy = policy
        self.router: Router = make_router(policy, self.base_urls, cooldown_s=failover_cooldown_s)
        self._session_group = session_group
        self._observed_reads = 0
        self._headers = dict(headers or {})
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # httpx clients belong to the event loop that created them: one per loop.
        self._client: RunVar[Any] = RunVar(f"skyrl_structured_http_client_{id(self)}")
        self._metrics_client: RunVar[Any] = RunVar(f"skyrl_structured_http_metrics_client_{id(self)}")
        self._load = LoadReader(self.base_urls, self._fetch_metrics, min_interval_s=load_interval_s, what="HTTPEngine")

    # ------------------------------------------------------------------ lifecycle

    def _get_client(self) -> Any:
        client = self._client.get(None)
        if client is None:
            httpx = self._httpx
            client = httpx.AsyncClient(
                # The answer's wait (timeout_s) is a pausable deadline around each request (see
                # _complete), not httpx's read timeout, so a weight-sync pause does not count.
                timeout=httpx.Timeout(None, connect=self.connect_timeout_s, pool=None),
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=self.max_connections,
                    # Below vLLM's (uvicorn's) 5 s keep-alive, so we rarely reuse a connection it is closing.
                    keepalive_expiry=_KEEPALIVE_EXPIRY_S,
                ),
                headers=self._headers,
            )
            self._client.set(client)
        return client

    async def __aenter__(self) -> Self:
        self._get_client()
        return self

    async def aclose(self) -> None:
        """Close this event loop's connection pools (a later call opens new ones)."""
        for pool in (self._metrics_client, self._client):
            client = pool.get(None)
            if client is not None:
                pool.set(None)
                await client.aclose()

    async def finish_session(self, session_id: Hashable) -> None:
        """Release the session's server binding."""
        self.router.release(session_id)

    # ------------------------------------------------------------------ readiness

    async def server_status(self) -> list[ServerStatus]:
        """Ask every server, concurrently, whether it is up and serves ``model``; one status per URL, in order.

        ``GET /health`` must answer 2xx (a server without that route, 404, is judged by the next
        check alone) and ``GET /v1/models`` must list ``model``. Each request waits at most
        ``connect_timeout_s``. Server problems are reported in the statuses, never raised.
        """
        client = self._get_client()
        return await gather_in_order(
            [
                functools.partial(status_at, self._httpx, client, url, self.model, self.connect_timeout_s)
                for url in self.base_urls
            ]
        )

    async def check_ready(self) -> None:
        """Fail fast when a server is down or does not serve ``model``, before any request is sent.

        Raises:
            EngineConnectionError: some server is not ready; ``failures`` maps each such URL to one
                line naming what is wrong and the fix.
        """
        failures = {s.url: s.describe(self.model) for s in await self.server_status() if not s.ready}
        if failures:
            raise EngineConnectionError("; ".join(failures.values()), failures=failures)

    # ------------------------------------------------------------------ load

    async def engine_load(self) -> list[EngineLoad]:
        """Each server's load from its ``GET /metrics``, in ``base_urls`` order (the ``ReportsLoad`` signal).

        Answers from the last reading while it is younger than ``load_interval_s``; otherwise reads
        every server (concurrent callers share that read), each waiting at most
        ``connect_timeout_s``. A server that cannot be read is left out and logged once; this
        never raises. A counter that goes down (the server restarted) continues from the last
        value reported, so differences between readings are never negative. The KV capacity
        (``kv_capacity_tokens``) is read from the labels of vLLM's ``vllm:cache_config_info``.
        """
        loads = await self._load.latest()
        if self._load.reads_finished != self._observed_reads:  # a new reading: the router learns it
            self._observed_reads = self._load.reads_finished
            self.router.observe(loads)
        return loads

    def routes(self) -> list[ServerRoute]:
        """Each server's sessions, prompt groups and load as routing sees them now, in ``base_urls`` order.

        Cheap and synchronous; safe to call from another thread (a metrics scrape).
        """
        return self.router.routes()

    def _placement_reads(self) -> bool:
        """Whether placing a new session reads the servers' load first: with ``group_least_loaded`` over
        several servers, when the last reading is stale and no read is in flight (a placement meanwhile
        uses the last reading, with the sessions placed since counted, rather than wait for that read),
        or when there is no reading yet."""
        if self.routing != "group_least_loaded" or len(self.base_urls) < 2:
            return False
        if self._load.reads_finished == 0:
            return True
        return not self._load.fresh() and not self._load.reading

    def _group(self, session_id: Hashable | None, prompt_ids: Sequence[int] | None) -> Hashable | None:
        """The prompt group of a request: the session's, else its prompt's (None: neither)."""
        group = self._session_group(session_id)
        if group is not None:
            return ("group", group)
        if prompt_ids is not None:
            return ("prompt", hash(tuple(prompt_ids)))
        return None

    async def _fetch_metrics(self, url: str) -> str:
        client = self._metrics_client.get(None)
        if client is None:
            httpx = self._httpx
            # One connection per server, apart from the completions' pool: a read of load never
            # waits behind (or holds up) a completion request.
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.connect_timeout_s),
                limits=httpx.Limits(max_connections=len(self.base_urls), keepalive_expiry=_KEEPALIVE_EXPIRY_S),
                headers=self._headers,
            )
            self._metrics_client.set(client)
        response = await client.get(f"{url}/metrics")
        if not 200 <= response.status_code < 300:
            raise ValueError(f"GET /metrics answered HTTP {response.status_code}: {error_message(response.content)}")
        return str(response.text)

    # ------------------------------------------------------------------ generation

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """One completion per prompt, requested concurrently.

        Raises:
            EngineConnectionError: no server could be reached.
            EngineTimeoutError: a server did not answer within ``timeout_s``.
            EngineHTTPError: a server answered with a non-2xx status.
            EngineResponseError: a server's answer lacks what the generator needs.
            ValueError: bad sampling parameters (named).
        """
        spec = resolve_sampling(input_batch.get("sampling_params"), self.default_sampling)
        prompts = request_prompt_ids(input_batch, self.tokenizer, engine="HTTPEngine")
        session_ids = input_batch.get("session_ids") or [None] * len(prompts)
        if len(session_ids) != len(prompts):
            raise ValueError(f"input_batch has {len(prompts)} prompts but {len(session_ids)} session_ids")
        served = model or self.model
        cache_salt = input_batch.get("cache_salt")

        features = input_batch.get("mm_features") or [None] * len(prompts)
        if len(features) != len(prompts):
            raise ValueError(f"input_batch has {len(prompts)} prompts but {len(features)} mm_features")

        def call(i: int) -> Any:
            if features[i] is not None:
                # Image features travel with token ids only on vLLM's token-in generate endpoint.
                return lambda: self._generate_with_features(
                    prompts[i], features[i], spec, session_ids[i], served, cache_salt
                )
            return lambda: self._complete(prompts[i], spec, session_ids[i], served, cache_salt, streamed)

        # A caller that keeps partial replies (one prompt: engines/partial.py) gets a streamed request.
        streamed = len(prompts) == 1 and partial_wanted()
        results = await gather_in_order([call(i) for i in range(len(prompts))])
        return {
            "responses": [r.text for r in results],
            "response_ids": [r.token_ids for r in results],
            "stop_reasons": [r.stop_reason for r in results],
            "response_logprobs": [r.logprobs or [] for r in results] if spec.logprobs is not None else None,
        }

    async def _complete(
        self,
        prompt_ids: list[int],
        spec: SamplingSpec,
        session_id: Hashable | None,
        model: str,
        cache_salt: str | None,
        streamed: bool = False,
    ) -> Completion:
        body = completion_request(prompt_ids, spec, model=model, cache_salt=cache_salt)
        tokenizer = self.tokenizer
        decode = None if tokenizer is None else functools.partial(_decode, tokenizer, spec.skip_special_tokens)
        if streamed:  # read as it arrives, so that a cut hands back the tokens so far (engines/partial.py)

            async def post(stream_body: dict[str, Any], reply: StreamedCompletion) -> None:
                await self._post("/v1/completions", stream_body, session_id, prompt_ids, stream_into=reply)

            return await complete_streamed(post, body, want_logprobs=spec.logprobs is not None, decode=decode)
        url, raw = await self._post("/v1/completions", body, session_id, prompt_ids)
        return parse_completion(raw, url=url, want_logprobs=spec.logprobs is not None)

    async def _post(
        self,
        path: str,
        body: Any,
        session_id: Hashable | None,
        prompt_ids: Sequence[int] | None = None,
        *,
        stream_into: StreamedCompletion | None = None,
    ) -> tuple[str, bytes]:
        """POST ``body`` to ``path`` on the session's server, failing over past unreachable ones.

        A new session is placed by the router first (``prompt_ids`` group it when its id names no
        group); ``group_least_loaded`` renews a stale reading of the servers' load for that.

        With ``stream_into``, the answer is a streamed completion read into it as it arrives (body: b"").

        Returns:
            The server's base URL and the 2xx answer's body.

        Raises:
            EngineConnectionError: no server could be reached.
            EngineTimeoutError: the server did not answer within ``timeout_s``.
            EngineHTTPError: the server answered with a non-2xx status.
        """
        httpx = self._httpx
        client = self._get_client()
        headers = session_header(session_id)
        unreachable: dict[str, str] = {}
        group = None
        if not self.router.is_placed(session_id):
            group = self._group(session_id, prompt_ids)
            if self._placement_reads():
                # Renew a stale reading (never raises), waiting a bounded time: a server whose /metrics
                # hangs must not hold up the completion.
                with anyio.move_on_after(_PLACEMENT_READ_S):
                    await self.engine_load()
        for url in self.router.candidates(session_id, group):
            try:
                # timeout_s stops while the generator running this rollout is paused (a weight sync).
                with PausableDeadline(current_clock(), self.timeout_s) as deadline:
                    if stream_into is None:
                        response = await self._post_once_more_if_dropped(client, f"{url}{path}", body, headers)
                    else:
                        stream_into.restart(url)
                        response = await read_stream(client, f"{url}{path}", body, headers, stream_into)
                if deadline.cancelled_caught:
                    raise EngineTimeoutError(
                        f"{url}{path} did not answer within timeout_s={self.timeout_s:g}s; raise "
                        "HTTPEngine(timeout_s=...) for long generations",
                        url=url,
                    )
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
                httpx.WriteError,
            ) as exc:
                # Never reached the server, or it dropped the connection without answering, twice.
                unreachable[url] = f"{type(exc).__name__}: {exc}"
                self.router.failed(url)
                logger.warning("vLLM server %s unreachable (%s); trying the next one", url, unreachable[url])
                continue
            except httpx.TimeoutException as exc:
                raise EngineTimeoutError(
                    f"{url}{path} did not answer within timeout_s={self.timeout_s:g}s "
                    f"({type(exc).__name__}); raise HTTPEngine(timeout_s=...) for long generations",
                    url=url,
                ) from exc
            except httpx.HTTPError as exc:  # anything else httpx raises (a bad URL, a proxy error, ...)
                why = f"{type(exc).__name__}: {exc}"
                raise EngineConnectionError(f"the request to {url} failed: {why}", failures={url: why}) from exc
            self.router.succeeded(session_id, url, group)
            if not 200 <= response.status_code < 300:
                raise EngineHTTPError(url, response.status_code, error_message(response.content))
            return url, bytes(response.content) if stream_into is None else b""
        raise EngineConnectionError(
            "no vLLM server could be reached: " + "; ".join(f"{u}: {why}" for u, why in unreachable.items()),
            failures=unreachable,
        )

    async def _post_once_more_if_dropped(self, client: Any, target: str, body: Any, headers: Any) -> Any:
        """POST, sent again once if the server dropped the connection unanswered.

        A kept-alive connection the server closed just as it was reused fails this way without the
        server being down (both sides expire idle connections after about 5 s by default), so one
        more try on the same server comes before failing over; a refused connection does not.
        """
        httpx = self._httpx
        try:
            return await client.post(target, json=body, headers=headers)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            logger.debug("vLLM server dropped the connection to %s (%s); sending again", target, why)
        return await client.post(target, json=body, headers=headers)

    # ------------------------------------------------------------------ vision-language rollouts

    @property
    def model_name(self) -> str:
        """The served model name (SkyRL's VLM generator puts it in each render request)."""
        return self.model

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's ``POST /v1/chat/completions/render`` for ``request_payload["json"]`` (SkyRL's payload shape).

        ``model`` defaults to :attr:`model`; a ``session_id`` in the body is sent as the routing header
        instead, as SkyRL's client does. Returns the server's answer: ``token_ids`` and ``features``.

        Raises:
            EngineError: as :meth:`generate` (unreachable, timeout, HTTP status, unusable answer).
        """
        body = dict(request_payload.get("json") or {})
        session_id = body.pop("session_id", None)
        if body.get("model") is None:
            body["model"] = self.model
        url, raw = await self._post(RENDER_PATH, body, session_id)
        return parse_render(raw, url=url)

    async def _generate_with_features(
        self,
        prompt_ids: list[int],
        features: Mapping[str, Any] | None,
        spec: SamplingSpec,
        session_id: Hashable | None,
        model: str,
        cache_salt: str | None,
    ) -> Completion:
        """One rendered prompt with its image features through ``POST /inference/v1/generate``."""
        body = generate_request(prompt_ids, features, spec, model=model, cache_salt=cache_salt)
        url, raw = await self._post(GENERATE_PATH, body, session_id, prompt_ids)
        ids, reason, logprobs = parse_generated(raw, url=url, want_logprobs=spec.logprobs is not None)
        if self.tokenizer is not None:
            text = str(self.tokenizer.decode(ids, skip_special_tokens=spec.skip_special_tokens))
        else:
            _, answer = await self._post(DETOKENIZE_PATH, {"model": model, "tokens": ids}, session_id)
            text = parse_detokenized(answer, url=url)
        return Completion(text=text, token_ids=ids, stop_reason=reason, logprobs=logprobs)


def _decode(tokenizer: Tokenizer, skip_special_tokens: bool, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
