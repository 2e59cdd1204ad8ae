"""An engine that reports a scripted load (``ReportsLoad``), and an observer to wait on what admission did.

:class:`ScriptedLoad` wraps a real test engine (a ``ScriptedEngine``) and answers ``engine_load()``
with the readings the test hands it, one per read: a read waits until the test gives the next
one, so a test steps the admission controller reading by reading and never races its interval.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from skyrl_structured._runtime.slots import Admission
from skyrl_structured.engines._wrapper import EngineWrapper
from skyrl_structured.engines.load import EngineLoad
from skyrl_structured.observe import RolloutObserver, RolloutRef

#: (kv_cache_usage, requests_waiting, preemptions_total, kv_capacity_tokens) of one reading of the one server.
_Spec = tuple[float, int, int, int | None]


class ScriptedLoad(EngineWrapper):
    """``engine`` plus ``engine_load()``: the next reading :meth:`give` queued, taken when it is read."""

    def __init__(self, engine: Any, server: str = "http://127.0.0.1:1") -> None:
        super().__init__(engine)
        self.server = server
        self._queued: deque[_Spec] = deque()
        self._given: anyio.Event | None = None
        self.reads = 0

    def give(self, kv: float, *, waiting: int = 0, preemptions: int = 0, capacity: int | None = None) -> None:
        """Queue the next reading the controller gets (``capacity``: the server's KV capacity in tokens)."""
        self._queued.append((kv, waiting, preemptions, capacity))
        if self._given is not None:
            self._given.set()

    async def engine_load(self) -> list[EngineLoad]:
        while not self._queued:
            self._given = anyio.Event()
            await self._given.wait()
        kv, waiting, preemptions, capacity = self._queued.popleft()
        self.reads += 1
        return [
            EngineLoad(
                server=self.server,
                kv_cache_usage=kv,
                requests_running=0,
                requests_waiting=waiting,
                preemptions_total=preemptions,
                prefix_cache_hits_total=0,
                prefix_cache_queries_total=0,
                at=time.monotonic(),
                kv_capacity_tokens=capacity,
            )
        ]


class AdmissionWatch(RolloutObserver):
    """Records admission decisions and rollout starts, and lets a test wait for a condition on them."""

    def __init__(self) -> None:
        self.decisions: list[tuple[int, int, str]] = []
        self.kv: list[float | None] = []
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self._changed: anyio.Event | None = None

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def until(self, condition: Callable[[AdmissionWatch], bool]) -> None:
        while not condition(self):
            self._changed = anyio.Event()
            await self._changed.wait()

    def admission_decided(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        self.decisions.append((limit, previous, reason))
        self.kv.append(kv_cache_usage)
        self._notify()

    def attempt_started(self, rollout: RolloutRef) -> None:
        self.started.append(rollout.index)
        self._notify()

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self.cancelled.append(rollout.index)
        self._notify()


def admission_of(generator: Any) -> Admission:
    """The generator's load-following slots (``max_concurrent_rollouts="auto"``) in the running event loop."""
    admission: Admission = generator._frame.slots._adaptive.get()
    return admission
