"""``HTTPEngine``'s servers: their base URLs, and what ``server_status`` finds at each (ready, or what is wrong)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .completions import error_message

__all__ = ["ServerStatus", "normalise_url", "served_models", "status_at"]


def normalise_url(url: str) -> str:
    """``url`` as a base URL: http(s), no trailing slash or ``/v1``.

    Raises:
        ValueError: not an http:// or https:// URL.
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"base_urls must be http:// or https:// URLs, got {url!r}")
    url = url.rstrip("/")
    # Accept the OpenAI-client style ".../v1" too: the engine adds the path itself.
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class ServerStatus:
    """What :meth:`HTTPEngine.server_status` found at one base URL.

    ``problem`` is None when the server is up and serves the model; otherwise ``"unreachable"`` (no
    answer: not started, wrong host or port), ``"unhealthy"`` (it answered ``/health`` or
    ``/v1/models`` with an error or an unusable body) or ``"model_not_served"`` (``models`` lists
    what it serves instead). ``detail`` says what was seen.
    """

    url: str
    problem: Literal["unreachable", "unhealthy", "model_not_served"] | None
    detail: str = ""
    models: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.problem is None

    def describe(self, model: str) -> str:
        """One line naming the URL, what is wrong and the fix (empty when ready)."""
        if self.problem == "unreachable":
            return (
                f"no vLLM server answers at {self.url} ({self.detail}): start it (vllm serve <model> --port ...) "
                "or fix the URL"
            )
        if self.problem == "unhealthy":
            return f"the server at {self.url} is not ready ({self.detail}): wait until it has loaded, or see its log"
        if self.problem == "model_not_served":
            served = ", ".join(map(repr, self.models)) or "nothing"
            return (
                f"the server at {self.url} does not serve model {model!r}; it serves {served} "
                "(the model name must be one of them: vllm serve --served-model-name sets it)"
            )
        return ""


def served_models(raw: bytes) -> tuple[str, ...] | None:
    """The ids in an OpenAI ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``); None if it is not one."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list):
        return None
    return tuple(str(card["id"]) for card in cards if isinstance(card, dict) and "id" in card)


async def _get(client: Any, url: str, timeout_s: float) -> tuple[int, bytes]:
    response = await client.get(url, timeout=timeout_s)
    return int(response.status_code), bytes(response.content)


async def status_at(httpx: Any, client: Any, url: str, model: str, timeout_s: float) -> ServerStatus:
    """Whether the server at ``url`` is up (``GET /health``) and serves ``model`` (``GET /v1/models``); never raises."""
    try:
        health, body = await _get(client, f"{url}/health", timeout_s)
        if not 200 <= health < 300 and health != 404:
            return ServerStatus(url, "unhealthy", f"GET /health answered HTTP {health}: {error_message(body)}")
        status, body = await _get(client, f"{url}/v1/models", timeout_s)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return ServerStatus(url, "unreachable", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:  # a read timeout, a bad URL, a proxy error, ...
        return ServerStatus(url, "unhealthy", f"{type(exc).__name__}: {exc}")
    if not 200 <= status < 300:
        return ServerStatus(url, "unhealthy", f"GET /v1/models answered HTTP {status}: {error_message(body)}")
    models = served_models(body)
    if models is None:
        return ServerStatus(url, "unhealthy", "GET /v1/models answered something other than a model list")
    if model not in models:
        return ServerStatus(url, "model_not_served", f"it serves {list(models)}", models)
    return ServerStatus(url, None, "", models)
