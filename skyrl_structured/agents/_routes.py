"""How the endpoint reads a request's address and body: the session key, the route after ``/v1``, the JSON object.

The transport-facing surface is :func:`request_parts` (the one place a transport's request object is read);
the route table is the registry's (:data:`~._wire.ROUTES`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._http import Request
from ..config import AgentEndpointSettings
from ..types import TrajectoryID
from ._wire import ROUTES, SURROGATE_ESCAPE, APIError, check_encodable, messages

if TYPE_CHECKING:
    from ._capture import CallRecord
    from ._session import CaptureSession

__all__ = [
    "ROUTE_LIST",
    "closed_in_flight",
    "error_shape",
    "json_body",
    "misplaced",
    "request_parts",
    "rollout_ended",
    "split_path",
]


def rollout_ended(ended: tuple[str, str] | None, *, endpoint_closed: bool = False) -> APIError:
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


def request_parts(request: Request) -> tuple[str, str, dict[str, str]]:
    """``(method, path without its query, headers with lower-case names)`` of a request: the one place this
    module reads the HTTP core's request."""
    return request.method, request.path, request.header_map()


def json_body(raw_body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, checked for text no tokenizer can encode.

    Raises:
        APIError: 400 when it is not JSON, not an object, or holds a lone UTF-16 surrogate.
    """
    try:
        body = json.loads(raw_body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if SURROGATE_ESCAPE.search(raw_body):
        check_encodable(body)
    return body


def misplaced(route: str) -> bool:
    """An ``anthropic`` client given the chat base URL (it calls ``.../v1/v1/messages``)."""
    return route.startswith("/v1/messages")


def error_shape(route: str) -> Callable[[APIError], Any]:
    """The error shape of a route's API (OpenAI's for an unknown route); a misplaced Messages route is Anthropic's."""
    if misplaced(route):
        return messages.error_body
    found = ROUTES.get(route)
    return found[0].error if found is not None else APIError.body


#: The routes, as a 404 lists them.
ROUTE_LIST = ", ".join(f"{route.method} {path}" for path, (_, route) in ROUTES.items())


def split_path(path: str, headers: dict[str, str]) -> tuple[str | None, str | None, str]:
    """``(key in the path, header key, route after /v1)`` of ``/sessions/<key>/v1/...`` or ``/v1/...``.

    The header key is ``Authorization: Bearer <key>``'s, else ``x-api-key``'s (Claude-Code-style clients).
    """
    auth = headers.get("authorization", "")
    bearer = auth[len("bearer ") :].strip() or None if auth.lower().startswith("bearer ") else None
    bearer = bearer or headers.get("x-api-key", "").strip() or None
    parts = path.rstrip("/").split("/")
    if len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1":
        return parts[2], bearer, "/" + "/".join(parts[4:])
    if len(parts) >= 2 and parts[1] == "v1":
        return None, bearer, "/" + "/".join(parts[2:])
    return None, bearer, path


def closed_in_flight(session: CaptureSession) -> APIError:
    """The 499 of a request whose session closed while it was in flight."""
    return APIError(
        499,
        f"rollout {session.rollout} ended ({session.close_reason}) while this request was in flight; "
        "the engine request was cancelled",
    )


def _number(calls: list[CallRecord], call: CallRecord) -> int:
    """``call``'s index among the session's calls (the last one, unless calls of the session raced it)."""
    for index in range(len(calls) - 1, -1, -1):
        if calls[index] is call:
            return index
    return len(calls) - 1


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
