"""The policy version: which weights the engines hold, advanced by each weight sync.

Every sampled token records the version current when its request was sent
(``rollout_policy_versions``; DESIGN rule 25). SkyRL's integration advances it after every
``save_weights_for_sampler``; anything else that swaps the engines' weights calls
:meth:`StructuredGymGenerator.advance_policy_version` itself.
"""

from __future__ import annotations

__all__ = ["NOT_SAMPLED", "PolicyVersion"]

#: The version a response token carries when no policy sampled it (observations, an EOS we appended,
#: a placeholder's token).
NOT_SAMPLED = -1


class PolicyVersion:
    """A counter: 0 until the first weight sync, one more after each."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def advance(self) -> int:
        """Count one weight sync; returns the new version."""
        self.value += 1
        return self.value
