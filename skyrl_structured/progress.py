"""The "Generating Trajectories" progress bar: advanced per finished rollout, failures in its postfix."""

from __future__ import annotations

from types import TracebackType

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """A tqdm bar with SkyRL's settings (``miniters`` = a tenth of the batch, ``mininterval=5``)."""

    def __init__(self, total: int, *, disable: bool, desc: str = "Generating Trajectories") -> None:
        self.failed = 0
        self.done = 0
        # A disabled bar is not created at all: tqdm would still start its monitor thread.
        self._bar = None if disable else tqdm(total=total, desc=desc, miniters=max(1, total // 10), mininterval=5)

    def advance(self, *, failed: bool) -> None:
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

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
