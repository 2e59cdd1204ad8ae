"""The registry of wire APIs (design rule 27): one module per API, each listed once in :data:`REGISTRY`.

How to add a wire API: write a module here that builds a :class:`WireAPI` (its routes under a
session's ``/v1``, its request -> :class:`Turn` of the typed conversation or a raw prompt, a recorded
call -> its reply body and stream, its error shape) and add it to :data:`REGISTRY`. The endpoint's
route table and ``check_capture`` are built from this table; nothing else changes.
"""

from __future__ import annotations

from .._apierrors import SURROGATE_ESCAPE, APIError, ContextLengthError, check_encodable, context_refusal
from . import chat, completions, messages, responses
from ._api import CheckScript, Exchange, Route, Turn, TurnWriter, WireAPI

__all__ = [
    "REGISTRY",
    "ROUTES",
    "SURROGATE_ESCAPE",
    "APIError",
    "CheckScript",
    "ContextLengthError",
    "Exchange",
    "Route",
    "Turn",
    "TurnWriter",
    "WireAPI",
    "check_encodable",
    "context_refusal",
]

#: Every wire API the endpoint speaks, in the order ``check_capture`` checks them.
REGISTRY: tuple[WireAPI, ...] = (chat.API, responses.API, messages.API, completions.API)

#: The route table: path after ``/v1`` -> (its API, the route).
ROUTES: dict[str, tuple[WireAPI, Route]] = {route.path: (api, route) for api in REGISTRY for route in api.routes}
