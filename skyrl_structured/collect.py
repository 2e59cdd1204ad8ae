"""The collector: ordered rollout results in, a batch the trainer accepts out.

A failed rollout is a :class:`FailedRollout` marker until every rollout has finished; only then is
the reward shape known (from the first successful rollout that has a trajectory) and each marker
replaced by a fresh placeholder of that shape. Placeholders carry ``stop_reason="rollout_error"``,
a zero loss mask and zero reward, so they keep the batch size without teaching anything.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import FailureBudgetAction
from .types import ROLLOUT_ERROR_STOP_REASON, StepWiseOutput, TrajectoryOutput

logger = logging.getLogger(__name__)

__all__ = [
    "FailedRollout",
    "apply_group_policy",
    "check_failure_budget",
    "failure_budget_exceeded",
    "failure_summary",
    "first_trajectory",
    "infer_token_level_rewards",
    "make_placeholder",
    "substitute_placeholders",
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
    trajectory_id: Any | None = None
    #: ``{"llm": s, "env": s}`` recorded by the failed attempt before it raised.
    time_splits: dict[str, float] | None = None


def first_trajectory(output: Any) -> Any | None:
    """The first trajectory of a result: itself, or the first step of a step-wise output (if any)."""
    steps = getattr(output, "step_outputs", None)
    if steps is not None:
        return steps[0] if steps else None
    return output


def infer_token_level_rewards(results: Sequence[Any], *, default: bool) -> bool:
    """Whether rewards are per token, from the first successful result that has a trajectory.

    ``default`` (from the configuration) is used when no successful result has one.
    """
    for result in results:
        if isinstance(result, FailedRollout):
            continue
        trajectory = first_trajectory(result)
        if trajectory is not None:
            return isinstance(trajectory.reward, list)
    return default


def make_placeholder(
    failure: FailedRollout,
    *,
    token_id: int,
    token_level_rewards: bool,
    with_logprobs: bool,
    step_wise: bool,
) -> TrajectoryOutput | StepWiseOutput:
    """A fresh one-token trajectory that contributes neither reward nor loss.

    Every list is new, so later in-place edits to one placeholder never reach another.
    """
    splits = dict(failure.time_splits) if failure.time_splits is not None else None
    trajectory = TrajectoryOutput(
        response_ids=[token_id],
        reward=[0.0] if token_level_rewards else 0.0,
        stop_reason=ROLLOUT_ERROR_STOP_REASON,
        loss_mask=[0],
        prompt_ids=[token_id],
        rollout_logprobs=[0.0] if with_logprobs else None,
        env_metrics={},
        e2e_time=None if step_wise else failure.elapsed,
        time_splits=None if step_wise else splits,
    )
    if step_wise:
        return StepWiseOutput(step_outputs=[trajectory], e2e_time=failure.elapsed, time_splits=splits)
    return trajectory


def substitute_placeholders(
    results: Sequence[Any],
    *,
    token_id: int,
    default_token_level_rewards: bool,
    with_logprobs: bool,
    step_wise: bool,
) -> list[Any]:
    """``results`` with every :class:`FailedRollout` replaced by a placeholder, order kept."""
    token_level = infer_token_level_rewards(results, default=default_token_level_rewards)
    return [
        make_placeholder(
            r, token_id=token_id, token_level_rewards=token_level, with_logprobs=with_logprobs, step_wise=step_wise
        )
        if isinstance(r, FailedRollout)
        else r
        for r in results
    ]


def failure_summary(failures: Sequence[FailedRollout]) -> str:
    """``"3 x ValueError, 1 x TimeoutError"``, most frequent first."""
    counts = Counter(type(f.exception).__name__ for f in failures)
    return ", ".join(f"{n} x {name}" for name, n in counts.most_common())


def failure_budget_exceeded(failed: int, total: int, max_fraction: float) -> bool:
    """Whether ``failed`` of ``total`` rollouts is over budget: all of them, or more than ``max_fraction``."""
    return failed > 0 and (failed >= total or failed > max_fraction * total)


def check_failure_budget(
    failures: Sequence[FailedRollout], total: int, max_fraction: float, *, action: FailureBudgetAction = "raise"
) -> bool:
    """Act on a step whose every rollout failed, or more than ``max_fraction`` of them did.

    With ``action="raise"`` such a step raises; with ``"warn"`` it logs one warning and the caller
    returns the step with placeholders for the failed rows (``generator.failure_budget_action``).

    Returns:
        Whether the budget was exceeded (only ever True with ``action="warn"``).

    Raises:
        RuntimeError: over budget with ``action="raise"``; chained (``__cause__``) to the first
            failure's exception.
    """
    if not failure_budget_exceeded(len(failures), total, max_fraction):
        return False
    first = min(failures, key=lambda f: f.index).exception
    if len(failures) >= total:
        what = (
            f"All {total} rollouts failed ({failure_summary(failures)}); a step made only of "
            "placeholders carries no training signal."
        )
    else:
        what = (
            f"{len(failures)} of {total} rollouts failed ({failure_summary(failures)}), more than "
            f"generator.max_failed_rollout_fraction={max_fraction:g} allows."
        )
    if action == "warn":
        logger.warning(
            "%s Returning the step with %d placeholder(s) because generator.failure_budget_action=warn; "
            "the first error was %s: %s",
            what,
            len(failures),
            type(first).__name__,
            first,
        )
        return True
    raise RuntimeError(
        f"{what} The first error is chained below. Where generate() gets one prompt group at a time "
        "(SkyRL's fully-async trainer), generator.failure_budget_action=warn returns such a step with "
        "placeholders instead."
    ) from first


def _trajectory_score(reward: Any) -> float:
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def apply_group_policy(
    policy: str,
    *,
    rewards: list[Any],
    loss_masks: list[list[int]],
    row_trajectory: Sequence[int],
    is_last_row: Sequence[bool],
    failed: Sequence[bool],
    groups: Sequence[str],
) -> None:
    """Apply a ``failed_rollout_policy`` to the flattened rows, in place.

    ``row_trajectory[r]`` is the rollout index of row ``r``; ``is_last_row[r]`` marks the row that
    carries the rollout's final reward (every row, outside step-wise mode); ``failed[i]`` and
    ``groups[i]`` are per rollout. ``mask_group`` zeroes reward and loss mask of every row of a
    group that contains a failure; ``fill_group_mean`` gives each failed rollout's row the mean
    score of its group's successful rollouts, so the group baseline is what the successes alone
    would give.
    """
    if policy == "placeholder" or not any(failed):
        return
    tainted = {groups[i] for i, f in enumerate(failed) if f}
    if policy == "mask_group":
        for r, i in enumerate(row_trajectory):
            if groups[i] in tainted:
                loss_masks[r] = [0] * len(loss_masks[r])
                rewards[r] = [0.0] * len(rewards[r]) if isinstance(rewards[r], list) else 0.0
        return
    if policy != "fill_group_mean":
        raise ValueError(f"unknown failed_rollout_policy {policy!r}")
    scores: dict[str, list[float]] = defaultdict(list)
    for r, i in enumerate(row_trajectory):
        if is_last_row[r] and not failed[i]:
            scores[groups[i]].append(_trajectory_score(rewards[r]))
    for r, i in enumerate(row_trajectory):
        if failed[i]:
            sibling_scores = scores.get(groups[i])
            mean = sum(sibling_scores) / len(sibling_scores) if sibling_scores else 0.0
            if isinstance(rewards[r], list):
                filled = [0.0] * len(rewards[r])
                filled[-1] = mean
                rewards[r] = filled
            else:
                rewards[r] = mean
