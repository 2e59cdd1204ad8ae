"""The admission controller of ``max_concurrent_rollouts="auto"``: a pure function of the engines' load.

:func:`decide` takes the controller's state, one reading of every engine server
(:class:`~skyrl_structured.engines.load.EngineLoad`), how many rollouts hold or wait for a slot and
the context those holding one have committed to the engines, and returns the new limit with the
reason for it. No clock, no I/O: the generator's driver (:mod:`~skyrl_structured._runtime.slots`)
calls it at a bounded rate and applies the limit.

Two measures of how full the KV cache is. The fullest server's usage ``kv`` counts the blocks of
requests *at* the engine; a multi-turn rollout whose environment is stepping has none there (its
history sits in the prefix cache, counted free, and is evicted under pressure), so ``kv`` misses
what the admitted rollouts will ask on their next turns. The *committed* fraction ``c`` counts
them: the context each admitted rollout holds (its latest engine call's prompt and response, in
tokens; one admitted without a call yet counts as the mean of the others) summed over the
generator's rollouts, over the KV capacity of the servers read (``EngineLoad.kv_capacity_tokens``).
``c`` is known only when every server read says its capacity and some admitted rollout has made a
call (or none is admitted); it overcounts prompts that share a prefix (vLLM stores them once) and
can pass 1. Where the controller reads a fullness ``u`` below, it is ``max(kv, c)``, and ``kv``
alone when ``c`` is unknown (the policy is then exactly the one without it).

The policy is AIMD (additive-increase, multiplicative-decrease, TCP's congestion control) with the
increase tapered by KV-cache headroom, as prime-rl validated it (prime-rl #3285, #3556):

- **grow** while rollouts wait for a slot and ``u`` is below the target ``t`` (default 0.8): the
  limit becomes ``max(limit + 1, floor(limit * (1 + 0.2 * (1 - u / t))))``, 1.2x at an empty
  cache tapering to +1 near the target. Multiplicative while there is room, so a limit far too low
  reaches the engines' capacity in a few readings; tapered, so it approaches the soft cap instead
  of jumping over it (KV usage lags admission: a new rollout fills its cache only once its prompt
  is prefilled). The committed fraction gets no faster growth of its own: it counts each rollout's
  context now, while its later turns add to it, so a limit grown on it far below the target
  overshoots (a version that grew 2.2x at an empty cache took the benchmark's limit to 33 and
  preempted more than all at once in a lane run).
- **hold** at or above the target (``u >= t``), while no rollout waits (a limit nobody uses is no
  evidence of room), on a reading no newer than the last change (its effect cannot show yet), and
  without a reading at all.
- **cut** to ``floor(limit * 0.7)`` on new preemptions (the engine evicted running requests to make
  room: the cache is oversubscribed now) or on requests queued at a server whose fullness
  (``max(its kv, c)``) is past the target (the next turns will be preempted or wait). A queue
  with cache to spare is the server's ``max_num_seqs`` cap, not memory: that holds. 0.7 rather
  than TCP's 0.5 because an admitted rollout is never stopped, so a cut acts only as rollouts
  finish; halving would idle the engines for the whole drain after a single burst. One cut per
  drain: while more rollouts hold a slot than the limit allows, the signal still reflects the old
  limit, and cutting again would overshoot.

Servers' counters are cumulative; a counter lower than last seen is a restarted server, whose count
since the restart is all new. A server seen for the first time sets its baseline (its history is
not this run's doing), and so does every server when a ``generate()`` call starts while none of
the generator's calls runs (:meth:`AdmissionState.resumed`): what the servers counted between
calls (a weight sync, another generator's batch) is not this generator's doing either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

__all__ = [
    "CUT_FACTOR",
    "GROWTH",
    "AdmissionBounds",
    "AdmissionState",
    "Decision",
    "LoadReading",
    "Reason",
    "committed_fraction",
    "decide",
]

#: Growth per reading at an empty KV cache (1.2x, prime-rl's), tapering to +1 at the target.
GROWTH = 0.2
#: What a cut keeps of the limit.
CUT_FACTOR = 0.7

#: Why the limit is what it is after a reading: ``grow``/``cut_*`` change it, ``hold_*`` keep it.
Reason = Literal[
    "grow",
    "cut_preempted",
    "cut_queued",
    "hold_kv_target",
    "hold_queued",
    "hold_no_demand",
    "hold_draining",
    "hold_stale",
    "hold_no_signal",
    "hold_bound",
]


class LoadReading(Protocol):
    """What the controller reads of one server's :class:`~skyrl_structured.engines.load.EngineLoad`
    (named structurally: the runtime sits below the engines)."""

    @property
    def server(self) -> str: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def requests_waiting(self) -> int: ...
    @property
    def preemptions_total(self) -> int: ...
    @property
    def at(self) -> float: ...
    @property
    def kv_capacity_tokens(self) -> int | None: ...


@dataclass(frozen=True)
class AdmissionBounds:
    """The knobs: the limit stays within ``[floor, ceiling]`` (no ceiling: None) and aims below ``kv_target``."""

    floor: int
    ceiling: int | None
    kv_target: float


@dataclass(frozen=True)
class AdmissionState:
    """What the controller remembers between readings."""

    limit: int
    #: Each server's ``preemptions_total`` when last read.
    preemptions: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: ``time.monotonic()`` of the last change (a reading taken before it cannot show its effect).
    changed_at: float = -math.inf

    @classmethod
    def start(cls, bounds: AdmissionBounds) -> AdmissionState:
        """The first state: the limit at the floor, the one value known to fit."""
        return cls(limit=bounds.floor)

    def resumed(self) -> AdmissionState:
        """The state for a call that starts while none runs: the limit kept, every server's baseline taken afresh."""
        return AdmissionState(self.limit, changed_at=self.changed_at)


