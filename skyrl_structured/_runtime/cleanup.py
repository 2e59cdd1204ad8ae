"""The cleanup engine: steps run shielded from cancellation, each bounded in time, told how they ended.

An environment's close and its session's end are such steps (:mod:`skyrl_structured.envs`). A
failing step (``GeneratorExit`` included) is logged and counted but never replaces the rollout's
own result or error; one that overruns its bound is abandoned with a warning.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ..observe import CleanupOutcome
from .wakers import Scheduler

logger = logging.getLogger(__name__)


class AbandonedClose(Protocol):
    """A close that cleanup stopped waiting for and that still runs (in its worker thread).

    The rollout's slot stays taken until it is done: the environment is live until then.
    """

    @property
    def done(self) -> bool:
        """Whether the close has returned (or raised)."""
        ...

    def add_done_callback(self, schedule: Scheduler, callback: Callable[[], None]) -> bool:
        """Have ``schedule`` run ``callback`` once the close is done; False if it already is."""
        ...


@dataclass
class CleanupStats:
    """Cleanup trouble seen during one ``generate()`` call (reported in ``rollout_metrics``)."""

    envs_opened: int = 0
    #: Environments whose close ran to the end (successfully or with an error), not abandoned.
    envs_closed: int = 0
    env_close_errors: int = 0
    env_cleanup_timeouts: int = 0
    finish_session_errors: int = 0
    finish_session_timeouts: int = 0
    #: Env worker processes or actors killed because a call overran its deadline (not threads: they cannot be).
    env_workers_killed: int = 0
    #: Env workers that died on their own (segfault, ``os._exit``, the OOM killer).
    env_worker_crashes: int = 0
    #: Environments whose close could not run because their worker had died.
    envs_lost_with_worker: int = 0
    #: Env worker processes stopped and replaced because their memory passed ``env_worker_max_rss_mb``.
    env_workers_recycled: int = 0


def _cleanup_failed(
    what: str,
    cleanup_exc: BaseException,
    error: BaseException | None,
    on_outcome: Callable[[CleanupOutcome, BaseException | None], None],
) -> None:
    """Log a failed cleanup, note it on the rollout's own ``error`` (if any) and report it."""
    logger.warning("%s failed with %s: %s", what, type(cleanup_exc).__name__, cleanup_exc)
    if error is not None and error is not cleanup_exc:
        error.add_note(f"while cleaning up, {what} also failed: {type(cleanup_exc).__name__}: {cleanup_exc}")
    on_outcome("error", cleanup_exc)


class Cleanup(abc.ABC):
    """One step of :func:`run_cleanups`: awaited shielded and bounded, then told how it ended."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        #: Set when :func:`run_cleanups` starts the step: a step runs at most once.
        self.started = False

    @abc.abstractmethod
    def describe(self) -> str:
        """What the step does, for log lines (``closing environment 'x'``)."""

    @abc.abstractmethod
    def run(self) -> Awaitable[Any]:
        """The cleanup itself."""

    @abc.abstractmethod
    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        """Hears once how the step ended (count it, tell the observers)."""


async def run_cleanups(cleanups: Sequence[Cleanup], *, limit_s: float, error: BaseException | None) -> None:
    """Run each step in order, shielded from cancellation and each bounded by ``limit_s`` seconds.

    Each step's ``outcome`` hears once how it ended: ``"ok"``; ``"error"`` with the exception
    (``GeneratorExit`` included), which is logged and noted on ``error``, the exception the rollout
    is already raising, if any; or ``"timeout"``: the step overran and was abandoned. None of them
    stops the next step or replaces the rollout's own outcome. An interrupt (``KeyboardInterrupt``,
    ``SystemExit``) is reported as an error and then propagates.

    The steps share one shielded scope (an environment's close and its session's end cost one
    scope, not two), its deadline set afresh as each step starts; a step that overruns is cancelled
    by it, and the steps after it get a new scope. No shortcut beyond that: two were measured to save
    nothing and went (docs/benchmarks.md, "Cleanup shortcuts: which pay").
    """
    index = 0
    while index < len(cleanups):
        step: Cleanup | None = None
        with anyio.CancelScope(shield=True) as scope:
            while index < len(cleanups) and not scope.cancel_called:
                step = cleanups[index]
                index += 1
                step.started = True
                scope.deadline = anyio.current_time() + limit_s
                try:
                    await step.run()
                except (Exception, GeneratorExit) as cleanup_exc:
                    _cleanup_failed(step.describe(), cleanup_exc, error, step.outcome)
                    continue
                except (KeyboardInterrupt, SystemExit) as interrupt:
                    _cleanup_failed(step.describe(), interrupt, error, step.outcome)
                    raise
                step.outcome("ok", None)
        if scope.cancelled_caught and step is not None:
            logger.warning("%s did not finish within env_cleanup_timeout_s=%gs; abandoned it", step.describe(), limit_s)
            step.outcome("timeout", None)
