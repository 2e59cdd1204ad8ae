"""One ``generate()`` call is one task group; each rollout runs in a child scope of it.

A child catches ``Exception`` (timeouts and exception groups included) and never
``BaseException``: cancellation, ``KeyboardInterrupt`` and ``SystemExit`` always propagate. A
failed attempt is retried from scratch (fresh environment, fresh session) up to
``max_rollout_retries`` times, then recorded as a :class:`~skyrl_structured.collect.FailedRollout`.
Without ``skip_failed_rollouts`` the first failure cancels its siblings, which clean up, and
:func:`run_rollouts` raises that original exception once the group has exited.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from .collect import FailedRollout, check_failure_budget
from .config import ResilienceSettings
from .envs import CleanupStats
from .progress import Progress

__all__ = ["BatchResult", "RolloutAttempt", "current_attempt", "run_rollouts"]

logger = logging.getLogger(__name__)


@dataclass
class RolloutAttempt:
    """What one attempt of one rollout has recorded so far; read back if the attempt fails."""

    started: float = field(default_factory=time.monotonic)
    time_splits: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0})
    cleanup: CleanupStats = field(default_factory=CleanupStats)


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
    over_budget = False
    limiter = anyio.CapacityLimiter(settings.max_concurrent_rollouts) if settings.max_concurrent_rollouts else None
    allowed_failures = settings.max_failed_rollout_fraction * count

    async def child(index: int, group: anyio.abc.TaskGroup) -> None:
        nonlocal retries, first_error, over_budget
        trajectory_id = trajectory_ids[index] if trajectory_ids is not None else None
        attempts = 0
        while True:
            attempts += 1
            attempt = RolloutAttempt(cleanup=cleanup)
            token = _CURRENT_ATTEMPT.set(attempt)
            try:
                slot: AbstractAsyncContextManager[Any] = limiter if limiter is not None else nullcontext()
                async with slot:
                    attempt.started = time.monotonic()
                    deadline = settings.rollout_timeout_s
                    if deadline is None:
                        result = await rollout(index)
                    else:
                        with anyio.CancelScope(deadline=anyio.current_time() + deadline) as scope:
                            result = await rollout(index)
                        if scope.cancelled_caught:
                            raise TimeoutError(
                                f"{_describe(index, trajectory_id)} exceeded generator.rollout_timeout_s={deadline:g}s"
                            )
            except Exception as exc:
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
                elif len(failures) > allowed_failures and len(failures) < count:
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
        _raise_interrupt(group_error)
        raise
    # A cancellation that arrived while the last rollouts were in shielded cleanup must still reach
    # the caller: a cancelled generate() raises, it never returns a batch.
    await anyio.lowlevel.checkpoint_if_cancelled()

    if first_error is not None:
        raise first_error
    if settings.skip_failed_rollouts:
        failures.sort(key=lambda f: f.index)
        if over_budget or failures:
            check_failure_budget(failures, count, settings.max_failed_rollout_fraction)
    return BatchResult(results=results, failures=failures, retries=retries, cleanup=cleanup)
