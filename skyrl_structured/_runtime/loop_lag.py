"""Event-loop lag during ``generate()``: how late the loop runs what is ready to run.

A sampler task sleeps ``interval`` seconds again and again; how much later than asked it wakes
is the lag every rollout's next step saw at that moment (an engine reply waiting to be read, an
env step's result waiting to be handed back). It is the same measure on asyncio and trio: the
loop's own clock (``anyio.current_time``) around ``anyio.sleep``. A sample still pending when the
batch ends counts for the time it has overrun so far, so a loop blocked to the very end (a sync
call on the loop) is still seen.

Reported in ``rollout_metrics`` as ``generate/event_loop_lag_mean`` and
``generate/event_loop_lag_max`` (seconds; SkyRL's ``concatenate_generator_outputs`` averages a
``mean`` key and takes the largest ``max``), and as one WARNING per batch above
:data:`WARN_MEAN_S` / :data:`WARN_MAX_S` that names the likely cause and the knob. The sampler
costs one timer and one task switch per ``interval`` (0.05 s: 20 wake-ups a second).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .rollout_errors import interrupt_in

__all__ = ["LAG_MAX_KEY", "LAG_MEAN_KEY", "LoopLag", "watch_loop_lag"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LAG_MEAN_KEY = "generate/event_loop_lag_mean"
LAG_MAX_KEY = "generate/event_loop_lag_max"
#: Seconds between samples.
INTERVAL_S = 0.05
#: A batch whose mean lag is over this warns: every step of every rollout waited that long on average.
WARN_MEAN_S = 0.1
#: A batch whose worst lag is over this warns: the whole loop stood still that long at least once.
WARN_MAX_S = 1.0


class LoopLag:
    """The lag samples of one ``generate()`` call."""

    __slots__ = ("_due", "interval", "max", "samples", "total")

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        self.samples = 0
        self.total = 0.0
        self.max = 0.0
        self._due: float | None = None

    def _record(self, lag: float) -> None:
        lag = max(0.0, lag)
        self.samples += 1
        self.total += lag
        if lag > self.max:
            self.max = lag

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0

    async def sample(self) -> None:
        """Sleep ``interval`` over and over, recording each overshoot, until cancelled."""
        while True:
            due = self._due = anyio.current_time() + self.interval
            await anyio.sleep(self.interval)
            if self._due is None:
                return  # stop() has counted this sample already
            self._record(anyio.current_time() - due)
            self._due = None

    def stop(self) -> None:
        """Count the pending sample for what it has overrun so far (called on the loop, at the batch's end)."""
        if self._due is not None:
            overrun = anyio.current_time() - self._due
            if overrun > 0:
                self._record(overrun)
            self._due = None

    def metrics(self) -> dict[str, float]:
        return {LAG_MEAN_KEY: self.mean, LAG_MAX_KEY: self.max}

    def warn_if_high(self, *, rollouts: int, env_workers: int) -> None:
        """One WARNING when the batch's lag is over the thresholds, naming the likely cause and the knob."""
        if self.mean <= WARN_MEAN_S and self.max <= WARN_MAX_S:
            return
        if env_workers == 0:
            cause = (
                "environment calls run inline on the event loop (environment.skyrl_gym.max_env_workers=0), so a "
                "slow init/step/close stops every rollout; give them worker threads (max_env_workers > 0)"
            )
        else:
            cause = (
                f"{env_workers} env worker threads compete with the event loop for the GIL, and the loop does "
                f"Python work (tokenizing, chat templates) for each of up to {rollouts} rollouts' replies; "
                "lower environment.skyrl_gym.max_env_workers or bound generator.max_concurrent_rollouts"
            )
        logger.warning(
            "the event loop lagged %.3fs on average and %.3fs at worst during generate() of %d rollouts "
            "(over %gs mean / %gs max): every engine reply and env result waited that long to be handled. "
            "Likely cause: %s",
            self.mean,
            self.max,
            rollouts,
            WARN_MEAN_S,
            WARN_MAX_S,
            cause,
        )


async def watch_loop_lag(lag: LoopLag | None, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()`` with ``lag`` sampling beside it (without a sampler when ``lag`` is None).

    ``work``'s exception, or interrupt, comes out as itself, never wrapped in an exception group:
    it runs in a child task whose outcome is handed back once the sampler has stopped.
    """
    if lag is None:
        return await work()
    results: list[T] = []
    raised: list[BaseException] = []
    cancelled = anyio.get_cancelled_exc_class()

    async def run() -> None:
        try:
            results.append(await work())
        except cancelled:
            raise
        except BaseException as exc:  # handed to the caller as is (an interrupt included), not grouped
            raised.append(exc)
        finally:
            lag.stop()
            group.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(lag.sample)
            group.start_soon(run)
    except BaseExceptionGroup as group_error:
        # trio delivers Ctrl-C to whichever task runs (the sampler, say): it comes out bare, as the
        # supervisor raises it, once the work has been cancelled and cleaned up.
        held = raised[0] if raised else interrupt_in(group_error)
        if held is None:
            raise
        raise held from None
    if raised:
        try:
            raise raised[0]
        finally:
            del raised[:]
    if not results:
        # The work ended in a cancellation no scope of ours caused (the group swallowed it): say so.
        raise RuntimeError(
            "generate() was cancelled by a CancelledError that no cancel scope caused (raised by user code: "
            "an observer, client or environment); cancel the caller's scope instead"
        )
    return results[0]
