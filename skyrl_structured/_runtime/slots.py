"""``max_concurrent_rollouts``: one generator's slots, shared by all its concurrent ``generate()`` calls.

SkyRL's fully-async trainer runs one ``generate()`` per prompt group at once; the bound is the
generator's, not each call's. A limiter belongs to one event loop, so there is one per loop.

With ``max_concurrent_rollouts="auto"`` the limiter's size follows the engines' load
(:class:`Admission`): each ``generate()`` call runs :meth:`AdmissionCall.run` beside its rollouts,
and one of them at a time (the first to come; the next takes over when it ends) reads the engines
every ``interval_s`` and applies :func:`~skyrl_structured._runtime.admission.decide`, with the
context the admitted rollouts of every call running then hold
(:mod:`~skyrl_structured._runtime.committed`). Resizing a limiter never touches a slot already
taken: a smaller limit admits no one until enough rollouts have finished, a larger one admits the
waiting rollouts at once, in FIFO order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.lowlevel import RunVar

from ..config import ResilienceSettings
from ..observe import Observers, RolloutObserver
from .admission import AdmissionBounds, AdmissionState, Decision, LoadReading, decide
from .committed import CommittedContexts, committed_tokens

__all__ = ["ADMISSION_INTERVAL_S", "Admission", "AdmissionCall", "AdmissionRecord", "LoadReader", "RolloutSlots"]

logger = logging.getLogger(__name__)

#: Reads the engines' load (``ReportsLoad.engine_load``, across the trio bridge where needed).
LoadReader = Callable[[], Awaitable[Sequence[LoadReading]]]

#: Seconds between two reads of the engines' load (a generator's ``admission_interval_s``).
ADMISSION_INTERVAL_S = 1.0

#: A read of the engines' load that takes longer than this is given up (the limit holds).
READ_TIMEOUT_S = 10.0


class RolloutSlots:
    """The generator's limiter in the running event loop, made on first use and remade if the bound changes.

    FIFO on both backends (anyio's asyncio limiter queues waiters in order, trio's parks them in a
    FIFO lot), so a large call cannot starve a small one that queued first.
    """

    __slots__ = ("_adaptive", "_per_loop")

    def __init__(self, owner: object) -> None:
        self._per_loop: RunVar[anyio.CapacityLimiter] = RunVar(f"skyrl_structured_slots_{id(owner)}")
        self._adaptive: RunVar[Admission] = RunVar(f"skyrl_structured_admission_{id(owner)}")

    def current(self, bound: int | None) -> anyio.CapacityLimiter | None:
        """The limiter for ``bound`` slots (None: unbounded)."""
        if bound is None:
            return None
        slots = self._per_loop.get(None)
        if slots is None or slots.total_tokens != bound:
            slots = anyio.CapacityLimiter(bound)
            self._per_loop.set(slots)
        return slots

    def for_call(
        self, settings: ResilienceSettings, client: object, read: LoadReader | None, interval_s: float
    ) -> tuple[anyio.CapacityLimiter | None, AdmissionCall | None]:
        """The limiter of one ``generate()`` call, and with ``max_concurrent_rollouts="auto"`` its part in
        following the load (``read``: the client's, None where it reports none)."""
        bound = settings.max_concurrent_rollouts
        if not isinstance(bound, str):
            return self.current(bound), None
        bounds = AdmissionBounds(
            settings.admission_min_rollouts, settings.admission_max_rollouts, settings.admission_kv_target
        )
        call = AdmissionCall(self.adaptive(bounds), read, client, interval_s)
        return call.limiter, call

    def adaptive(self, bounds: AdmissionBounds) -> Admission:
        """The load-following slots (``max_concurrent_rollouts="auto"``) within ``bounds``; remade if they change."""
        admission = self._adaptive.get(None)
        if admission is None or admission.bounds != bounds:
            admission = Admission(bounds)
            self._adaptive.set(admission)
        return admission


@dataclass
class AdmissionRecord:
    """What one ``generate()`` call saw of the admission limit, for its ``rollout_metrics``.

    The limit, the KV-cache usage and the committed fraction are seen by every call running while
    they are read; the changes and preemptions are counted by the call whose driver read them only,
    so that SkyRL's fully-async trainer, which sums such counts over its concurrent calls, counts
    each once.
    """

    limit_min: int
    limit_max: int
    fallback: bool = False
    kv_sum: float = 0.0
    kv_max: float = 0.0
    kv_readings: int = 0
    committed_sum: float = 0.0
    committed_max: float = 0.0
    committed_readings: int = 0
    preemptions: int = 0
    changes: Counter[str] = field(default_factory=Counter)

    def saw(self, decision: Decision) -> None:
        self.limit_min = min(self.limit_min, decision.limit)
        self.limit_max = max(self.limit_max, decision.limit)
        if decision.kv_cache_usage is not None:
            self.kv_sum += decision.kv_cache_usage
            self.kv_max = max(self.kv_max, decision.kv_cache_usage)
            self.kv_readings += 1
        if decision.committed_kv is not None:
            self.committed_sum += decision.committed_kv
            self.committed_max = max(self.committed_max, decision.committed_kv)
            self.committed_readings += 1

    def metrics(self) -> dict[str, float]:
        """The call's admission metrics, named to aggregate right under SkyRL's rules (``min``, ``max``,
        ``mean`` in the name: taken as such; any other name: summed)."""
        out: dict[str, float] = {
            "generate/admission_limit_min": float(self.limit_min),
            "generate/admission_limit_max": float(self.limit_max),
            "generate/admission_fallback": 1.0 if self.fallback else 0.0,
            "generate/admission_engine_preemptions": float(self.preemptions),
        }
        if self.kv_readings:
            out["generate/kv_cache_usage_mean"] = self.kv_sum / self.kv_readings
            out["generate/kv_cache_usage_max"] = self.kv_max
        if self.committed_readings:
            out["generate/admission_committed_kv_mean"] = self.committed_sum / self.committed_readings
            out["generate/admission_committed_kv_max"] = self.committed_max
        for reason, count in sorted(self.changes.items()):
            out[f"generate/admission_changes/{reason}"] = float(count)
        return out


class Admission:
    """One generator's load-following limit in one event loop: the limiter, the controller's state, its driver."""

    def __init__(self, bounds: AdmissionBounds) -> None:
        self.bounds = bounds
        self.state = AdmissionState.start(bounds)
        self.limiter = anyio.CapacityLimiter(self.state.limit)
        self._driving = anyio.Lock()
        self._records: list[AdmissionRecord] = []
        #: The admitted attempts of each call whose driver runs (every call with rollouts left).
        self._committed: list[CommittedContexts] = []
        self._warned_fallback = False
        self._warned_read = False

    @property
    def fallback_limit(self) -> int:
        """The fixed bound for a client that cannot report its load: the ceiling, else the floor."""
        return self.bounds.ceiling if self.bounds.ceiling is not None else self.bounds.floor

    def record(self) -> AdmissionRecord:
        """A fresh record for one call, starting at the limit now."""
        limit = int(self.limiter.total_tokens)
        return AdmissionRecord(limit_min=limit, limit_max=limit)

    def use_fallback(self, record: AdmissionRecord, client: object) -> None:
        """Fix the limit at :attr:`fallback_limit` (the client reports no load); the first time, say so."""
        record.fallback = True
        limit = self.fallback_limit
        record.limit_min = record.limit_max = limit
        if self.limiter.total_tokens != limit:
            self.limiter.total_tokens = limit
            self.state = AdmissionState(limit)
        if not self._warned_fallback:
            self._warned_fallback = True
            logger.warning(
                "generator.max_concurrent_rollouts='auto': the inference client %s reports no load (it does "
                "not implement skyrl_structured.engines.load.ReportsLoad), so the bound is fixed at %d (%s); use "
                "HTTPEngine or VLLMEngine to follow the engines' KV cache, or set that bound yourself",
                type(client).__name__,
                limit,
                "generator.admission_max_rollouts"
                if self.bounds.ceiling is not None
                else "generator.admission_min_rollouts",
            )

    def committed_tokens(self) -> float | None:
        """The context the admitted rollouts of the calls running now hold, in tokens (see ``committed.py``)."""
        return committed_tokens(self._committed)

    async def _read(self, read: LoadReader) -> Sequence[LoadReading]:
        try:
            with anyio.move_on_after(READ_TIMEOUT_S):
                return await read()
        except Exception as exc:  # a client's own bug: the limit holds, the rollouts go on
            if not self._warned_read:
                self._warned_read = True
                logger.warning("reading the engines' load failed (%r); the admission limit holds until one works", exc)
            return ()
        return ()

    def _apply(self, decision: Decision, driver: AdmissionRecord, observers: Observers) -> None:
        previous = self.state.limit
        self.state = decision.state
        if decision.limit != previous:
            self.limiter.total_tokens = decision.limit
            driver.changes[decision.reason] += 1
            logger.debug("admission limit %d -> %d (%s)", previous, decision.limit, decision.reason)
        driver.preemptions += decision.new_preemptions
        for record in self._records:
            record.saw(decision)
        observers.emit(
            RolloutObserver.admission_decided, decision.limit, previous, decision.reason, decision.kv_cache_usage
        )

    async def drive(
        self,
        read: LoadReader,
        record: AdmissionRecord,
        committed: CommittedContexts,
        observers: Observers,
        interval_s: float,
    ) -> None:
        """Follow the engines' load until cancelled: wait for the call driving now to end, then read,
        decide and apply every ``interval_s`` (the call's rollouts ending cancels this). ``committed``
        (the call's admitted attempts) counts towards every decision while the call runs."""
        if not self._records:  # no call ran since the last ended: the servers' counts since are not ours
            self.state = self.state.resumed()
        self._records.append(record)
        self._committed.append(committed)
        try:
            async with self._driving:
                while True:
                    readings = await self._read(read)
                    limiter = self.limiter
                    decision = decide(
                        self.state,
                        readings,
                        admitted=int(limiter.borrowed_tokens),
                        waiting=limiter.statistics().tasks_waiting,
                        bounds=self.bounds,
                        now=time.monotonic(),
                        committed_tokens=self.committed_tokens(),
                    )
                    self._apply(decision, record, observers)
                    await anyio.sleep(interval_s)
        finally:
            self._records.remove(record)
            self._committed.remove(committed)


@dataclass
class AdmissionCall:
    """What one ``generate()`` call brings to the generator's :class:`Admission`: its reader and observers.

    ``read`` is None for a client that cannot report load: the fallback bound, fixed. ``committed``
    holds the call's admitted attempts (the supervisor adds and removes them).
    """

    admission: Admission
    read: LoadReader | None
    client: object
    interval_s: float
    record: AdmissionRecord = field(init=False)
    committed: CommittedContexts = field(init=False, default_factory=CommittedContexts)

    def __post_init__(self) -> None:
        self.record = self.admission.record()
        if self.read is None:
            self.admission.use_fallback(self.record, self.client)

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        return self.admission.limiter

    async def run(self, observers: Observers) -> None:
        """The call's part in following the load (in its task group, cancelled with its last rollout)."""
        if self.read is None:
            return
        await self.admission.drive(self.read, self.record, self.committed, observers, self.interval_s)

    def metrics(self) -> dict[str, float]:
        return self.record.metrics()
