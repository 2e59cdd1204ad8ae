"""How the supervisor reads what a rollout raised: its failure, or what must propagate.

An ``Exception`` is the rollout's failure. Our own cancellation and the interrupts
(``KeyboardInterrupt``, ``SystemExit``) propagate; a cancellation that no cancel scope of ours
caused, and a ``GeneratorExit`` that escapes a rollout, are that rollout's failure, a
:class:`~skyrl_structured.errors.RolloutCancelledError` (design rule 8). Also how a rollout and an
error are named in logs and placeholders (:func:`describe`, :func:`describe_error`).
"""

from __future__ import annotations

import math
import sys
import traceback
from pathlib import Path

import anyio

from ..errors import RolloutCancelledError
from ..types import TrajectoryID

__all__ = ["as_rollout_error", "describe", "describe_error", "foreign_cancellation", "interrupt_in"]


def describe(index: int, trajectory_id: TrajectoryID | None) -> str:
    """``"rollout 3"``, or ``"rollout 3 (<its trajectory id>)"``: how logs and errors name a rollout."""
    if trajectory_id is None:
        return f"rollout {index}"
    to_string = getattr(trajectory_id, "to_string", None)
    return f"rollout {index} ({to_string() if callable(to_string) else trajectory_id})"


def describe_error(exc: BaseException) -> str:
    """``"Type: message"``; for an empty message, the cause chain down to the first message (or where it was raised).

    ``EngineGenerateError()`` raised from a bare ``assert`` reads ``"EngineGenerateError <- AssertionError
    (no message; raised at trio_asyncio/_base.py:123 in run_in_executor)"``.
    """
    names: list[str] = []
    current: BaseException | None = exc
    seen: set[int] = set()
    last = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        message = str(current)
        if message:
            return " <- ".join([*names, f"{type(current).__name__}: {message}"])
        names.append(type(current).__name__)
        last = current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    frames = traceback.extract_tb(last.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f"; raised at {'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} in {frame.name}"
    return f"{' <- '.join(names)} (no message{where})"


def foreign_cancellation(exc: BaseException, native: type[BaseException]) -> bool:
    """True for a cancellation exception that no cancel scope around the caller has caused.

    ``native`` is the running backend's cancellation class (looked up once per batch).
    """
    asyncio_module = sys.modules.get("asyncio")
    # Under trio an asyncio CancelledError is never trio's own cancellation.
    if (
        asyncio_module is not None
        and native is not asyncio_module.CancelledError
        and isinstance(exc, asyncio_module.CancelledError)
    ):
        return True
    return isinstance(exc, native) and anyio.current_effective_deadline() != -math.inf


def as_rollout_error(
    exc: BaseException, index: int, trajectory_id: TrajectoryID | None, native_cancellation: type[BaseException]
) -> Exception | None:
    """The error a rollout failed with, or None for what must propagate (our cancellation, interrupts)."""
    if isinstance(exc, Exception):
        return exc
    if not isinstance(exc, GeneratorExit) and not foreign_cancellation(exc, native_cancellation):
        return None  # decided before describing the rollout: a cancelled batch does this once per rollout
    where = describe(index, trajectory_id)
    if not isinstance(exc, GeneratorExit):
        error = RolloutCancelledError(
            f"{where} raised {type(exc).__name__} although generate() was not cancelled (an inference client "
            "or environment that cancels its own work); counted as this rollout's failure"
        )
    else:
        error = RolloutCancelledError(f"{where} raised GeneratorExit; counted as this rollout's failure")
    error.__cause__ = exc
    return error


def interrupt_in(exc: BaseException) -> BaseException | None:
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
