"""What a ``generate()`` call does with the generator's parked rollouts before its own start.

Stale ones (parked more than ``generator.max_carry_over_steps`` policy versions ago) are dropped;
each row claims the parked rollout with its trajectory id, which it resumes when the row asks for
the same env class, prompt and sampling, and drops otherwise (never resumed into the wrong batch);
what is dropped is closed before any rollout starts. The ``generate/carry_over/*`` metrics of the
claim are returned for the call's ``rollout_metrics``. :class:`Carry` is one call's claim, from the
claim to the end of the call: it hands each row's parked rollout to the row's first attempt, keeps
the claims of rows cut before they started, and closes everything on a call that fails.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..config import ResilienceSettings
from ..types import InferenceClient, TrajectoryID
from .cleanup import CleanupStats
from .contexts import BatchContext, BatchRequest, RolloutContext
from .parking import Parked, ParkingLot, close_parked, close_parked_without_loop, parking_key
from .versions import PolicyVersion

__all__ = ["Carry", "CarryOver", "claim_parked"]

_T = TypeVar("_T")

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


class Carry:
    """One ``generate()`` call's claim on the generator's parked rollouts (made by :meth:`claim`)."""

    def __init__(self, lot: ParkingLot, resumes: list[Parked | None], metrics: dict[str, float]) -> None:
        self.lot = lot
        #: Each row's parked rollout until an attempt of the row takes it (None: nothing, or taken).
        self.resumes = resumes
        #: The claim's ``generate/carry_over/*`` metrics.
        self.metrics = metrics

    @classmethod
    async def claim(
        cls, lot: ParkingLot, batch: BatchContext, request: BatchRequest, version: int, max_steps: int
    ) -> Carry:
        """The call's claim (see :func:`claim_parked`); what it drops is closed before it returns."""
        resumes, metrics = await claim_parked(lot, batch, request, version=version, max_steps=max_steps)
        return cls(lot, resumes, metrics)

    def handing_over(
        self, rollout: Callable[[int, RolloutContext], Awaitable[_T]]
    ) -> Callable[[int, RolloutContext], Awaitable[_T]]:
        """``rollout`` with each row's parked rollout put on its attempt's ``context.resume``.

        The generator's ``agent_loop`` takes it from there; one that did not (a subclass's own) leaves it,
        and it is taken back for the row's next attempt or a later call.
        """
        resumes = self.resumes

        async def attempt(i: int, context: RolloutContext) -> _T:
            if resumes[i] is None:  # the common path: nothing to hand over (a fresh row)
                return await rollout(i, context)
            context.resume, resumes[i] = resumes[i], None
            try:
                return await rollout(i, context)
            finally:
                if context.resume is not None:
                    resumes[i], context.resume = context.resume, None

        return attempt

    async def abandon(self, batch: BatchContext) -> None:
        """A failed or cancelled call: close what it claimed and left unstarted, and everything still parked."""
        left = [*(r for r in self.resumes if r is not None), *self.lot.take_all()]
        await close_parked(left, batch.cleanup, batch.client)

    async def settle(self, batch: BatchContext) -> None:
        """A finished call: rows cut before they started keep their parked rollouts for a later call."""
        for unstarted in self.resumes:
            if unstarted is not None and (displaced := self.lot.park(unstarted)) is not None:
                await close_parked([displaced], batch.cleanup, batch.client)


class CarryOver:
    """A generator's state across its ``generate()`` calls: its policy version and its parked rollouts."""

    def __init__(self) -> None:
        #: The version of the weights the engines hold (stamped on every sampled token).
        self.versions = PolicyVersion()
        self._lot: ParkingLot | None = None

    def __len__(self) -> int:
        """Rollouts parked now."""
        return len(self._lot) if self._lot is not None else 0

    def lot(self, owner: object, settings: ResilienceSettings) -> ParkingLot | None:
        """The parked rollouts with ``generator.carry_over_cut_rollouts`` on, else None.

        Made on first use; what is still parked is closed when ``owner`` is collected or the interpreter exits.
        """
        if self._lot is None and settings.carry_over_cut_rollouts:
            self._lot = ParkingLot()
            weakref.finalize(owner, close_parked_without_loop, self._lot)
        return self._lot

    async def aclose(self, client: InferenceClient) -> None:
        """Close every parked rollout's environment and end its session (the generator's ``aclose()``)."""
        if self._lot is not None and len(self._lot):
            await close_parked(self._lot.take_all(), CleanupStats(), client)
