"""One ``generate()`` call is one task group; each rollout runs in a child scope of it.

A child contains ``Exception`` (timeouts and exception groups included) and lets cancellation
through. Two more cases are decided here, the same way on asyncio and trio:

- an interrupt (``KeyboardInterrupt``, ``SystemExit``) raised inside a rollout, also from an
  environment's worker thread, is held by the child, which cancels the group; once every sibling
  has cleaned up, :func:`run_rollouts` re-raises that interrupt bare;
- a cancellation that no cancel scope of ours caused (a client or environment that raises
  ``CancelledError`` itself) is that rollout's failure, a :class:`RolloutCancelledError`, and so is
  a ``GeneratorExit`` that escapes a rollout.

A failed attempt is retried from scratch (fresh environment, fresh session) up to
``max_rollout_retries`` times, then recorded as a :class:`~skyrl_structured.collect.FailedRollout`.
Without ``skip_failed_rollouts`` the first failure cancels its siblings, which clean up, and
:func:`run_rollouts` raises that original exception once the group has exited.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from ._env_threads import EnvCall, loop_scheduler
from .collect import FailedRollout, check_failure_budget
from .config import ResilienceSettings
from .envs import CleanupStats
from .progress import Progress

__all__ = ["BatchResult", "RolloutAttempt", "RolloutCancelledError", "current_attempt", "run_rollouts"]

logger = logging.getLogger(__name__)


@dataclass
class RolloutAttempt:
    """What one attempt of one rollout has recorded so far; read back if the attempt fails."""

    started: float = field(default_factory=time.monotonic)
    time_splits: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0})
    cleanup: CleanupStats = field(default_factory=CleanupStats)
    #: Closes abandoned after env_cleanup_timeout_s that still run in their worker threads.
    abandoned: list[EnvCall[Any]] = field(default_factory=list)


class RolloutCancelledError(RuntimeError):
    """A rollout raised a cancellation that no cancel scope of the generator's caused.

    Typically an inference client that aborted its request and raised ``CancelledError`` itself.
    It is that rollout's failure like any other error: retried, or a placeholder with
    ``skip_failed_rollouts``, or raised from ``generate()`` without it. ``__cause__`` is the
    original exception.
    """


_CURRENT_ATTEMPT: ContextVar[RolloutAttempt | None] = ContextVar("skyrl_structured_attempt", default=None)


def current_attempt() -> RolloutAttempt:
    """The attempt the calling rollout belongs to (a fresh one when called outside a batch)."""
    attempt = _CURRENT_ATTEMPT.get()
    return attempt if attempt is not None else RolloutAttempt()


@dataclass
class BatchResult:
    """Results in input order (successes and :class:`FailedRollout` markers) and the counters."""

    results: list[Any]
    failures: list[FailedRollout]
    retries: int
    cleanup: CleanupStats


def _backoff(base: float, attempt: int) -> float:
    # Exponential backoff with full jitter: uniform in [0, base * 2**(attempt - 1)].
    return random.uniform(0.0, base * (2 ** (attempt - 1))) if base > 0 else 0.0


def _describe(index: int, trajectory_id: Any | None) -> str:
    if trajectory_id is None:
        return f"rollout {index}"
    to_string = getattr(trajectory_id, "to_string", None)
    return f"rollout {index} ({to_string() if callable(to_string) else trajectory_id})"


def _foreign_cancellation(exc: BaseException) -> bool:
    """True for a cancellation exception that no cancel scope around the caller has caused."""
    native = anyio.get_cancelled_exc_class()
    asyncio_module = sys.modules.get("asyncio")
    # Under trio an asyncio CancelledError is never trio's own cancellation.
    if (
        asyncio_module is not None
        and native is not asyncio_module.CancelledError
        and isinstance(exc, asyncio_module.CancelledError)
    ):
        return True
    return isinstance(exc, native) and anyio.current_effective_deadline() != -math.inf


def _as_rollout_error(exc: BaseException, where: str) -> Exception | None:
    """The error a rollout failed with, or None for what must propagate (our cancellation, interrupts)."""
    if isinstance(exc, Exception):
        return exc
    if _foreign_cancellation(exc):
        error = RolloutCancelledError(
            f"{where} raised {type(exc).__name__} although generate() was not cancelled (an inference client "
            "or environment that cancels its own work); counted as this rollout's failure"
        )
    elif isinstance(exc, GeneratorExit):
        error = RolloutCancelledError(f"{where} raised GeneratorExit; counted as this rollout's failure")
    else:
        return None
    error.__cause__ = exc
    return error


def _interrupt_in(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt``/``SystemExit`` carried by ``exc`` (possibly inside a group), if any."""
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for kind in (KeyboardInterrupt, SystemExit):
            matched, _ = exc.split(kind)
            if matched is not None:
                leaf: BaseException = matched
                while isinstance(leaf, BaseExceptionGroup):
                    leaf = leaf.exceptions[0]
                return leaf
    return None


def _release_when_closed(limiter: anyio.CapacityLimiter, borrower: object, abandoned: list[EnvCall[Any]]) -> None:
    """Free a rollout's slot now, or once the closes it abandoned have run (the env is live until then)."""
    pending = [call for call in abandoned if not call.done]
    if not pending:
        limiter.release_on_behalf_of(borrower)
        return
    remaining = len(pending)

    def one_closed() -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            limiter.release_on_behalf_of(borrower)

    schedule = loop_scheduler()
    for call in pending:
        if not call.add_done_callback(schedule, one_closed):
            one_closed()


