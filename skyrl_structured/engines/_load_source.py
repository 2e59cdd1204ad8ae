"""Where ``max_concurrent_rollouts="auto"`` reads the engines' load: the client's ``engine_load``, if it has one."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence

from .bridge import run_asyncio
from .load import EngineLoad, ReportsLoad

__all__ = ["load_reader"]


def load_reader(client: object, called: object) -> Callable[[], Awaitable[Sequence[EngineLoad]]] | None:
    """``client.engine_load`` as ``generate()`` calls it, or None for a client that cannot report its load.

    ``called`` is the client the rollouts call (:func:`~skyrl_structured.engines.bridge.bridged_client`):
    when it is not ``client`` itself, ``client`` is asyncio-only under trio and its reads cross the bridge too.
    """
    if not isinstance(client, ReportsLoad):
        return None
    if called is client:
        return client.engine_load
    return functools.partial(run_asyncio, client.engine_load)
