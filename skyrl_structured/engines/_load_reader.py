"""Reading engine servers' load at a bounded rate, for :class:`~skyrl_structured.engines.load.ReportsLoad`.

One :class:`LoadReader` per engine client. :meth:`LoadReader.latest` answers from the last
reading while it is younger than ``min_interval_s``; otherwise the caller reads every server,
concurrently, and callers that come meanwhile wait for that one read instead of starting their
own. So however often the admission controller (or anything else) asks, each server is asked at
most once per ``min_interval_s``. The read runs in the caller's task, never in a rollout's.

A server that cannot be read (unreachable, an error status, text that is not vLLM's metrics) is
left out of the reading and logged once, at warning level, until it can be read again. A counter
that goes down is a server that restarted: counting continues from the last value reported (as
Prometheus's ``rate()`` reads a counter reset), so a reader's differences are never negative.

Used from one event loop at a time (an engine's requests are too).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import anyio

from ._gather import gather_in_order
from ._vllm_metrics import engine_load_from_metrics
from .load import EngineLoad

__all__ = ["LoadReader"]

logger = logging.getLogger(__name__)


class _Monotonic:
    """One server's counters, continued across its restarts."""

    def __init__(self) -> None:
        self._last_raw: dict[str, int] = {}
        self._offset: dict[str, int] = {}

    def continued(self, load: EngineLoad) -> EngineLoad:
        return replace(
            load,
            preemptions_total=self._total("preemptions_total", load.preemptions_total),
            prefix_cache_hits_total=self._total("prefix_cache_hits_total", load.prefix_cache_hits_total),
            prefix_cache_queries_total=self._total("prefix_cache_queries_total", load.prefix_cache_queries_total),
        )

    def _total(self, name: str, raw: int) -> int:
        if raw < self._last_raw.get(name, 0):  # a restart: the server counts from 0 again
            self._offset[name] = self._offset.get(name, 0) + self._last_raw[name]
        self._last_raw[name] = raw
        return raw + self._offset.get(name, 0)


class LoadReader:
    """The latest load of each server, read at most once per ``min_interval_s``.

    Args:
        servers: what to read, in the order readings are returned.
        fetch: the text of one server's Prometheus metrics; any ``Exception`` it raises leaves
            that server out of the reading.
        min_interval_s: the least time between the end of one read and the start of the next.
        what: names the client in log lines (``"HTTPEngine"``).
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        servers: Sequence[str],
        fetch: Callable[[str], Awaitable[str]],
        *,
        min_interval_s: float,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval_s < 0:
            raise ValueError(f"load_interval_s must be >= 0, got {min_interval_s}")
        self.servers = tuple(servers)
        self.min_interval_s = min_interval_s
        self._reads_finished = 0  # a cancelled read is not finished
        self._fetch = fetch
        self._what = what
        self._clock = clock
        self._latest: list[EngineLoad] = []
        self._read_at: float | None = None
        self._in_flight: anyio.Event | None = None
        self._problems: dict[str, str] = {}
        self._counters = {server: _Monotonic() for server in self.servers}

    @property
    def reads_finished(self) -> int:
        """How many reads have finished (a new number: a new reading)."""
        return self._reads_finished

    @property
    def reading(self) -> bool:
        """Whether a read is in flight now."""
        return self._in_flight is not None

    def fresh(self) -> bool:
        """Whether the last reading is younger than ``min_interval_s``."""
        return self._fresh()

    def _fresh(self) -> bool:
        return self._read_at is not None and self._clock() - self._read_at < self.min_interval_s

    async def latest(self) -> list[EngineLoad]:
        """The last reading if it is fresh, else a new one (shared with concurrent callers); never raises."""
        while not self._fresh():
            if self._in_flight is not None:
                # Another caller is reading: take its reading (or, if it was cancelled, read ourselves).
                finished = self._reads_finished
                await self._in_flight.wait()
                if self._reads_finished > finished:
                    break
                continue
            done = self._in_flight = anyio.Event()
            try:
                loads = await gather_in_order([functools.partial(self._read_one, s) for s in self.servers])
                self._latest = [load for load in loads if load is not None]
                self._read_at = self._clock()
                self._reads_finished += 1
            finally:
                self._in_flight = None
                done.set()
            break
        return list(self._latest)

    async def _read_one(self, server: str) -> EngineLoad | None:
        try:
            text = await self._fetch(server)
            load = engine_load_from_metrics(server, text, at=self._clock())
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if server not in self._problems:
                logger.warning(
                    "%s: cannot read the load of %s (%s); it is left out of the engine load until it can be read",
                    self._what,
                    server,
                    problem,
                )
            self._problems[server] = problem
            return None
        if self._problems.pop(server, None) is not None:
            logger.info("%s: the load of %s can be read again", self._what, server)
        return self._counters[server].continued(load)
