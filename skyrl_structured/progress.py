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
        self._bar = tqdm(total=total, desc=desc, miniters=max(1, total // 10), mininterval=5, disable=disable)

    def advance(self, *, failed: bool) -> None:
        self.done += 1
        if failed:
            self.failed += 1
            self._bar.set_postfix(failed=self.failed, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
