"""Flattening per-rollout results into the ``GeneratorOutput`` SkyRL's trainer consumes."""

from __future__ import annotations

from typing import Any

from .collect import FailedRollout, apply_group_policy
from .config import ResilienceSettings
from .envs import CleanupStats
from .metrics import failure_metrics, rollout_metrics
from .types import GeneratorOutput

__all__ = ["build_generator_output"]


def build_generator_output(
    outputs: list[Any],
    *,
    generator_cfg: Any,
    resilience: ResilienceSettings,
    routed_experts: bool,
    env_classes: list[str],
    trajectory_ids: list[Any] | None,
    get_logprobs: bool,
    failures: list[FailedRollout],
    retries: int,
    cleanup: CleanupStats,
) -> GeneratorOutput:
    """Flatten per-rollout outputs into the ``GeneratorOutput`` the trainer consumes."""
    cfg = generator_cfg
    step_wise = bool(cfg.step_wise_trajectories)
    failed_index = {f.index for f in failures}
    times = [getattr(o, "e2e_time", None) for o in outputs]
    completion_times: list[float] | None = None if any(t is None for t in times) else times  # type: ignore[assignment]
    splits = [getattr(o, "time_splits", None) for o in outputs]

    # Rows: one per rollout, or one per step in step-wise mode.
    rows: list[Any] = []
    row_rollout: list[int] = []
    is_last_step: list[bool] = []
    for i, output in enumerate(outputs):
        if step_wise:
            steps = output.step_outputs
            rows.extend(steps)
            row_rollout.extend([i] * len(steps))
            is_last_step.extend(j == len(steps) - 1 for j in range(len(steps)))
        else:
            rows.append(output)
            row_rollout.append(i)
            is_last_step.append(True)

    responses = [r.response_ids for r in rows]
    rewards = [r.reward for r in rows]
    stop_reasons = [r.stop_reason for r in rows]
    loss_masks = [r.loss_mask for r in rows]
    prompt_token_ids = [r.prompt_ids for r in rows]
    env_metrics = [r.env_metrics for r in rows]
    row_env_classes = [env_classes[i] for i in row_rollout]
    row_splits = [splits[i] for i in row_rollout]
    out_time_splits = _split_lists(row_splits)
    if step_wise:
        assert trajectory_ids is not None
        out_trajectory_ids: list[Any] | None = [trajectory_ids[i] for i in row_rollout]
        out_times: list[float] | None = [times[i] for i in row_rollout] if completion_times else None  # type: ignore[misc]
        out_is_last_step: list[bool] | None = is_last_step
    else:
        out_trajectory_ids = None
        out_times = completion_times
        out_is_last_step = None

    has_vision = any(getattr(o, "pixel_values", None) is not None for o in outputs)
    logprobs = [r.rollout_logprobs for r in rows] if get_logprobs else None
    expert_indices = [o.rollout_expert_indices for o in outputs] if routed_experts else None

    # Metrics describe what the rollouts did: placeholders are counted, not averaged in.
    ok_rows = [r for r, i in enumerate(row_rollout) if i not in failed_index]
    ok_rollouts = [i for i in range(len(outputs)) if i not in failed_index]
    metric_times = [times[i] for i in ok_rollouts] if completion_times is not None else None
    metrics = rollout_metrics(
        [responses[r] for r in ok_rows],
        [rewards[r] for r in ok_rows],
        [env_metrics[r] for r in ok_rows],
        [row_env_classes[r] for r in ok_rows],
        [loss_masks[r] for r in ok_rows],
        completion_times=metric_times,  # type: ignore[arg-type]
        time_splits=_split_lists([splits[i] for i in ok_rollouts]),
    )
    metrics.update(
        failure_metrics(failures, len(outputs), retries, cleanup, max_fraction=resilience.max_failed_rollout_fraction)
    )

    if cfg.zero_reward_on_non_stop:
        for r, reason in enumerate(stop_reasons):
            if reason != "stop":
                rewards[r] = [0.0] * len(rewards[r]) if isinstance(rewards[r], list) else 0.0
    if cfg.apply_overlong_filtering:
        loss_masks = [
            mask[:] if reason == "stop" else [0] * len(mask)
            for mask, reason in zip(loss_masks, stop_reasons, strict=True)
        ]
    if failures:
        assert trajectory_ids is not None or resilience.failed_rollout_policy == "placeholder"
        apply_group_policy(
            resilience.failed_rollout_policy,
            rewards=rewards,
            loss_masks=loss_masks,
            row_trajectory=row_rollout,
            is_last_row=is_last_step,
            failed=[i in failed_index for i in range(len(outputs))],
            groups=[str(t.instance_id) for t in trajectory_ids] if trajectory_ids is not None else [],
        )

    generator_output: GeneratorOutput = {
        "prompt_token_ids": prompt_token_ids,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": loss_masks,
        "stop_reasons": stop_reasons,
        "rollout_metrics": metrics,
        "rollout_logprobs": logprobs,
        "trajectory_ids": out_trajectory_ids,
        "trajectory_generation_times": out_times,
        "trajectory_time_splits": out_time_splits,
        "rollout_expert_indices": expert_indices,
        "is_last_step": out_is_last_step,
        "env_metrics": env_metrics,
    }
    if has_vision:
        generator_output["pixel_values"] = [getattr(o, "pixel_values", None) for o in outputs]
        generator_output["image_grid_thw"] = [getattr(o, "image_grid_thw", None) for o in outputs]
    return generator_output


def _split_lists(splits: list[dict[str, float] | None]) -> dict[str, list[float]] | None:
    """``{"llm": [...], "env": [...]}`` across rollouts, or None if any rollout lacks its split."""
    if not splits or any(s is None for s in splits):
        return None
    first = splits[0]
    assert first is not None
    return {name: [s[name] for s in splits if s is not None] for name in first}
