"""One base for engines that hold resources: ``aclose()``, and ``async with`` that calls it."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


class AsyncResource:
    """Subclasses implement :meth:`aclose`; ``async with engine:`` closes it on every exit path."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release what the engine holds (connections, threads, a model server). Idempotent."""
