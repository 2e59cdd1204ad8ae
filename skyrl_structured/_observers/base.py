"""What observers are: the events (:class:`RolloutObserver`), the records they receive, and the fan-out.

The public face is :mod:`skyrl_structured.observe`, which re-exports these names with the shipped
observers (:mod:`~skyrl_structured._observers.trace`, ``otel``, ``prometheus``); those observers
subclass :class:`RolloutObserver` from here, so nothing imports the facade back.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, Protocol

from ..errors import StragglerCutError
from ..types import ROLLOUT_ERROR_STOP_REASON, RolloutOutput, TrajectoryID

__all__ = [
    "BatchEvent",
    "CleanupKind",
    "CleanupOutcome",
    "EndpointWorker",
    "EngineRoute",
    "EnvMethod",
    "FinishedTrajectory",
    "Observers",
    "RolloutEmitter",
    "RolloutEvent",
    "RolloutObserver",
    "RolloutRef",
    "TrajectoryStep",
    "failed_record",
    "finished_record",
]

# The public module's name: users configure the logger of what they import (skyrl_structured.observe).
logger = logging.getLogger("skyrl_structured.observe")

_P = ParamSpec("_P")

#: How a cut rollout's ``FinishedTrajectory.error`` starts (the error is ``"Type: message"``).
_CUT_PREFIX = f"{StragglerCutError.__name__}: "

#: What a cleanup event is about: closing the environment, or finishing the inference session.
CleanupKind = Literal["env_close", "finish_session"]
#: How a cleanup ended: it ran to the end, it raised (counted, never fatal), or it overran its bound.
CleanupOutcome = Literal["ok", "error", "timeout"]
#: Which environment method a call event is about.
EnvMethod = Literal["init", "step"]


class EngineRoute(Protocol):
    """One engine server as an inference client's routing sees it
    (:class:`~skyrl_structured.engines.routing.ServerRoute`, named structurally)."""

    @property
    def server(self) -> str: ...
    @property
    def up(self) -> bool: ...
    @property
    def sessions(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def placed_total(self) -> int: ...
    @property
    def load(self) -> float: ...
    @property
    def read(self) -> bool: ...
    @property
    def past_bound(self) -> bool: ...


class EndpointWorker(Protocol):
    """One slot of the agent endpoint's worker processes (``generator.agent_endpoint_workers``), read now
    (:class:`~skyrl_structured.agents._readings.WorkerReading`, named structurally)."""

    @property
    def index(self) -> int: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def port(self) -> int: ...
    @property
    def up(self) -> bool: ...
    @property
    def sessions(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    @property
    def sessions_lost(self) -> int: ...


@dataclass(frozen=True)
class RolloutRef:
    """Which rollout an event is about: its input position, its attempt (from 1) and its ids."""

    index: int
    attempt: int
    trajectory_id: TrajectoryID | None
    session_id: Hashable | None = None


@dataclass(frozen=True)
class TrajectoryStep:
    """One training row of a finished rollout, as the rollout produced it.

    A rollout has one step, or one per turn with ``step_wise_trajectories``. The values are the
    rollout's own: the batch-level policies that ``generate()`` applies afterwards to its
    ``GeneratorOutput`` (``failed_rollout_policy``, ``apply_overlong_filtering``,
    ``zero_reward_on_non_stop``) are not in them.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    #: A float, or one float per response token (token-level rewards).
    reward: float | tuple[float, ...]
    stop_reason: str
    #: One logprob per response token when the sampling parameters asked for them, else None.
    logprobs: tuple[float, ...] | None = None

    @property
    def total_reward(self) -> float:
        """The step's reward as one number (token-level rewards summed)."""
        return float(sum(self.reward)) if isinstance(self.reward, tuple) else float(self.reward)


@dataclass(frozen=True)
class FinishedTrajectory:
    """What one rollout produced, final after its retries: its steps, or the error it failed with.

    A failed rollout has no steps (its placeholder is built only once the whole batch is known);
    ``error`` says why it failed.
    """

    #: The rollout's position in the batch.
    index: int
    trajectory_id: TrajectoryID | None
    env_class: str
    #: Attempts made, from 1 (retries + 1).
    attempts: int
    #: Seconds the last attempt ran.
    elapsed: float
    steps: tuple[TrajectoryStep, ...] = ()
    #: ``"Type: message"`` of the exception a failed rollout raised; None for a success.
    error: str | None = None
    #: A failed rollout whose last attempt overran ``rollout_timeout_s``.
    timed_out: bool = False
    #: Whether the generator returns this rollout turn by turn (``step_wise_trajectories``).
    step_wise: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def cut(self) -> bool:
        """Whether the straggler cutoff ended it (``generator.straggler_cutoff``): a policy, not an error.

        A cut rollout is ``failed`` too (it has no steps and becomes a placeholder); counts that
        tell errors from the cutoff's choice read this.
        """
        return self.error is not None and self.error.startswith(_CUT_PREFIX)

    @property
    def reward(self) -> float:
        """The rollout's reward as one number: its last step's (0.0 for a failed rollout)."""
        return self.steps[-1].total_reward if self.steps else 0.0

    @property
    def stop_reason(self) -> str:
        """The last step's stop reason; ``"rollout_error"`` for a failed rollout."""
        return self.steps[-1].stop_reason if self.steps else ROLLOUT_ERROR_STOP_REASON


