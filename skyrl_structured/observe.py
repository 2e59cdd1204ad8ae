"""Observers: a public hook into what each rollout of a ``generate()`` call does, as it happens.

Subclass :class:`RolloutObserver`, override the events you need and add an instance to
``generator.observers``. The generator calls the observers on the event loop's thread, in the order
they were added; they must return quickly (hand slow work, such as a network call to a dashboard, to
a queue). An observer that raises is logged once and skipped for the rest of that ``generate()``
call: observing never changes a batch's outcome.

The progress bar, the ``skyrl-structured rollout`` command's tally and the test kit are observers
too, so anything they show can be logged elsewhere (W&B, a dashboard, a file) the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CleanupKind", "CleanupOutcome", "RolloutObserver", "RolloutRef"]

logger = logging.getLogger(__name__)

#: What a cleanup event is about: closing the environment, or finishing the inference session.
CleanupKind = Literal["env_close", "finish_session"]
#: How a cleanup ended: it ran to the end, it raised (counted, never fatal), or it overran its bound.
CleanupOutcome = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class RolloutRef:
    """Which rollout an event is about: its input position, its attempt (from 1) and its ids."""

    index: int
    attempt: int
    trajectory_id: Any | None
    session_id: Hashable | None = None


class RolloutObserver:
    """Base class for observers: every event is a no-op until overridden.

    Events of one rollout arrive in this order: ``attempt_started``, ``env_opened``, then one of
    ``attempt_finished`` / ``attempt_failed`` / ``attempt_cancelled`` (with ``cleanup_finished``
    events before it, one per environment close and session finish), repeated per retry, then
    ``rollout_finished`` once (not for a cancelled rollout).
    """

    def batch_started(self, size: int) -> None:
        """A ``generate()`` call starts ``size`` rollouts."""

    def attempt_started(self, rollout: RolloutRef) -> None:
        """An attempt got its slot (see ``max_concurrent_rollouts``) and starts."""

    def env_opened(self, rollout: RolloutRef) -> None:
        """The attempt's environment was created (``skyrl_gym.make`` returned)."""

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        """An attempt returned its trajectory after ``elapsed`` seconds."""

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        """An attempt raised (``timed_out``: it overran ``rollout_timeout_s``); ``will_retry`` says what follows."""

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        """An attempt was cancelled from outside (the caller, or a sibling's failure without skip)."""

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        """An environment close or a session finish ended (``error`` is set when it raised)."""

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        """The rollout's final outcome, after retries: a trajectory, or a failure."""

    def batch_finished(self, size: int, failed: int) -> None:
        """The ``generate()`` call's rollouts are all done (not called when it was cancelled)."""


class Observers:
    """The observers of one ``generate()`` call, each called safely."""

    __slots__ = ("_broken", "_observers")

    def __init__(self, observers: Sequence[RolloutObserver] = ()) -> None:
        self._observers = list(observers)
        self._broken: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._observers)

    def emit(self, event: str, *args: Any, **kwargs: Any) -> None:
        """Call ``event`` on every observer; one that raises is logged and skipped from then on."""
        for position, observer in enumerate(self._observers):
            if position in self._broken:
                continue
            try:
                getattr(observer, event)(*args, **kwargs)
            except Exception:
                self._broken.add(position)
                logger.exception(
                    "observer %r raised in %s; it is skipped for the rest of this generate() call", observer, event
                )
