"""How a ``generate()`` call's sessions spread over several engine servers: ``rollout_metrics`` and observers.

An inference client that routes over several servers says where its sessions are with
``routes()`` (``HTTPEngine.routes``, one
:class:`~skyrl_structured.engines.routing.ServerRoute` per server; read structurally here, the runtime
sits below the engines). While a call's rollouts run, :class:`RoutesWatch` reads it every
:data:`ROUTES_INTERVAL_S` and at the call's end, tells the call's observers
(``RolloutObserver.engine_routes_read``: the trace's counter tracks, Prometheus's gauges), and
gives the call's ``rollout_metrics``, per server ``i`` in the client's order:

- ``generate/routing/server{i}_share_mean``: the share of the sessions placed while the call ran that
  went to server ``i`` (those of concurrent calls included: a share, so SkyRL's trainer averages it);
- ``generate/routing/server{i}_sessions_max``: the most sessions bound to it at one reading;
- ``generate/routing/server{i}_load_mean`` and ``_load_max``: its load as routing compares it.

A client with one server, or without ``routes``, is not watched. Reading never touches the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from ..observe import EngineRoute, Observers, RolloutObserver

__all__ = ["ROUTES_INTERVAL_S", "RoutesWatch"]

logger = logging.getLogger(__name__)

#: Seconds between two reads of a client's routes while a call runs.
ROUTES_INTERVAL_S = 1.0


class RoutesWatch:
    """One call's view of its client's routes; make it with :meth:`of`."""

    def __init__(self, read: Callable[[], Sequence[EngineRoute]], servers: Sequence[str]) -> None:
        self._read = read
        self.servers = tuple(servers)
        n = len(self.servers)
        self._first_placed: list[int] | None = None
        self._last_placed = [0] * n
        self._sessions_max = [0] * n
        self._load_sum = [0.0] * n
        self._load_max = [0.0] * n
        self._readings = 0
        self._broken = False

    @classmethod
    def of(cls, client: object) -> RoutesWatch | None:
        """The watch of ``client``'s routes, or None when it has no ``routes()`` or routes to one server."""
        read: Any = getattr(client, "routes", None)
        if not callable(read):
            return None
        try:
            routes = list(read())
        except Exception as exc:  # not ours to fail a call over
            logger.warning("the inference client's routes() failed (%r); its sessions' servers are not reported", exc)
            return None
        if len(routes) < 2:
            return None
        watch = cls(read, [route.server for route in routes])
        watch._saw(routes)
        return watch

    def _saw(self, routes: Sequence[EngineRoute]) -> None:
        if [route.server for route in routes] != list(self.servers):
            return  # not the servers this watch started with: left out rather than misread
        placed = [route.placed_total for route in routes]
        if self._first_placed is None:
            self._first_placed = placed
        self._last_placed = placed
        for i, route in enumerate(routes):
            self._sessions_max[i] = max(self._sessions_max[i], route.sessions)
            self._load_sum[i] += route.load
            self._load_max[i] = max(self._load_max[i], route.load)
        self._readings += 1

    def read(self, observers: Observers) -> None:
        """Read the routes now: recorded and told to ``observers``."""
        if self._broken:
            return
        try:
            routes = list(self._read())
        except Exception as exc:
            self._broken = True
            logger.warning("the inference client's routes() failed (%r); no more readings in this call", exc)
            return
        self._saw(routes)
        observers.emit(RolloutObserver.engine_routes_read, routes)

    async def run(self, observers: Observers) -> None:
        """Read every :data:`ROUTES_INTERVAL_S` until cancelled (the call's last rollout ending)."""
        while True:
            self.read(observers)
            await anyio.sleep(ROUTES_INTERVAL_S)

    def metrics(self) -> dict[str, float]:
        """The call's routing metrics (see the module's docstring)."""
        out: dict[str, float] = {}
        first = self._first_placed or self._last_placed
        placed = [last - start for last, start in zip(self._last_placed, first, strict=True)]
        total = sum(placed)
        for i in range(len(self.servers)):
            key = f"generate/routing/server{i}"
            if total > 0:
                out[f"{key}_share_mean"] = placed[i] / total
            out[f"{key}_sessions_max"] = float(self._sessions_max[i])
            if self._readings:
                out[f"{key}_load_mean"] = self._load_sum[i] / self._readings
                out[f"{key}_load_max"] = self._load_max[i]
        return out
