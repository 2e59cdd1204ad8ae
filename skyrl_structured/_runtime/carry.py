"""What a ``generate()`` call does with the generator's parked rollouts before its own start.

Stale ones (parked more than ``generator.max_carry_over_steps`` policy versions ago) are dropped;
each row claims the parked rollout with its trajectory id, which it resumes when the row asks for
the same env class, prompt and sampling, and drops otherwise (never resumed into the wrong batch);
what is dropped is closed before any rollout starts. The ``generate/carry_over/*`` metrics of the
claim are returned for the call's ``rollout_metrics``.
"""

from __future__ import annotations

import logging

from ..types import TrajectoryID
from .contexts import BatchContext, BatchRequest
from .parking import Parked, ParkingLot, close_parked, parking_key

__all__ = ["claim_parked"]

logger = logging.getLogger(__name__)


async def claim_parked(
    lot: ParkingLot, batch: BatchContext, request: BatchRequest, *, version: int, max_steps: int
) -> tuple[list[Parked | None], dict[str, float]]:
    """Each row's parked rollout to resume (None: it starts afresh), and the claim's metrics.

    ``version`` is the policy version now; ``max_steps`` is ``generator.max_carry_over_steps``.
    """
    dropped_stale = lot.take_stale(version, max_steps)
    mismatched: list[Parked] = []
    resumes: list[Parked | None] = []
    ids: list[TrajectoryID | None] = [None] * len(request.prompts)
    if request.trajectory_ids is not None:
        ids = list(request.trajectory_ids)
    for i, trajectory_id in enumerate(ids):
        claimed, mismatch = lot.claim(
            parking_key(trajectory_id), request.env_classes[i], request.prompts[i], request.sampling_params
        )
        resumes.append(claimed)
        if mismatch is not None:
            mismatched.append(mismatch)
    if dropped_stale or mismatched:
        logger.info(
            "carry-over: dropped %d parked rollout(s) older than generator.max_carry_over_steps=%d and %d claimed "
            "with another env class, prompt or sampling; their environments are closed",
            len(dropped_stale),
            max_steps,
            len(mismatched),
        )
        await close_parked([*dropped_stale, *mismatched], batch.cleanup, batch.client)
    resumed = [r for r in resumes if r is not None]
    staleness = [version - _first_version(r, version) for r in resumed]
    metrics = {
        "generate/carry_over/resumed": float(len(resumed)),
        "generate/carry_over/tokens_kept": float(sum(r.episode.tokens for r in resumed)),
        "generate/carry_over/dropped_stale": float(len(dropped_stale)),
        "generate/carry_over/dropped_mismatch": float(len(mismatched)),
        "generate/carry_over/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "generate/carry_over/staleness_max": float(max(staleness, default=0)),
    }
    return resumes, metrics


def _first_version(parked: Parked, default: int) -> int:
    """The policy version of a parked rollout's oldest sampled token (``default`` where it sampled none)."""
    first = parked.episode.first_version
    return default if first is None else first
