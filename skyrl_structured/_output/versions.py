"""``rollout_policy_versions``: the policy version that sampled each response token, and stale-token masking.

A row whose rollout tracked its tokens (the gym episodes) carries its own list; any other row (an
agent's, a placeholder, a subclass's own ``agent_loop``) gets the version the ``generate()`` call
started under for each token in its loss mask and ``-1`` (not sampled) elsewhere: under a weight
sync during the call that is the oldest version that may have sampled them, so masking by age errs
towards masking.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._runtime.versions import NOT_SAMPLED
from ..types import TrajectoryOutput

__all__ = ["mask_stale_tokens", "version_rows"]


def version_rows(rows: Sequence[TrajectoryOutput], started_version: int) -> list[list[int]]:
    """Each row's per-token policy versions, aligned with its ``response_ids``."""
    out: list[list[int]] = []
    for row in rows:
        versions = getattr(row, "policy_versions", None)
        if versions is None or len(versions) != len(row.response_ids):
            versions = [started_version if kept else NOT_SAMPLED for kept in row.loss_mask]
        out.append(list(versions))
    return out


def mask_stale_tokens(
    versions: Sequence[Sequence[int]], loss_masks: list[list[int]], *, now: int, older_than: int
) -> int:
    """Zero, in place, the loss mask of tokens sampled more than ``older_than`` versions before ``now``.

    Returns how many tokens it masked (those already masked are not counted).
    """
    masked = 0
    for row_versions, mask in zip(versions, loss_masks, strict=True):
        for position, version in enumerate(row_versions):
            if version != NOT_SAMPLED and now - version > older_than and mask[position]:
                mask[position] = 0
                masked += 1
    return masked
