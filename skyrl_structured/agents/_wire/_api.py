"""What one wire API provides the endpoint (design rule 27): its routes, request parse, reply, stream, error shape.

Each API is one module of :mod:`._wire` that builds a :class:`WireAPI` and is listed once in
:data:`~._wire.REGISTRY`; the server builds its route table from the registry and answers every
request with one handler (parse -> prepare -> sample -> reply or stream), and ``check_capture``
writes its check conversation in every API that has a :attr:`WireAPI.check` writer.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .._apierrors import APIError
from .._capture import CallRecord
from .._conversation import Conversation

__all__ = ["CheckScript", "Exchange", "Route", "Turn", "TurnWriter", "WireAPI"]


@dataclass(frozen=True)
class Route:
    """One route, after ``/v1`` of a session's base URL: ``"sample"`` samples, ``"count"`` counts the prompt's
    tokens (nothing sampled), ``"models"`` lists the served model."""

    method: str
    path: str
    action: Literal["sample", "count", "models"] = "sample"


@dataclass(frozen=True)
class Turn:
    """A parsed request: the typed conversation to render, or (legacy completions) a raw prompt.

    ``prompt`` is the text or the token ids of a completions request (None for a chat-shaped API);
    ``request`` is the API's own parse, which its reply needs (echoed fields, stop sequences, ...).
    """

    conversation: Conversation
    stream: bool = False
    prompt: str | tuple[int, ...] | None = None
    request: Any = None
    #: The request field a too-long prompt is blamed on (``messages``, ``input``, ``prompt``).
    prompt_param: str = "messages"


@dataclass
class Exchange:
    """What a wire API may read of the session and the call besides the request body."""

    session_id: str
    #: The call's number in its session (its reply's id is made from it).
    index: int
    model: str
    created: int
    tokenizer: Any
    #: The generator's sampling parameters, which the request's fields are laid over.
    base_sampling: dict[str, Any] | None
    #: The session's state of this API (Responses: its stored responses); dropped when the session closes.
    store: MutableMapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckScript:
    """The start of ``check_capture``'s conversation: a system prompt, a user turn, one function tool (chat shape)."""

    system: str
    user: str
    tools: list[dict[str, Any]]


class TurnWriter(Protocol):
    """How ``check_capture`` writes its conversation as one API's client would, call by call."""

    def body(self) -> dict[str, Any]: ...

    def answer(self, reply: dict[str, Any]) -> None:
        """Re-send the endpoint's reply body as this API's client does."""

    def follow(self, role: str, text: str) -> None: ...


@dataclass(frozen=True)
class WireAPI:
    """One wire API, as the endpoint and ``check_capture`` use it."""

    #: The name ``check_capture(api=...)`` takes.
    name: str
    #: The name :attr:`~.._check.CaptureCheck.api` reports.
    title: str
    routes: tuple[Route, ...]
    #: The request body -> a :class:`Turn`. Raises :class:`APIError` (400) naming a field it cannot honour.
    parse: Callable[[dict[str, Any], Exchange], Turn]
    #: A recorded call -> the reply body.
    reply: Callable[[CallRecord, Turn, Exchange], dict[str, Any]]
    #: A reply body -> its SSE bytes (``stream: true``).
    stream: Callable[[dict[str, Any], Turn], bytes]
    #: An error -> its body in this API's shape.
    error: Callable[[APIError], dict[str, Any]] = APIError.body
    #: ``count`` routes' answer for a prompt of ``n`` tokens.
    count: Callable[[int], dict[str, Any]] | None = None
    #: ``check_capture``'s writer of this API's shape; None: not a chat-shaped API (legacy completions).
    check: Callable[[CheckScript], TurnWriter] | None = None