def _raise_interrupt(group_error: BaseExceptionGroup[BaseException]) -> None:
    for kind in (KeyboardInterrupt, SystemExit):
        matched, _ = group_error.split(kind)
        if matched is not None:
            leaf: BaseException = matched
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            raise leaf from None


async def run_rollouts(
    count: int,
    rollout: Callable[[int], Awaitable[Any]],
    settings: ResilienceSettings,
    *,
    trajectory_ids: Sequence[Any] | None = None,
    progress: Progress | None = None,
) -> BatchResult:
    """Run ``rollout(i)`` for ``i in range(count)`` concurrently in one task group.

    Raises:
        Exception: without ``skip_failed_rollouts``, the first rollout's original exception, after
            every sibling has been cancelled and has cleaned up.
        RuntimeError: with ``skip_failed_rollouts``, when the failure budget is exceeded; its
            ``__cause__`` is the first failure.
    """
    results: list[Any] = [None] * count
    failures: list[FailedRollout] = []
    cleanup = CleanupStats()
    retries = 0
    first_error: BaseException | None = None
    interrupt: BaseException | None = None
    over_budget = False
    limiter = anyio.CapacityLimiter(settings.max_concurrent_rollouts) if settings.max_concurrent_rollouts else None
    allowed_failures = settings.max_failed_rollout_fraction * count

    async def attempt_once(index: int, attempt: RolloutAttempt, trajectory_id: Any | None) -> Any:
        borrower = object()
        if limiter is not None:
            await limiter.acquire_on_behalf_of(borrower)
        try:
            attempt.started = time.monotonic()
            deadline = settings.rollout_timeout_s
            if deadline is None:
                return await rollout(index)
            with anyio.CancelScope(deadline=anyio.current_time() + deadline) as scope:
                result = await rollout(index)
            if scope.cancelled_caught:
                raise TimeoutError(
                    f"{_describe(index, trajectory_id)} exceeded generator.rollout_timeout_s={deadline:g}s"
                )
            return result
        finally:
            if limiter is not None:
                _release_when_closed(limiter, borrower, attempt.abandoned)

    async def child(index: int, group: anyio.abc.TaskGroup) -> None:
        nonlocal retries, first_error, over_budget, interrupt
        trajectory_id = trajectory_ids[index] if trajectory_ids is not None else None
        attempts = 0
        while True:
            attempts += 1
            attempt = RolloutAttempt(cleanup=cleanup)
            token = _CURRENT_ATTEMPT.set(attempt)
            try:
                result = await attempt_once(index, attempt, trajectory_id)
            except BaseException as raised:
                exc = _as_rollout_error(raised, _describe(index, trajectory_id))
                if exc is None:
                    held = _interrupt_in(raised)
                    if held is None:
                        raise  # our own cancellation
                    # Hold the interrupt until every sibling has cleaned up; asyncio would otherwise
                    # re-raise it straight out of the event loop and leave the others running.
                    if interrupt is None:
                        interrupt = held
                    group.cancel_scope.cancel()
                    return
                elapsed = time.monotonic() - attempt.started
                if attempts <= settings.max_rollout_retries:
                    retries += 1
                    delay = _backoff(settings.rollout_retry_backoff_s, attempts)
                    logger.warning(
                        "%s attempt %d failed with %s: %s; retrying in %.2fs",
                        _describe(index, trajectory_id),
                        attempts,
                        type(exc).__name__,
                        exc,
                        delay,
                    )
                    await anyio.sleep(delay)
                    continue
                failure = FailedRollout(
                    index=index,
                    exception=exc,
                    elapsed=elapsed,
                    attempts=attempts,
                    timed_out=isinstance(exc, TimeoutError),
                    trajectory_id=trajectory_id,
                    time_splits=dict(attempt.time_splits),
                )
                results[index] = failure
                failures.append(failure)
                logger.warning(
                    "%s failed on attempt %d with %s: %s",
                    _describe(index, trajectory_id),
                    attempts,
                    type(exc).__name__,
                    exc,
                )
                if progress is not None:
                    progress.advance(failed=True)
                if not settings.skip_failed_rollouts:
                    if first_error is None:
                        first_error = exc
                    group.cancel_scope.cancel()
                elif settings.failure_budget_action == "raise" and allowed_failures < len(failures) < count:
                    # The budget is already blown and failures only grow: stop spending compute.
                    over_budget = True
                    group.cancel_scope.cancel()
                return
            finally:
                _CURRENT_ATTEMPT.reset(token)
            results[index] = result
            if progress is not None:
                progress.advance(failed=False)
            return

    try:
        async with anyio.create_task_group() as group:
            for index in range(count):
                group.start_soon(child, index, group)
    except BaseExceptionGroup as group_error:
        # Children catch every Exception, so only KeyboardInterrupt/SystemExit-like errors get here:
        # re-raise the interrupt itself, as SkyRL's gather would, so `except KeyboardInterrupt` works.
        if interrupt is not None:
            raise interrupt from None
        _raise_interrupt(group_error)
        raise
    if interrupt is not None:
        raise interrupt
    # A cancellation that arrived while the last rollouts were in shielded cleanup must still reach
    # the caller: a cancelled generate() raises, it never returns a batch.
    await anyio.lowlevel.checkpoint_if_cancelled()

    if first_error is not None:
        raise first_error
    if settings.skip_failed_rollouts:
        failures.sort(key=lambda f: f.index)
        if over_budget or failures:
            check_failure_budget(
                failures, count, settings.max_failed_rollout_fraction, action=settings.failure_budget_action
            )
    return BatchResult(results=results, failures=failures, retries=retries, cleanup=cleanup)