class RolloutObserver:
    """Base class for observers: every event is a no-op until overridden.

    Events of one rollout arrive in this order: ``attempt_started``, ``env_opened``, the turns
    (``env_call_started``/``env_call_finished`` for ``init``, then per turn ``engine_call_*`` and
    ``env_call_*`` for ``step``), then one of ``attempt_finished`` / ``attempt_failed`` /
    ``attempt_cancelled`` (with ``cleanup_started``/``cleanup_finished`` before it, one pair per
    environment close and session finish), then ``retry_backoff`` before a retry, repeated per
    retry, then ``trajectory_finished`` and ``rollout_finished`` once each (neither for a
    cancelled rollout). A batch ends with ``batch_finished``, or with ``batch_aborted`` when
    ``generate()`` raises.
    """

    def batch_started(self, size: int) -> None:
        """A ``generate()`` call starts ``size`` rollouts."""

    def attempt_started(self, rollout: RolloutRef) -> None:
        """An attempt got its slot (see ``max_concurrent_rollouts``) and starts."""

    def env_opened(self, rollout: RolloutRef) -> None:
        """The attempt's environment was created (``skyrl_gym.make`` returned)."""

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        """The environment's ``init`` (``turn`` 0) or ``step`` (``turn`` from 0) starts."""

    def env_call_finished(self, rollout: RolloutRef, method: EnvMethod, turn: int, error: BaseException | None) -> None:
        """That call returned, or raised ``error`` (a cancellation included)."""

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        """The rollout sends engine request ``turn`` (from 0) with ``prompt_tokens`` input ids."""

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        """The reply came back and passed its check, or (``error`` set, the rest None) the call or the check raised."""

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        """An attempt returned its trajectory after ``elapsed`` seconds."""

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        """An attempt raised (``timed_out``: it overran ``rollout_timeout_s``); ``will_retry`` says what follows."""

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        """An attempt was cancelled from outside (the caller, or a sibling's failure without skip)."""

    def retry_backoff(self, rollout: RolloutRef, delay: float) -> None:
        """A failed attempt will be retried after sleeping ``delay`` seconds (after its ``attempt_failed``)."""

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        """An environment close or a session finish starts."""

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        """An environment close or a session finish ended (``error`` is set when it raised)."""

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        """The rollout's final result, after retries: its steps, or (``trajectory.failed``) its error."""

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        """The rollout's final outcome, after retries: a trajectory, or a failure."""

    def batch_finished(self, size: int, failed: int) -> None:
        """The ``generate()`` call's rollouts are all done (not called when it was cancelled)."""

    def admission_decided(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        """``max_concurrent_rollouts="auto"`` read the engines' load (at most once per ``admission_interval_s``).

        ``limit`` is the admission limit now and ``previous`` the one before; ``reason`` says why
        (``grow``, ``cut_preempted``, ``cut_queued``, or a ``hold_*`` reason when it did not change);
        ``kv_cache_usage`` is the fullest server's KV-cache usage (0-1), None without a reading.
        Heard by the observers of the call whose rollouts drive the limit at that moment.
        """

    def engine_routes_read(self, routes: Sequence[EngineRoute]) -> None:
        """The inference client routes over several servers (``HTTPEngine`` with more than one ``base_urls``):
        where its sessions are and each server's load, read about once a second while the call runs and
        at its end (``routes``: one per server, in the client's order). Heard by every running call's observers.
        """

    def endpoint_workers_read(self, workers: Sequence[EndpointWorker]) -> None:
        """The agent capture endpoint runs in worker processes (``generator.agent_endpoint_workers`` above 0):
        each slot's worker, read when the call starts, about once a second while it runs, as soon as a worker
        dies or its replacement is ready, and at the call's end (``workers``: one per slot, by ``index``).
        ``pid`` is None while a worker starts; ``up`` says it is alive and ready; ``sessions`` are the open
        sessions placed on it; ``restarts`` and ``sessions_lost`` count the slot's replacements and the
        sessions its deaths failed. Heard by the observers of every ``generate()`` call the endpoint serves.
        """

    def batch_aborted(self, size: int, error: BaseException) -> None:
        """The ``generate()`` call stops without its rollouts all done and raises ``error``.

        It was cancelled (``error`` is the backend's cancellation), interrupted, or a rollout failed
        without ``skip_failed_rollouts``. Either this or ``batch_finished`` ends every batch.
        """


#: An event of a batch: a method of :class:`RolloutObserver` itself (``RolloutObserver.batch_started``).
BatchEvent = Callable[Concatenate[RolloutObserver, _P], None]
#: An event of one rollout: a method of :class:`RolloutObserver` whose first argument is the :class:`RolloutRef`.
RolloutEvent = Callable[Concatenate[RolloutObserver, RolloutRef, _P], None]


class Observers:
    """The observers of one ``generate()`` call, each called safely.

    An event is named by the base class's method itself, never by a string, so a misspelt event
    is an ``AttributeError`` where it is written and mypy checks its arguments against the
    method's signature: ``observers.emit(RolloutObserver.batch_started, size)``.
    """

    __slots__ = ("_broken", "_hearing", "_observers")

    def __init__(self, observers: Sequence[RolloutObserver] = ()) -> None:
        self._observers = list(observers)
        self._broken: set[int] = set()
        # The observers are fixed for the call: who hears an event is decided once per event, and
        # their methods are bound once (an event is emitted a few times per turn of every rollout).
        self._hearing: dict[Callable[..., None], tuple[str, list[tuple[int, Callable[..., None]]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._observers)

    def _listeners(self, event: Callable[..., None]) -> tuple[str, list[tuple[int, Callable[..., None]]]]:
        """The event's name and (position, bound method) of the observers whose class overrides it."""
        hearing = self._hearing.get(event)
        if hearing is None:
            name = getattr(event, "__name__", "")
            if getattr(RolloutObserver, name, None) is not event:
                raise TypeError(f"{event!r} is not an event: pass a method of RolloutObserver itself")
            hearing = self._hearing[event] = (
                name,
                [
                    (position, getattr(observer, name))
                    for position, observer in enumerate(self._observers)
                    if getattr(type(observer), name, event) is not event
                ],
            )
        return hearing

    def wants(self, event: BatchEvent[...]) -> bool:
        """Whether any observer overrides ``event`` (so a costly argument is built only when heard)."""
        return bool(self._listeners(event)[1])

    def emit(self, event: BatchEvent[_P], /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Call ``event`` on every observer that overrides it; one that raises is logged and skipped from then on.

        "Raises" includes a ``CancelledError`` an observer raises itself: no cancel scope delivers one
        into a synchronous method, so it is the observer's error, never the batch's cancellation.

        Observers that keep the base class's do-nothing method are not called at all (that is most
        observers for most events, several times per rollout).

        Raises:
            TypeError: ``event`` is not one of :class:`RolloutObserver`'s own methods (a bug of
                the caller's, never of an observer's).
        """
        hearing = self._hearing.get(event) or self._listeners(event)
        for position, method in hearing[1]:
            if position in self._broken:
                continue
            try:
                method(*args, **kwargs)
            except BaseException as exc:
                # An observer's method is synchronous: a cancellation it raises was never delivered
                # by a cancel scope (they land at awaits), so it is the observer's bug like any
                # other error, not the batch's cancellation (issue 27).
                if not isinstance(exc, Exception) and not _is_cancellation(exc):
                    raise
                self._broken.add(position)
                logger.exception(
                    "observer %r raised in %s; it is skipped for the rest of this generate() call",
                    self._observers[position],
                    hearing[0],
                )


def _is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is asyncio's or trio's cancellation (looked up only where imported)."""
    for module_name, name in (("asyncio", "CancelledError"), ("trio", "Cancelled")):
        module = sys.modules.get(module_name)
        kind = getattr(module, name, None) if module is not None else None
        if isinstance(kind, type) and isinstance(exc, kind):
            return True
    return False


class RolloutEmitter(Protocol):
    """Tells a rollout's observers an event about it: ``emit(RolloutObserver.env_opened)``.

    The rollout (a :class:`RolloutRef`) is filled in; the other arguments are the event's own.
    """

    def __call__(self, event: RolloutEvent[_P], /, *args: _P.args, **kwargs: _P.kwargs) -> None: ...


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _step(output: Any) -> TrajectoryStep:
    reward = output.reward
    logprobs = output.rollout_logprobs
    return TrajectoryStep(
        prompt_ids=_ints(output.prompt_ids),
        response_ids=_ints(output.response_ids),
        loss_mask=_ints(output.loss_mask),
        reward=tuple(float(r) for r in reward) if isinstance(reward, list | tuple) else float(reward),
        stop_reason=str(output.stop_reason),
        logprobs=tuple(float(p) for p in logprobs) if logprobs is not None else None,
    )


def finished_record(
    rollout: RolloutRef, output: RolloutOutput, *, env_class: str, elapsed: float
) -> FinishedTrajectory:
    """The record of a successful rollout from its ``TrajectoryOutput`` or ``StepWiseOutput``."""
    steps = getattr(output, "step_outputs", None)
    return FinishedTrajectory(
        index=rollout.index,
        trajectory_id=rollout.trajectory_id,
        env_class=env_class,
        attempts=rollout.attempt,
        elapsed=elapsed,
        steps=tuple(_step(step) for step in steps) if steps is not None else (_step(output),),
        step_wise=steps is not None,
    )


def failed_record(
    rollout: RolloutRef, error: str, *, env_class: str, elapsed: float, timed_out: bool, step_wise: bool
) -> FinishedTrajectory:
    """The record of a rollout that failed on its last attempt."""
    return FinishedTrajectory(
        index=rollout.index,
        trajectory_id=rollout.trajectory_id,
        env_class=env_class,
        attempts=rollout.attempt,
        elapsed=elapsed,
        error=error,
        timed_out=timed_out,
        step_wise=step_wise,
    )
