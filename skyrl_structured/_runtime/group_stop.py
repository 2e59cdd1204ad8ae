"""Stop a ``generate()`` call once enough informative prompt groups are final.

A prompt group is *informative* when its samples' rewards differ (GRPO gets a gradient from it):
what SkyRL's ``dynamic_sampling.type=filter`` (DAPO) keeps. :class:`~skyrl_structured.InformativeBatches`
starts more groups than a batch needs and gives each call a :class:`GroupStop`; once ``needed``
groups are final and informative, the supervisor cuts every rollout still running (with carry-over,
those in an engine call are parked), so the call never waits for its tail.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GroupStop", "outcome_reward"]


def outcome_reward(outcome: Any) -> float:
    """A final rollout's score: its reward summed over tokens; 0.0 for a failure (its placeholder's reward)."""
    reward = getattr(outcome, "reward", None)
    if reward is None:
        return 0.0
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


class GroupStop:
    """Counts the informative groups of one call as their rollouts become final.

    Args:
        needed: informative groups after which the call stops.
        groups: each rollout's group key, in batch order.
        held: rewards of each group's samples finished in earlier calls (its other members).
        group_size: samples per prompt; with 1, every final group counts (SkyRL's rule).
    """

    def __init__(
        self, needed: int, groups: Sequence[str], held: Mapping[str, Sequence[float]], group_size: int
    ) -> None:
        self.needed = needed
        self._groups = list(groups)
        self._left: dict[str, int] = {}
        for group in self._groups:
            self._left[group] = self._left.get(group, 0) + 1
        self._rewards: dict[str, list[float]] = {group: list(held.get(group, ())) for group in self._left}
        self._singletons = group_size == 1
        #: Groups final with a reward spread, in the order they became final.
        self.informative: list[str] = []

    def final(self, index: int, outcome: Any) -> bool:
        """Rollout ``index`` is final with ``outcome``; True when this makes ``needed`` groups informative."""
        group = self._groups[index]
        self._rewards[group].append(outcome_reward(outcome))
        self._left[group] -= 1
        if self._left[group]:
            return False
        rewards = self._rewards[group]
        if self._singletons or max(rewards) != min(rewards):
            self.informative.append(group)
            return len(self.informative) == self.needed
        return False
