"""What the trainer gets from an output: trainable rows, masked rows by cause, GRPO groups, pass@k.

Each row is traced to its rollout and its group (the instance id GRPO groups by), so that a fully
loss-masked row is counted under the first cause that applies and a replaced reward under the policy
that replaced it; groups whose rewards are all equal give GRPO no gradient.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from .._output.placeholders import reward_total
from ..types import ROLLOUT_ERROR_STOP_REASON, GeneratorOutput
from ._run import RunResult
from ._schema import RolloutConfig

__all__ = ["trainer_truth"]

#: Why a row is fully loss-masked, in the order the pipeline decides it (the first that applies counts).
_MASK_CAUSES = ("placeholder", "rollout", "overlong_filter", "mask_group", "other")
#: What replaced a row's reward after its rollout finished.
_REWARD_OVERRIDES = ("zero_reward_on_non_stop", "mask_group", "fill_group_mean")


def _last(reward: Any) -> float:
    """SkyRL's pass@k reads a token-level reward's last value."""
    return float(reward[-1]) if isinstance(reward, list) else float(reward)


def _row_owners(output: GeneratorOutput, result: RunResult, n_samples: int) -> tuple[list[int], list[str]]:
    """Each output row's rollout index and group (the instance id GRPO groups by)."""
    n_rows = len(output["response_ids"])
    ids = output.get("trajectory_ids")
    batch_ids = result.trajectory_ids
    if ids is not None:  # step-wise: rows are turns; find each one's rollout by its id
        position = {(t.instance_id, t.repetition_id): i for i, t in enumerate(batch_ids or [])}
        owners = [position.get((t.instance_id, t.repetition_id), r) for r, t in enumerate(ids)]
        return owners, [str(t.instance_id) for t in ids]
    owners = list(range(n_rows))
    if batch_ids is not None and len(batch_ids) == n_rows:
        return owners, [str(t.instance_id) for t in batch_ids]
    return owners, [str(r // max(1, n_samples)) for r in owners]


def _own_masks(result: RunResult, owners: list[int]) -> list[tuple[int, ...] | None]:
    """Each row's loss mask as its rollout produced it (before the batch policies), where recorded."""
    records = result.trajectories.records if result.trajectories is not None else {}
    step_of: dict[int, int] = defaultdict(int)
    masks: list[tuple[int, ...] | None] = []
    for owner in owners:
        record = records.get(owner)
        step = step_of[owner]
        step_of[owner] += 1
        masks.append(record.steps[step].loss_mask if record is not None and step < len(record.steps) else None)
    return masks


def trainer_truth(cfg: RolloutConfig, output: GeneratorOutput, result: RunResult, n_samples: int) -> dict[str, Any]:
    """What the trainer gets from this output: trainable rows, masked rows by cause, GRPO groups, pass@k."""
    gen = cfg.generator
    rewards = output["rewards"]
    masks = output["loss_masks"]
    stops = list(output.get("stop_reasons") or ["stop"] * len(masks))
    owners, groups = _row_owners(output, result, n_samples)
    own = _own_masks(result, owners)
    is_last = output.get("is_last_step") or [True] * len(masks)
    placeholder = [stop == ROLLOUT_ERROR_STOP_REASON for stop in stops]
    tainted = {groups[r] for r, p in enumerate(placeholder) if p}
    mask_group = gen.failed_rollout_policy == "mask_group"

    masked: Counter[str] = Counter()
    for r, mask in enumerate(masks):
        if any(mask):
            continue
        own_mask = own[r]
        if placeholder[r]:
            masked["placeholder"] += 1
        elif own_mask is not None and not any(own_mask):
            masked["rollout"] += 1  # the rollout's own mask (e.g. a prompt over max_input_length)
        elif gen.apply_overlong_filtering and stops[r] != "stop":
            masked["overlong_filter"] += 1
        elif mask_group and groups[r] in tainted:
            masked["mask_group"] += 1
        else:
            masked["other"] += 1
    overrides: Counter[str] = Counter()
    for r, stop in enumerate(stops):
        if placeholder[r]:
            if gen.failed_rollout_policy == "fill_group_mean" and is_last[r]:
                overrides["fill_group_mean"] += 1
            continue
        if gen.zero_reward_on_non_stop and stop != "stop":
            overrides["zero_reward_on_non_stop"] += 1
        elif mask_group and groups[r] in tainted:
            overrides["mask_group"] += 1

    scores: dict[str, list[float]] = defaultdict(list)
    failed: Counter[str] = Counter()
    for r, last in enumerate(is_last):
        if last:
            scores[groups[r]].append(reward_total(rewards[r]))
            failed[groups[r]] += placeholder[r]
    # SkyRL's trainer: reward/avg_raw_reward over every row, pass@n per uid over every row's last reward.
    passing: dict[str, bool] = defaultdict(bool)
    for r, reward in enumerate(rewards):
        passing[groups[r]] |= _last(reward) > 0
    zero_variance = {g for g, s in scores.items() if len(s) > 1 and max(s) == min(s)}
    trainable = [r for r, mask in enumerate(masks) if any(mask)]
    per_prompt = [
        {
            "instance_id": g,
            "samples": len(s),
            "failed": failed[g],
            "mean_reward": sum(s) / len(s),
            "pass": passing[g],
            "zero_variance": g in zero_variance,
        }
        for g, s in scores.items()
    ]
    return {
        "rows": len(masks),
        "trainable_rows": len(trainable),
        "masked_rows": {cause: masked[cause] for cause in _MASK_CAUSES if masked[cause]},
        "reward_overrides": {cause: overrides[cause] for cause in _REWARD_OVERRIDES if overrides[cause]},
        "groups": len(scores),
        "zero_variance_groups": len(zero_variance),
        "rows_with_gradient": sum(1 for r in trainable if groups[r] not in zero_variance),
        "pass_at_k": sum(passing.values()) / len(passing) if passing else None,
        "prompts_passed": sum(passing.values()),
        "trainer_metrics": {
            "reward/avg_raw_reward": sum(reward_total(r) for r in rewards) / len(rewards) if rewards else None,
            f"reward/avg_pass_at_{n_samples}": sum(passing.values()) / len(passing) if passing else None,
        },
        "per_prompt": per_prompt,
    }
