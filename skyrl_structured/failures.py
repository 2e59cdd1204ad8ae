"""A failed rollout, as the supervisor records it and the collector turns it into a placeholder.

What a rollout of a batch ends as travels from the supervisor to the collector typed: its output
(:data:`~skyrl_structured.types.RolloutOutput`) or a :class:`FailedRollout`, a
:data:`RolloutOutcome`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeAlias, TypeVar

from .errors import StragglerCutError
from .types import RolloutOutput, TrajectoryID

__all__ = [
    "FailedRollout",
    "OutputT",
    "RolloutOutcome",
    "StragglerCutError",
    "failure_budget_exceeded",
    "failure_summary",
]


@dataclass
class FailedRollout:
    """A rollout that raised, kept in its input position until placeholders are built."""

    index: int
    exception: Exception
    #: Seconds the failed (last) attempt ran before it raised.
    elapsed: float
    attempts: int
    timed_out: bool = False
    trajectory_id: TrajectoryID | None = None
    #: ``{"llm": s, "env": s}`` recorded by the failed attempt before it raised.
    time_splits: dict[str, float] | None = None


#: What one rollout returns: ``TrajectoryOutput``, ``StepWiseOutput``, or either (the gym generator's).
OutputT = TypeVar("OutputT", bound=RolloutOutput)

#: What one rollout of the gym generator's batch ends as: its output, or the marker of its failure.
RolloutOutcome: TypeAlias = RolloutOutput | FailedRollout


def failure_summary(failures: Sequence[FailedRollout]) -> str:
    """``"3 x ValueError, 1 x TimeoutError"``, most frequent first."""
    counts = Counter(type(f.exception).__name__ for f in failures)
    return ", ".join(f"{n} x {name}" for name, n in counts.most_common())


def as_written(share: float) -> Fraction:
    """``share`` as the decimal it was written as (0.7 is 7/10, not the float just below it).

    Shares of a batch are compared exactly: in floating point 0.7 * 90 is 62.99999999999999, so 63
    cuts under ``straggler_cutoff=0.3`` would blow ``max_failed_rollout_fraction=0.7`` (issue 27).
    """
    return Fraction(repr(float(share)))


def failure_budget_exceeded(failed: int, total: int, max_fraction: float) -> bool:
    """Whether ``failed`` of ``total`` rollouts is over budget: all of them, or more than ``max_fraction``.

    Compared exactly (:func:`as_written`): the budget holds at ``failed == max_fraction * total``.
    """
    return failed > 0 and (failed >= total or Fraction(failed, total) > as_written(max_fraction))
