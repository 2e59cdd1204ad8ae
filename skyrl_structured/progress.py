"""The "Generating Trajectories" progress bar: an observer advanced per finished rollout."""

from __future__ import annotations

from tqdm import tqdm

from .observe import RolloutObserver, RolloutRef

__all__ = ["Progress"]


class Progress(RolloutObserver):
    """A tqdm bar with SkyRL's settings (``miniters`` = a tenth of the batch, ``mininterval=5``).

    Failures show in its postfix. Call :meth:`close` when the batch is over.
    """

    def __init__(self, total: int, *, disable: bool, desc: str = "Generating Trajectories") -> None:
        self.failed = 0
        self.done = 0
        # A disabled bar is not created at all: tqdm would still start its monitor thread.
        self._bar = None if disable else tqdm(total=total, desc=desc, miniters=max(1, total // 10), mininterval=5)

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self.done += 1
        if failed:
            self.failed += 1
            if self._bar is not None:
                self._bar.set_postfix(failed=self.failed, refresh=False)
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
