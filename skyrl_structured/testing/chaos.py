"""Chaos wrappers: make any inference client or environment fail, hang or slow down on purpose.

A :class:`ChaosPolicy` decides, for the n-th call of a stage, whether that call fails, hangs, is
slowed down or runs normally. The decision depends only on ``(seed, stage, n)``, so a run with the
same seed and the same number of calls per stage injects the same faults: when rollouts run
concurrently, *which* rollout makes the n-th call may vary, but the n-th call's fate does not.

- :class:`ChaosEngine` wraps an inference client (stages ``generate`` and ``finish_session``).
- :func:`register_chaos_env` registers a ``skyrl_gym`` id wrapping an environment class (stages
  ``create``, ``init``, ``step`` and ``close``).

Where a fault lands: before the real call for ``generate``, ``create``, ``init`` and ``step`` (the
engine or environment never sees that call); *after* the real call for ``finish_session`` and
``close``, so a cleanup fault never leaves a real resource open behind it.

What a fault does:

- **failure** raises :class:`ChaosError` (or ``exception(message)`` when ``exception`` is given);
- **slow** sleeps ``slow_s`` seconds (``anyio.sleep`` in async calls, ``time.sleep`` in sync ones);
- **hang** in an async call waits until cancelled; in a synchronous environment call (a worker
  thread, or the event loop itself when ``max_env_workers=0`` or at ``create``, which
  ``skyrl_gym.make`` runs inline) it blocks for at most ``sync_hang_s`` seconds (default 300), or
  until :meth:`ChaosPolicy.release_hangs` is called, and then raises :class:`ChaosError`. Call
  ``release_hangs()`` when you are done (the ``chaos_policy`` fixture does): anyio's asyncio worker
  threads are not daemon threads, so a process with a hung one waits for it at exit.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ..engines._wrapper import EngineWrapper
from ..types import InferenceClient
from ._wrappers import ENV_STAGES, register_wrapper_env

__all__ = [
    "ENGINE_STAGES",
    "STAGES",
    "ChaosEngine",
    "ChaosError",
    "ChaosEvent",
    "ChaosPolicy",
    "register_chaos_env",
]

#: Stages of an inference client that :class:`ChaosEngine` can disturb.
ENGINE_STAGES = ("generate", "finish_session")
#: Every stage a policy accepts (``"any"`` means all of them).
STAGES = ENGINE_STAGES + ENV_STAGES

FaultKind = Literal["failure", "hang", "slow"]


class ChaosError(RuntimeError):
    """A failure injected by a :class:`ChaosPolicy`; the message names the stage and the call."""

    def __init__(self, message: str, *, stage: str, call: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.call = call


@dataclass(frozen=True)
class ChaosEvent:
    """One fault a policy injected: the stage, the 1-based call number within it, and the kind."""

    stage: str
    call: int
    kind: FaultKind


def _check_rate(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be a probability within [0, 1], got {value!r}")


@dataclass
class ChaosPolicy:
    """Which calls to disturb, and how.

    Args:
        failure_rate: probability that a call raises.
        hang_rate: probability that a call hangs (see the module docstring for the sync bound).
        slow_rate: probability that a call first sleeps ``slow_s`` seconds, then runs normally.
        slow_s: the delay of a slow call, in seconds.
        stage: one of :data:`STAGES`, or ``"any"`` for every stage of whatever is wrapped.
        seed: decisions are a pure function of ``(seed, stage, call number)``.
        exception: an exception class raised (with the message) instead of :class:`ChaosError`.
        sync_hang_s: the most a hang blocks a synchronous environment call, in seconds.

    Raises:
        ValueError: a rate outside [0, 1], rates summing past 1, an unknown stage, a negative
            duration or an ``exception`` that is not an exception class (the message names it).
    """

    failure_rate: float = 0.0
    hang_rate: float = 0.0
    slow_rate: float = 0.0
    slow_s: float = 0.5
    stage: str = "generate"
    seed: int = 0
    exception: type[BaseException] | None = None
    sync_hang_s: float = 300.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _calls: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _events: list[ChaosEvent] = field(default_factory=list, init=False, repr=False, compare=False)
    _release: threading.Event = field(default_factory=threading.Event, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("failure_rate", "hang_rate", "slow_rate"):
            _check_rate(name, getattr(self, name))
        total = self.failure_rate + self.hang_rate + self.slow_rate
        if total > 1.0 + 1e-12:
            raise ValueError(
                f"`failure_rate + hang_rate + slow_rate` must be at most 1, got {total:g}; "
                "each call gets at most one fault"
            )
        if self.stage != "any" and self.stage not in STAGES:
            raise ValueError(f"`stage` must be 'any' or one of {', '.join(STAGES)}; got {self.stage!r}")
        for name in ("slow_s", "sync_hang_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative number of seconds, got {value!r}")
        if self.exception is not None and not (
            isinstance(self.exception, type) and issubclass(self.exception, BaseException)
        ):
            raise ValueError(f"`exception` must be an exception class (e.g. ConnectionError), got {self.exception!r}")

    # ------------------------------------------------------------------ decisions

    def applies_to(self, stage: str) -> bool:
        """Whether this policy disturbs ``stage`` at all."""
        return self.stage in ("any", stage)

    def decide(self, stage: str, call: int) -> FaultKind | None:
        """The fate of the ``call``-th (1-based) call of ``stage``: a fault kind, or None.

        Pure: the same arguments always give the same answer, whatever ran before.
        """
        if not self.applies_to(stage):
            return None
        draw = random.Random(f"{self.seed}:{stage}:{call}").random()
        if draw < self.failure_rate:
            return "failure"
        if draw < self.failure_rate + self.hang_rate:
            return "hang"
        if draw < self.failure_rate + self.hang_rate + self.slow_rate:
            return "slow"
        return None

    def _next(self, stage: str) -> tuple[int, FaultKind | None]:
        with self._lock:
            call = self._calls.get(stage, 0) + 1
            self._calls[stage] = call
            kind = self.decide(stage, call)
            if kind is not None:
                self._events.append(ChaosEvent(stage, call, kind))
        return call, kind

    def _error(self, stage: str, call: int, what: str = "failure") -> BaseException:
        message = f"chaos: injected {what} at stage {stage!r}, call {call} (seed={self.seed})"
        if self.exception is not None:
            return self.exception(message)
        return ChaosError(message, stage=stage, call=call)

    # ------------------------------------------------------------------ injection

    def _draw(self, stage: str) -> tuple[int, FaultKind | None] | None:
        """The next disturbance of one ``stage`` call as ``(call, kind)``; None where the stage is spared.

        Raises:
            ChaosError: the drawn disturbance is a failure (the same in sync and async calls).
        """
        if not self.applies_to(stage):
            return None
        call, kind = self._next(stage)
        if kind == "failure":
            raise self._error(stage, call)
        return call, kind

    def inject(self, stage: str) -> None:
        """Disturb one synchronous call of ``stage`` (in whatever thread makes it)."""
        drawn = self._draw(stage)
        if drawn is None:
            return
        call, kind = drawn
        if kind == "slow":
            time.sleep(self.slow_s)
        elif kind == "hang":
            started = time.monotonic()
            released = self._release.wait(self.sync_hang_s)
            how = "released" if released else "hit its bound"
            raise self._error(stage, call, f"hang ({how} after {time.monotonic() - started:.3g}s)")

    async def ainject(self, stage: str) -> None:
        """Disturb one async call of ``stage``; a hang waits until the caller is cancelled."""
        drawn = self._draw(stage)
        if drawn is None:
            return
        _, kind = drawn
        if kind == "slow":
            await anyio.sleep(self.slow_s)
        elif kind == "hang":
            await anyio.sleep_forever()

    # ------------------------------------------------------------------ bookkeeping

    @property
    def events(self) -> list[ChaosEvent]:
        """Every fault injected so far, in the order they were decided."""
        with self._lock:
            return list(self._events)

    def calls(self, stage: str) -> int:
        """How many calls of ``stage`` this policy has seen."""
        with self._lock:
            return self._calls.get(stage, 0)

    def release_hangs(self) -> None:
        """End every synchronous hang now (and make later ones end at once); call it at teardown."""
        self._release.set()

    def reset(self) -> None:
        """Forget calls and events (the next call of each stage is call 1 again).

        Hangs in progress are released; later ones block again.
        """
        with self._lock:
            self._calls.clear()
            self._events.clear()
            self._release.set()
            self._release = threading.Event()

    # env hook protocol (see _wrappers.EnvHook): faults before init/step/create, after close.

    def before(self, stage: str, tag: Any) -> None:
        if stage != "close":
            self.inject(stage)

    def after(self, stage: str, tag: Any) -> None:
        if stage == "close":
            self.inject(stage)

    async def abefore(self, stage: str, tag: Any) -> None:
        if stage != "close":
            await self.ainject(stage)

    async def aafter(self, stage: str, tag: Any) -> None:
        if stage == "close":
            await self.ainject(stage)


class ChaosEngine(EngineWrapper):
    """An inference client that disturbs another one according to ``policy``.

    ``generate`` faults land before the wrapped call; ``finish_session`` faults after it (the
    session is really finished first). Every other attribute (``weight_version``, ``sleep``, ...)
    is the wrapped engine's.
    """

    def __init__(self, engine: InferenceClient, policy: ChaosPolicy) -> None:
        super().__init__(engine)
        self.policy = policy

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        await self.policy.ainject("generate")
        return await super().generate(input_batch, *args, **kwargs)

    async def finish_session(self, session_id: Hashable) -> None:
        await super().finish_session(session_id)
        await self.policy.ainject("finish_session")


def register_chaos_env(inner_env_class: str, policy: ChaosPolicy, env_id: str | None = None) -> str:
    """Register with ``skyrl_gym`` an environment id that wraps ``inner_env_class`` with ``policy``.

    The wrapper creates the inner environment through ``skyrl_gym.make`` and injects the policy's
    faults at ``create``, ``init``, ``step`` and ``close``. Use the returned id as ``env_class`` in
    a batch. ``env_id`` defaults to a fresh ``"<inner>+chaos-<n>"``.

    Raises:
        ValueError: ``inner_env_class`` is not registered, or ``env_id`` belongs to another env.
    """
    return register_wrapper_env(inner_env_class, hooks=[policy], env_id=env_id, kind="chaos")
