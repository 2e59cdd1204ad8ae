"""Ending one rollout's inference session: a cleanup step, run right after the env's close."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from ..observe import CleanupOutcome, RolloutObserver
from .cleanup import Cleanup
from .contexts import RolloutContext

__all__ = ["SessionEnd"]


class SessionEnd(Cleanup):
    """``finish_session`` for one rollout: counted in the cleanup stats and told to the observers."""

    __slots__ = ("_context", "_session_id")

    def __init__(self, context: RolloutContext, session_id: str) -> None:
        super().__init__()
        self._context = context
        self._session_id = session_id

    def describe(self) -> str:
        return f"finish_session({self._session_id!r})"

    def run(self) -> Awaitable[Any]:
        self._context.emit(RolloutObserver.cleanup_started, "finish_session")
        finishing: Awaitable[Any] = self._context.client.finish_session(self._session_id)
        return finishing

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        if outcome == "error":
            self._context.cleanup.finish_session_errors += 1
        elif outcome == "timeout":
            self._context.cleanup.finish_session_timeouts += 1
        self._context.emit(RolloutObserver.cleanup_finished, "finish_session", outcome, error)