@dataclass(frozen=True)
class Decision:
    """The state after a reading, why, and what the reading said."""

    state: AdmissionState
    reason: Reason
    #: The fullest server's KV-cache usage (None without a reading).
    kv_cache_usage: float | None
    #: Preemptions since the previous reading, over every server.
    new_preemptions: int
    #: The committed context over the servers' KV capacity (None: unknown; see the module's docstring).
    committed_kv: float | None = None

    @property
    def limit(self) -> int:
        return self.state.limit


def _new_preemptions(state: AdmissionState, readings: Sequence[LoadReading]) -> tuple[int, dict[str, int]]:
    seen = dict(state.preemptions)
    new = 0
    for reading in readings:
        total = reading.preemptions_total
        before = seen.get(reading.server)
        if before is not None:
            new += total - before if total >= before else total  # lower: restarted, all of it is new
        seen[reading.server] = total
    return new, seen


def _clamp(limit: int, bounds: AdmissionBounds) -> int:
    limit = max(limit, bounds.floor)
    return min(limit, bounds.ceiling) if bounds.ceiling is not None else limit


def committed_fraction(committed_tokens: float | None, readings: Sequence[LoadReading]) -> float | None:
    """``committed_tokens`` over the KV capacity of the servers in ``readings``; None when either is unknown.

    Every server read must say its capacity: the rollouts' contexts are spread over all of them.
    """
    if committed_tokens is None or not readings:
        return None
    capacity = 0
    for reading in readings:
        tokens = reading.kv_capacity_tokens
        if tokens is None or tokens <= 0:
            return None
        capacity += tokens
    return committed_tokens / capacity


def decide(
    state: AdmissionState,
    readings: Sequence[LoadReading],
    *,
    admitted: int,
    waiting: int,
    bounds: AdmissionBounds,
    now: float,
    committed_tokens: float | None = None,
) -> Decision:
    """The limit after ``readings`` (one per server, possibly none), with ``admitted`` rollouts holding a
    slot and ``waiting`` more waiting for one; ``now`` is ``time.monotonic()``, recorded on a change.

    ``committed_tokens`` is the context the admitted rollouts hold, in tokens (None: not measured);
    with the servers' capacity it gives the committed fraction the module's docstring describes.
    """
    if not readings:
        return Decision(state, "hold_no_signal", None, 0)
    new_preemptions, seen = _new_preemptions(state, readings)
    kv = max(reading.kv_cache_usage for reading in readings)
    committed = committed_fraction(committed_tokens, readings)
    fill = kv if committed is None else max(kv, committed)
    # The committed share is the servers' together: taken as each one's (the rollouts spread over them).
    floor_fill = 0.0 if committed is None else committed
    queued = sum(
        reading.requests_waiting for reading in readings if max(reading.kv_cache_usage, floor_fill) >= bounds.kv_target
    )
    base = AdmissionState(state.limit, MappingProxyType(seen), state.changed_at)

    def hold(reason: Reason) -> Decision:
        return Decision(base, reason, kv, new_preemptions, committed)

    def change(limit: int, reason: Reason) -> Decision:
        limit = _clamp(limit, bounds)
        if limit == state.limit:
            return hold("hold_bound")
        return Decision(AdmissionState(limit, base.preemptions, now), reason, kv, new_preemptions, committed)

    # Preemptions are counted since the last reading, so they are news even on a reading taken
    # before the last change; a queue is a level, read afresh only after it.
    stale = max(reading.at for reading in readings) <= state.changed_at
    pressure: Reason | None = "cut_preempted" if new_preemptions > 0 else None
    if pressure is None and stale:
        return hold("hold_stale")
    if pressure is None and queued > 0:
        pressure = "cut_queued"
    if pressure is not None:
        if admitted > state.limit:
            return hold("hold_draining")
        return change(math.floor(state.limit * CUT_FACTOR), pressure)
    if fill >= bounds.kv_target:
        return hold("hold_kv_target")
    if any(reading.requests_waiting > 0 for reading in readings):
        return hold("hold_queued")
    if waiting <= 0:
        return hold("hold_no_demand")
    grown = math.floor(state.limit * (1.0 + GROWTH * (1.0 - fill / bounds.kv_target)))
    return change(max(state.limit + 1, grown), "grow")
