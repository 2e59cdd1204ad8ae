"""The "Generating Trajectories" progress bar: an observer advanced per finished rollout."""

from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

from .observe import RolloutObserver, RolloutRef

__all__ = ["Progress"]


class Progress(RolloutObserver):
    """A tqdm bar with SkyRL's settings (``miniters`` = a tenth of the batch, ``mininterval=5``).

    Its postfix shows the attempts in flight (started, not yet finished, failed or cancelled) and,
    once there are any, the failed rollouts. Call :meth:`close` when the batch is over.
    """

    def __init__(
        self, total: int, *, disable: bool, desc: str = "Generating Trajectories", file: TextIO | None = None
    ) -> None:
        self.failed = 0
        self.done = 0
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
        """``"in_flight=12, failed=3"`` (``failed`` only once a rollout has failed)."""
        return f"in_flight={self.in_flight}" + (f", failed={self.failed}" if self.failed else "")

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
