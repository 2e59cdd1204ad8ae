"""What an engine can say about its own load: the signal behind ``max_concurrent_rollouts="auto"``.

An engine client that can read its servers' load (KV-cache usage, queued requests, preemptions,
prefix-cache counters) implements :class:`ReportsLoad`. The generator's admission controller reads
it off the rollouts' path; a client that does not implement it gets the documented fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["EngineLoad", "ReportsLoad"]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine server's load at one reading.

    ``kv_cache_usage`` is the fraction (0.0-1.0) of the server's KV-cache blocks in use; the
    ``*_total`` fields are the server's own cumulative counters (so a reader takes differences);
    ``at`` is ``time.monotonic()`` when the reading was taken. ``kv_capacity_tokens`` is how many
    tokens the server's KV cache holds in all (its engines together), None where the server does not
    say: with it, admission weighs the context its admitted rollouts hold against that capacity.
    """

    server: str
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    prefix_cache_hits_total: int
    prefix_cache_queries_total: int
    at: float
    kv_capacity_tokens: int | None = None


@runtime_checkable
class ReportsLoad(Protocol):
    """An engine client that reports its servers' load."""

    async def engine_load(self) -> Sequence[EngineLoad]:
        """The latest reading of each server this client sends to (empty: none readable now).

        Cheap to call often: the client reads its servers at a bounded rate and answers from
        the last reading in between. Never raises for an unreachable server (it is left out).
        """
        ...
