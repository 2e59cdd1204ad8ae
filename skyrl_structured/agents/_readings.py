"""The endpoint worker processes as observers see them (``RolloutObserver.endpoint_workers_read``).

:meth:`~._workers.CaptureWorkers.readings` gives one :class:`WorkerReading` per slot of the pool.
A :class:`WorkersWatch` belongs to one attachment (a ``serve_capture`` block on the pool, which may
span several ``generate()`` calls): each call listens while it runs (:meth:`WorkersWatch.listening`)
and hears a reading when it starts listening, every :data:`READ_INTERVAL_S` while it listens, as
soon as a worker dies or its replacement is ready (the pool's reader threads hand that to the
loop), and when it stops. The trace draws the readings as counter tracks with instants for deaths
and replacements; Prometheus shows them as gauges. Nothing is read while no call listens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from ..observe import Observers, RolloutObserver

if TYPE_CHECKING:
    from ._workers import CaptureWorkers

__all__ = ["READ_INTERVAL_S", "WorkerReading", "WorkersWatch"]

logger = logging.getLogger(__name__)

#: Seconds between two readings of the pool while a call listens.
READ_INTERVAL_S = 1.0


@dataclass(frozen=True)
class WorkerReading:
    """One slot of the pool at one moment (an :class:`~skyrl_structured.observe.EndpointWorker`)."""

    #: The slot's position in the pool (a replacement keeps it).
    index: int
    #: The worker's own pid once it said it is ready; None while it starts.
    pid: int | None
    #: The port agents reach it on (kept while it is replaced).
    port: int
    #: Whether it is alive and ready.
    up: bool
    #: Open sessions placed on it now.
    sessions: int
    #: Times this slot's worker was replaced.
    restarts: int
    #: Sessions failed by this slot's deaths, in total.
    sessions_lost: int


class WorkersWatch:
    """Reads an attachment's pool for the calls listening to it (see the module); runs in the attachment's group.

    ``hand`` runs a callback on the attachment's loop soon, from any thread (its ``LoopWaker``).
    """

    def __init__(self, pool: CaptureWorkers, hand: Callable[[Callable[[], None]], None]) -> None:
        self._pool = pool
        self._hand = hand
        self._listeners: list[Observers] = []
        self._wake = anyio.Event()
        #: A worker died or a replacement is ready since the last reading.
        self._changed = False

    @contextlib.contextmanager
    def listening(self, observers: Observers) -> Iterator[None]:
        """Tell ``observers`` the readings for the block: one now, then as the module says, and one at its end."""
        if not observers.wants(RolloutObserver.endpoint_workers_read):
            yield
            return
        self._tell([observers])
        self._listeners.append(observers)
        self._wake.set()  # the watch starts its clock
        try:
            yield
        finally:
            self._listeners.remove(observers)
            self._tell([observers])

    def _tell(self, listeners: list[Observers]) -> None:
        readings = self._pool.readings()
        for observers in listeners:
            observers.emit(RolloutObserver.endpoint_workers_read, readings)

    def _poke(self) -> None:
        """A worker died or a replacement is ready (a reader thread): read soon, on the loop."""
        self._hand(self._pool_changed)

    def _pool_changed(self) -> None:
        self._changed = True
        self._wake.set()

    async def run(self) -> None:
        """Read while any call listens, until the attachment's group is cancelled."""
        self._pool.watchers.append(self._poke)
        try:
            while True:
                timed_out = False
                if self._listeners:
                    with anyio.move_on_after(READ_INTERVAL_S) as scope:
                        await self._wake.wait()
                    timed_out = scope.cancelled_caught
                else:
                    await self._wake.wait()
                self._wake = anyio.Event()
                changed, self._changed = self._changed, False
                if self._listeners and (timed_out or changed):
                    self._tell(list(self._listeners))
        finally:
            with contextlib.suppress(ValueError):
                self._pool.watchers.remove(self._poke)
