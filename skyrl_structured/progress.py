"""The "Generating Trajectories" progress bar: an observer advanced per finished rollout.

Its postfix also counts the engine calls that came back, so a batch of long rollouts (an agent's
several chat calls each) shows it is moving long before its first rollout finishes.
"""

from __future__ import annotations

import time
from typing import TextIO

from tqdm import tqdm

from .observe import RolloutObserver, RolloutRef

__all__ = ["Progress"]


class Progress(RolloutObserver):
    """A tqdm bar with SkyRL's settings (``miniters`` = a tenth of the batch, ``mininterval=5``).

    Its postfix shows the attempts in flight (started, not yet finished, failed or cancelled), the
    engine calls that came back (``calls``, once there is one) and, once there are any, the failed
    rollouts. A call redraws the bar at most every ``mininterval`` seconds (the first call at once),
    so a bar at ``0/48`` still moves while the first rollouts are on their third chat call. Call
    :meth:`close` when the batch is over.
    """

    def __init__(
        self, total: int, *, disable: bool, desc: str = "Generating Trajectories", file: TextIO | None = None
    ) -> None:
        self.failed = 0
        self.done = 0
        self.calls = 0
        self._drawn_at: float | None = None
        # Attempts started and not yet ended, by (index, attempt): a rollout cancelled while it waited
        # for its slot reports attempt_cancelled without having started.
        self._running: set[tuple[int, int]] = set()
        # A disabled bar is not created at all: tqdm would still start its monitor thread.
        self._bar = (
            None if disable else tqdm(total=total, desc=desc, miniters=max(1, total // 10), mininterval=5, file=file)
        )

    @property
    def in_flight(self) -> int:
        """Attempts running now."""
        return len(self._running)

    def postfix(self) -> str:
        """``"in_flight=12, calls=30, failed=3"``: ``calls`` once a call came back, ``failed`` once a rollout failed."""
        calls = f", calls={self.calls}" if self.calls else ""
        return f"in_flight={self.in_flight}{calls}" + (f", failed={self.failed}" if self.failed else "")

    def _show(self) -> None:
        if self._bar is not None:
            # Shown at the bar's next refresh, so a busy batch does not redraw on every event.
            self._bar.set_postfix_str(self.postfix(), refresh=False)

    def attempt_started(self, rollout: RolloutRef) -> None:
        self._running.add((rollout.index, rollout.attempt))
        self._show()

    def _attempt_ended(self, rollout: RolloutRef) -> None:
        self._running.discard((rollout.index, rollout.attempt))
        self._show()

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        if error is not None:
            return
        self.calls += 1
        self._show()
        bar = self._bar
        if bar is None:
            return
        # No rollout may finish for minutes (an agent's calls are many and long): redraw on calls too,
        # the first at once and then no more often than the bar's own mininterval.
        now = time.monotonic()
        if self._drawn_at is None or now - self._drawn_at >= bar.mininterval:
            self._drawn_at = now
            bar.refresh()

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self._attempt_ended(rollout)

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self._attempt_ended(rollout)

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self._attempt_ended(rollout)

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self.done += 1
        if failed:
            self.failed += 1
            self._show()
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
