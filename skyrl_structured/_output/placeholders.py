"""Failures after the fact: the reward shape, a fresh placeholder per failed rollout, the group policy, the budget.

A failed rollout is a :class:`~skyrl_structured.failures.FailedRollout` marker until every rollout has
finished; only then is the reward shape known (from the first successful rollout that has a trajectory)
and each marker replaced by a fresh placeholder of that shape (``stop_reason="rollout_error"``, zero loss
mask, zero reward), the group policy applied and the failure budget enforced.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, assert_never, cast, overload

from ..config import FailedRolloutPolicy, FailureBudgetAction
from ..failures import FailedRollout, RolloutOutcome, failure_summary
from ..types import (
    ROLLOUT_ERROR_STOP_REASON,
    RolloutOutput,
    StepWiseOutput,
    TrajectoryOutput,
)

__all__ = [
    "RowLayout",
    "apply_group_policy",
    "check_failure_budget",
    "first_trajectory",
    "infer_token_level_rewards",
    "make_placeholder",
    "reward_total",
    "steps_of",
    "substitute_placeholders",
]

logger = logging.getLogger(__name__)


def steps_of(output: RolloutOutput) -> list[TrajectoryOutput] | None:
    """A step-wise output's steps, None for one trajectory.

    Read by attribute, not by class: a SkyRL subclass's ``_post_process_agent_loop_output`` may hand
    back SkyRL's own ``TrajectoryOutput``/``StepWiseOutput``, which have the same fields.
    """
    return cast(list[TrajectoryOutput] | None, getattr(output, "step_outputs", None))


def first_trajectory(output: RolloutOutput) -> TrajectoryOutput | None:
    """The first trajectory of a result: itself, or the first step of a step-wise output (if any)."""
    steps = steps_of(output)
    if steps is not None:
        return steps[0] if steps else None
    return cast(TrajectoryOutput, output)


def infer_token_level_rewards(results: Sequence[RolloutOutcome], *, default: bool) -> bool:
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
) -> RolloutOutput:
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


@overload
def substitute_placeholders(
    results: Sequence[TrajectoryOutput | FailedRollout],
    *,
    token_id: int,
    default_token_level_rewards: bool,
    with_logprobs: bool,
    step_wise: Literal[False],
) -> list[TrajectoryOutput]: ...


@overload
def substitute_placeholders(
    results: Sequence[RolloutOutcome],
    *,
    token_id: int,
    default_token_level_rewards: bool,
    with_logprobs: bool,
    step_wise: bool,
) -> Sequence[RolloutOutput]: ...


def substitute_placeholders(
    results: Sequence[RolloutOutcome],
    *,
    token_id: int,
    default_token_level_rewards: bool,
    with_logprobs: bool,
    step_wise: bool,
) -> Sequence[RolloutOutput]:
    """``results`` with every :class:`FailedRollout` replaced by a placeholder, order kept.

    Trajectories in, trajectories out: outside step-wise mode a placeholder is a ``TrajectoryOutput``.
    """
    token_level = infer_token_level_rewards(results, default=default_token_level_rewards)
    return [
        make_placeholder(
            r, token_id=token_id, token_level_rewards=token_level, with_logprobs=with_logprobs, step_wise=step_wise
        )
        if isinstance(r, FailedRollout)
        else r
        for r in results
    ]


def check_failure_budget(
    failures: Sequence[FailedRollout],
    total: int,
    max_fraction: float,
    *,
    exceeded: bool,
    action: FailureBudgetAction = "raise",
) -> bool:
    """Act on a step whose every rollout failed, or more than ``max_fraction`` of them did.

    ``exceeded`` is the batch's verdict, reached once by the supervisor
    (:func:`~skyrl_structured.failures.failure_budget_exceeded`); this only words and acts on it.

    With ``action="raise"`` such a step raises; with ``"warn"`` it logs one warning and the caller
    returns the step with placeholders for the failed rows (``generator.failure_budget_action``).

    Returns:
        Whether the budget was exceeded (only ever True with ``action="warn"``).

    Raises:
        RuntimeError: over budget with ``action="raise"``; chained (``__cause__``) to the first
            failure's exception.
    """
    if not exceeded:
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


def reward_total(reward: Any) -> float:
    """A row's reward as one number: token-level rewards summed (the score GRPO groups compare)."""
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


@dataclass(frozen=True)
class RowLayout:
    """Where each trainer row comes from: one row per rollout, or one per step (step-wise)."""

    #: The rollout index of each row.
    rollout: Sequence[int]
    #: Whether each row ends its rollout (carries its final reward): every row, outside step-wise mode.
    is_last: Sequence[bool]


def apply_group_policy(
    policy: FailedRolloutPolicy,
    *,
    rewards: list[Any],
    loss_masks: list[list[int]],
    layout: RowLayout,
    failed: Sequence[bool],
    groups: Sequence[str],
) -> None:
    """Apply a ``failed_rollout_policy`` to the flattened rows, in place.

    ``layout`` says which rollout each row comes from and which row carries its final reward;
    ``failed[i]`` and ``groups[i]`` are per rollout. ``mask_group`` zeroes reward and loss mask of
    every row of a group that contains a failure; ``fill_group_mean`` gives each failed rollout's
    row the mean score of its group's successful rollouts, so the group baseline is what the
    successes alone would give.

    The policy's value was checked once, by :func:`~skyrl_structured.config.resolve_resilience`.
    """
    if not any(failed):
        return
    if policy == "placeholder":
        return
    if policy == "mask_group":
        tainted = {groups[i] for i, f in enumerate(failed) if f}
        for r, i in enumerate(layout.rollout):
            if groups[i] in tainted:
                loss_masks[r] = [0] * len(loss_masks[r])
                rewards[r] = [0.0] * len(rewards[r]) if isinstance(rewards[r], list) else 0.0
        return
    if policy == "fill_group_mean":
        _fill_group_mean(rewards, layout, failed, groups)
        return
    assert_never(policy)


def _fill_group_mean(rewards: list[Any], layout: RowLayout, failed: Sequence[bool], groups: Sequence[str]) -> None:
    """``fill_group_mean``: each failed rollout's row gets its group's mean successful score."""
    scores: dict[str, list[float]] = defaultdict(list)
    for r, i in enumerate(layout.rollout):
        if layout.is_last[r] and not failed[i]:
            scores[groups[i]].append(reward_total(rewards[r]))
    for r, i in enumerate(layout.rollout):
        if failed[i]:
            sibling_scores = scores.get(groups[i])
            mean = sum(sibling_scores) / len(sibling_scores) if sibling_scores else 0.0
            if isinstance(rewards[r], list):
                filled = [0.0] * len(rewards[r])
                filled[-1] = mean
                rewards[r] = filled
            else:
                rewards[r] = mean
