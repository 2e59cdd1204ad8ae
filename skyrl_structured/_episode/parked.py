"""A parked episode: its run kept as it was, to be played on by a later ``generate()`` (carry-over).

The straggler cutoff parks a rollout (``generator.carry_over_cut_rollouts``, ``_runtime/parking.py``);
its episode raises :class:`~skyrl_structured._runtime.parking.RolloutParked` with a
:class:`ParkedState`, which resumes the same run in the same, still open, environment. A request
the cut stopped is continued, never sampled again: :func:`continuation_params` asks only for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._runtime.contexts import RolloutContext
from .._runtime.versions import NOT_SAMPLED
from ..types import EnvHandle, RolloutOutput
from .state import Run

if TYPE_CHECKING:
    from .episode import Episode

__all__ = ["ParkedState", "continuation_params"]


@dataclass
class ParkedState:
    """A parked episode (:class:`~skyrl_structured._runtime.parking.ParkedEpisode`): its run, kept as it was."""

    episode: Episode
    run: Run

    def _sampled(self) -> list[int]:
        run = self.run
        found = [v for v in run.versions or () if v != NOT_SAMPLED]
        for step in run.steps:
            found += [v for v in step.policy_versions or () if v != NOT_SAMPLED]
        if run.partial is not None:
            found += run.partial.versions
        return found

    @property
    def tokens(self) -> int:
        return len(self._sampled())

    @property
    def first_version(self) -> int | None:
        return min(self._sampled(), default=None)

    async def resume(
        self,
        env: EnvHandle,
        *,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> RolloutOutput:
        """Go on from where it was parked, in ``env`` (the same environment, still open)."""
        return await self.episode.play(env, self.run, context, max_input_length, sampling_params, cache_salt)


def continuation_params(
    params: dict[str, Any] | None, context: RolloutContext, sampled: int, default_budget: int
) -> dict[str, Any]:
    """The request's parameters with ``max_tokens`` lowered by the ``sampled`` tokens it continues.

    ``default_budget``: ``generator.sampling_params.max_generate_length``, where the parameters name none.
    """
    base = dict(params if params is not None else context.batch.engine_defaults())
    budget = base.get("max_tokens", base.get("max_generate_length", default_budget))
    base["max_tokens"] = max(0, int(budget) - sampled)
    base.pop("max_generate_length", None)
    return base
