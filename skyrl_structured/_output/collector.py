"""The collector: ordered rollout results in, a batch the trainer accepts out.

Once every rollout has finished, its failures are dealt with after the fact (:mod:`.placeholders`:
the reward shape, a fresh placeholder per failure, the group policy, the failure budget); then the
results are flattened into SkyRL's ``GeneratorOutput``, its filters applied and its metrics computed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._episode.images import empty_rows_like
from .._runtime.contexts import BatchShape
from .._runtime.supervisor import BatchResult
from ..config import ResilienceSettings
from ..failures import FailedRollout
from ..types import (
    GeneratorOutput,
    RolloutOutput,
    SkyRLConfig,
    TrajectoryID,
    TrajectoryOutput,
)
from .metrics import TrajectoryTimes, failure_metrics, rollout_metrics
from .placeholders import RowLayout, apply_group_policy, check_failure_budget, steps_of, substitute_placeholders
from .versions import mask_stale_tokens, version_rows

__all__ = [
    "OutputSpec",
    "build_generator_output",
    "collect",
    "fill_missing_vision",
    "overlong_filtered",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputSpec:
    """What shapes one batch's ``GeneratorOutput``: the generator's settings and the call's choices.

    Built by the generator for each ``generate()`` call (the call's ``sampling_params`` decide
    ``get_logprobs``), so nothing here goes stale when a test or a trainer changes the config.
    """

    generator_cfg: SkyRLConfig
    resilience: ResilienceSettings
    #: The token id a placeholder's one response token carries (the tokenizer's pad, else eos).
    placeholder_token_id: int
    #: Whether a rollout's reward is one float (a custom chat template), not one per token.
    float_rewards: bool
    #: Whether rows carry ``rollout_expert_indices`` (router replay).
    routed_experts: bool
    #: Whether rows carry ``rollout_logprobs``.
    get_logprobs: bool
    #: The generator's policy version now (``mask_tokens_older_than`` counts from it).
    policy_version: int = 0
    #: The policy version the call started under (what rows that track no versions get).
    started_version: int = 0

    @property
    def step_wise(self) -> bool:
        return bool(self.generator_cfg.step_wise_trajectories)


def collect(result: BatchResult[RolloutOutput], shape: BatchShape, spec: OutputSpec) -> GeneratorOutput:
    """The batch's ``GeneratorOutput`` from the supervisor's outcomes (:class:`FailedRollout` for failures).

    ``result.over_budget`` is the supervisor's failure-budget verdict for the batch.

    Raises:
        RuntimeError: over the failure budget with ``failure_budget_action="raise"``.
    """
    failures = sorted(result.failures, key=lambda f: f.index)
    budget_exceeded = False
    if failures:
        budget_exceeded = check_failure_budget(
            failures,
            shape.count,
            spec.resilience.max_failed_rollout_fraction,
            exceeded=result.over_budget,
            action=spec.resilience.failure_budget_action,
        )
    # Past the budget check, every rollout has its outcome (only a batch stopped over budget lacks some).
    assert len(result.results) == shape.count
    outputs = substitute_placeholders(
        result.results,
        token_id=spec.placeholder_token_id,
        # Token-level rewards everywhere except with a custom chat template, which yields a float.
        default_token_level_rewards=spec.step_wise or not spec.float_rewards,
        with_logprobs=spec.get_logprobs,
        step_wise=spec.step_wise,
    )
    fill_missing_vision(outputs)
    summary = dataclasses.replace(result, failures=failures)
    return build_generator_output(outputs, summary, shape, spec, budget_exceeded=budget_exceeded)


def fill_missing_vision(results: Sequence[RolloutOutput]) -> None:
    """Image-free vision fields on every row without them, in a batch where some row has images; in place.

    SkyRL's trainer turns the batch's ``pixel_values`` and ``image_grid_thw`` into ``TensorList``s,
    which need a tensor for every row (a ``None`` fails the step). A placeholder, or a successful
    rollout whose conversation had no image, gets fresh empty ones (no rows; the width, dtype and
    device of the first rollout with images), so it adds no image to the batch.
    """
    rows = [cast(TrajectoryOutput, r) for r in results if hasattr(r, "pixel_values")]
    reference = next((r for r in rows if r.pixel_values is not None), None)
    if reference is None:
        return
    for row in rows:  # a step-wise output has no images (nor has SkyRL's)
        if row.pixel_values is None:
            row.pixel_values = empty_rows_like(reference.pixel_values)
        if row.image_grid_thw is None and reference.image_grid_thw is not None:
            row.image_grid_thw = empty_rows_like(reference.image_grid_thw)


@dataclass(frozen=True)
class _Rows(RowLayout):
    """Per-rollout outputs flattened to trainer rows, and their layout."""

    rows: list[TrajectoryOutput]


def _flatten(outputs: Sequence[RolloutOutput], step_wise: bool) -> _Rows:
    """One row per rollout, or one per step (step-wise)."""
    rows: list[TrajectoryOutput] = []
    rollout: list[int] = []
    is_last: list[bool] = []
    for i, output in enumerate(outputs):
        steps = (steps_of(output) or []) if step_wise else [cast(TrajectoryOutput, output)]
        rows.extend(steps)
        rollout.extend([i] * len(steps))
        is_last.extend(j == len(steps) - 1 for j in range(len(steps)))
    return _Rows(rollout, is_last, rows)


def build_generator_output(
    outputs: Sequence[RolloutOutput],
    result: BatchResult[RolloutOutput],
    shape: BatchShape,
    spec: OutputSpec,
    *,
    budget_exceeded: bool = False,
) -> GeneratorOutput:
    """Flatten the rollouts' ``outputs`` (placeholders in place of ``result.failures``) into the ``GeneratorOutput``.

    ``result`` gives the failures and the counters. ``budget_exceeded``: the step is over the
    failure budget and returned anyway (``warn``).
    """
    failures = result.failures
    trajectory_ids = list(shape.trajectory_ids) if shape.trajectory_ids is not None else None
    env_classes = list(shape.env_classes or [])
    step_wise = spec.step_wise
    flat = _flatten(outputs, step_wise)
    rows = flat.rows
    times = [getattr(o, "e2e_time", None) for o in outputs]
    completion_times: list[float] | None = None if any(t is None for t in times) else times  # type: ignore[assignment]
    splits = [getattr(o, "time_splits", None) for o in outputs]
    rewards: list[Any] = [r.reward for r in rows]
    stop_reasons = [r.stop_reason for r in rows]
    env_metrics = [r.env_metrics for r in rows]

    metrics = _metrics(outputs, flat, failures, env_classes, completion_times, splits)
    metrics.update(
        failure_metrics(failures, len(outputs), result.retries, result.cleanup, budget_exceeded=budget_exceeded)
    )
    metrics.update(result.metrics)
    versions = version_rows(rows, spec.started_version)
    loss_masks = _loss_masks(flat, rewards, stop_reasons, versions, metrics, failures, shape, spec, len(outputs))

    if step_wise:
        assert trajectory_ids is not None
        out_trajectory_ids: list[TrajectoryID] | None = [trajectory_ids[i] for i in flat.rollout]
        out_times: list[float] | None = [completion_times[i] for i in flat.rollout] if completion_times else None
    else:
        out_trajectory_ids = None
        out_times = completion_times
    generator_output: GeneratorOutput = {
        "prompt_token_ids": [r.prompt_ids for r in rows],
        "response_ids": [r.response_ids for r in rows],
        "rewards": rewards,
        "loss_masks": loss_masks,
        "stop_reasons": stop_reasons,
        "rollout_metrics": metrics,
        # Asked for, so every row carries its logprobs.
        "rollout_logprobs": cast(list[list[float]], [r.rollout_logprobs for r in rows]) if spec.get_logprobs else None,
        "trajectory_ids": out_trajectory_ids,
        "trajectory_generation_times": out_times,
        "trajectory_time_splits": _split_lists([splits[i] for i in flat.rollout]),
        # Routed experts are refused with step-wise outputs (validate.py): a row is a rollout here.
        "rollout_expert_indices": [r.rollout_expert_indices for r in rows] if spec.routed_experts else None,
        "is_last_step": list(flat.is_last) if step_wise else None,
        "env_metrics": env_metrics,
        "rollout_policy_versions": versions,
    }
    if any(getattr(o, "pixel_values", None) is not None for o in outputs):
        generator_output["pixel_values"] = [getattr(o, "pixel_values", None) for o in outputs]
        generator_output["image_grid_thw"] = [getattr(o, "image_grid_thw", None) for o in outputs]
    return generator_output


def _loss_masks(
    flat: _Rows,
    rewards: list[Any],
    stop_reasons: list[str],
    versions: list[list[int]],
    metrics: dict[str, Any],
    failures: Sequence[FailedRollout],
    shape: BatchShape,
    spec: OutputSpec,
    rollouts: int,
) -> list[Any]:
    """The rows' loss masks once SkyRL's filters, stale-token masking and the group policy have run.

    The group policy may also change ``rewards``; the stale-token count goes into ``metrics``.
    """
    loss_masks = _apply_filters(spec.generator_cfg, rewards, [r.loss_mask for r in flat.rows], stop_reasons)
    older_than = spec.resilience.mask_tokens_older_than
    if older_than is not None:
        loss_masks = [list(mask) for mask in loss_masks]  # masked here, never in a row's own list
        masked = mask_stale_tokens(versions, loss_masks, now=spec.policy_version, older_than=older_than)
        metrics["generate/tokens_masked_stale"] = float(masked)
    if failures:
        assert shape.trajectory_ids is not None or spec.resilience.failed_rollout_policy == "placeholder"
        failed_index = {f.index for f in failures}
        apply_group_policy(
            spec.resilience.failed_rollout_policy,
            rewards=rewards,
            loss_masks=loss_masks,
            layout=flat,
            failed=[i in failed_index for i in range(rollouts)],
            groups=shape.groups() or [],
        )
    return loss_masks


def _metrics(
    outputs: Sequence[RolloutOutput],
    flat: _Rows,
    failures: list[FailedRollout],
    env_classes: list[str],
    completion_times: list[float] | None,
    splits: list[dict[str, float] | None],
) -> dict[str, Any]:
    """Reward and length metrics over the successful rollouts: placeholders are counted, not averaged in."""
    failed_index = {f.index for f in failures}
    ok_rows = [flat.rows[r] for r, i in enumerate(flat.rollout) if i not in failed_index]
    # A batch without env classes (agent rollouts) has no per-environment metrics.
    ok_classes = [env_classes[i] for i in flat.rollout if i not in failed_index] if env_classes else None
    ok_rollouts = [i for i in range(len(outputs)) if i not in failed_index]
    return rollout_metrics(
        [r.response_ids for r in ok_rows],
        [r.reward for r in ok_rows],
        [r.env_metrics for r in ok_rows],
        ok_classes,
        [r.loss_mask for r in ok_rows],
        TrajectoryTimes(
            [completion_times[i] for i in ok_rollouts] if completion_times is not None else None,
            _split_lists([splits[i] for i in ok_rollouts]),
        ),
    )


def _apply_filters(cfg: SkyRLConfig, rewards: list[Any], loss_masks: list[Any], stop_reasons: list[str]) -> list[Any]:
    """SkyRL's ``zero_reward_on_non_stop`` (rewards, in place) and ``apply_overlong_filtering`` (masks)."""
    if cfg.zero_reward_on_non_stop:
        for r, reason in enumerate(stop_reasons):
            if reason != "stop":
                rewards[r] = [0.0] * len(rewards[r]) if isinstance(rewards[r], list) else 0.0
    if cfg.apply_overlong_filtering:
        return overlong_filtered(loss_masks, stop_reasons)
    return loss_masks


def overlong_filtered(loss_masks: list[Any], stop_reasons: list[str]) -> list[Any]:
    """Loss masks with every row that did not stop on its own zeroed (SkyRL's overlong filtering)."""
    return [
        mask[:] if reason == "stop" else [0] * len(mask) for mask, reason in zip(loss_masks, stop_reasons, strict=True)
    ]


def _split_lists(splits: list[dict[str, float] | None]) -> dict[str, list[float]] | None:
    """``{"llm": [...], "env": [...]}`` across rollouts, or None if any rollout lacks its split."""
    if not splits or any(s is None for s in splits):
        return None
    first = splits[0]
    assert first is not None
    return {name: [s[name] for s in splits if s is not None] for name in first}
