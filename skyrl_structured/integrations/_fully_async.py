"""Why ``oversample_groups`` and carry-over do not apply under SkyRL's fully-async trainer (issue 43).

What ``FullyAsyncRayPPOTrainer`` (``skyrl/train/fully_async_trainer.py``, skyrl 0.3.0) does:

- each of its ``num_parallel_generation_workers`` workers (``_run_generate_for_a_group_loop``) pulls
  one prompt, calls ``generate()`` for that one group and puts the finished group in a buffer;
- the training loop (``_collect_generation_mini_batch``) takes groups in the order they finish and,
  with ``trainer.fully_async.sample_full_batch=true``, drops each zero-variance group as it arrives
  and keeps pulling until the mini-batch holds ``policy_mini_batch_size`` informative groups;
- a group still running when the mini-batch is full is not cut: its requests freeze in the weight
  sync (``pause_generation``, vLLM's KEEP mode) and go on under the new weights, and its tokens say
  so in ``rollout_policy_versions``.

So there is no whole-batch wait for ``InformativeBatches`` to stop early, and no step boundary
that cuts a rollout; inside one group every sample is trained (GRPO's group baseline), and a group
is known to carry no gradient only when its last sample is scored. A rollout parked by carry-over
waits for a later ``generate()`` with its trajectory id, which this trainer never makes (it draws
each prompt once per epoch), so it would only hold its environment open until dropped as stale.
"""

from __future__ import annotations

from typing import Any

from ..config import read_knob

__all__ = ["check_fully_async", "fully_async_enabled"]

_INSTEAD = (
    "SkyRL's fully-async trainer already calls generate() once per prompt group, trains groups in the order they "
    "finish and lets groups still running go on across each weight sync, so no batch waits for its tail"
)


def fully_async_enabled(cfg: Any) -> bool:
    """Whether ``cfg`` (SkyRL's root config) selects the fully-async trainer."""
    return bool(getattr(getattr(getattr(cfg, "trainer", None), "fully_async", None), "enabled", False))


def check_fully_async(cfg: Any) -> None:
    """Refuse the knobs that have nothing to do under ``trainer.fully_async.enabled=true``.

    Raises:
        ValueError: ``generator.oversample_groups`` or ``generator.carry_over_cut_rollouts`` set there;
            one line naming the key, why, and what to use instead.
    """
    if not fully_async_enabled(cfg):
        return
    share = read_knob(cfg.generator, "oversample_groups", None)
    if share is not None:
        raise ValueError(
            f"`generator.oversample_groups={share}` stops a whole-batch generate() early, and {_INSTEAD}: set "
            "oversample_groups to null, and for DAPO's filter set trainer.fully_async.sample_full_batch=true with "
            "trainer.algorithm.zero_variance_filter=true (zero-variance groups are dropped as they finish)"
        )
    if read_knob(cfg.generator, "carry_over_cut_rollouts", False):
        raise ValueError(
            "`generator.carry_over_cut_rollouts=true` parks a cut rollout for a later generate() with its trajectory "
            f"id, which SkyRL's fully-async trainer never makes (it draws each prompt once per epoch), and {_INSTEAD}: "
            "set carry_over_cut_rollouts to false there"
        )
