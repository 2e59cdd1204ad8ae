"""The state of one episode: its turns, its run so far, and a parked request's partial reply.

Plain data, shared by :mod:`.episode` (which plays the turns) and :mod:`.parked` (a parked run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._runtime.versions import NOT_SAMPLED
from ..engines.partial import PartialReply
from ..types import ConversationType, TrajectoryOutput

__all__ = ["Partial", "Run", "Turn"]


@dataclass
class Turn:
    """One engine reply and the environment's answer to it."""

    output: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    rollout_expert_indices: Any | None
    added_eos: bool
    #: The policy version that sampled each of ``output_ids`` (:data:`NOT_SAMPLED` for an EOS we appended).
    versions: list[int] = field(default_factory=list)
    new_obs: ConversationType = field(default_factory=list)
    obs_ids: list[int] = field(default_factory=list)

    def loss_mask(self) -> list[int]:
        # An EOS we appended ourselves was not generated: it carries no loss, like observations.
        generated = [1] * len(self.output_ids)
        if self.added_eos:
            generated[-1] = 0
        return generated + [0] * len(self.obs_ids)

    def logprobs(self) -> list[float] | None:
        if not self.output_logprobs:
            return None
        return self.output_logprobs + [0.0] * len(self.obs_ids)

    def version_row(self) -> list[int]:
        """Each token's policy version, aligned with :meth:`loss_mask` (observations were not sampled)."""
        return self.versions + [NOT_SAMPLED] * len(self.obs_ids)


@dataclass
class Partial:
    """What a parked rollout's cut request had sampled, kept to be continued (never sampled again)."""

    ids: list[int]
    logprobs: list[float] | None
    text: str
    versions: list[int]

    def extended(self, offered: PartialReply, version: int) -> Partial:
        """This partial reply, then what the engine handed back for a request cut again (sampled by ``version``)."""
        logprobs = None
        if self.logprobs is not None and offered.logprobs is not None:
            logprobs = self.logprobs + offered.logprobs
        return Partial(
            self.ids + offered.token_ids,
            logprobs,
            self.text + offered.text,
            self.versions + [version] * len(offered.token_ids),
        )


@dataclass
class Run:
    """The state of one episode's run (:meth:`~skyrl_structured._episode.episode.Episode.run`)."""

    chat_history: ConversationType
    input_ids: list[int]
    initial_prompt_length: int
    initial_history_length: int
    params: dict[str, Any]
    loss_mask: list[int] | None = field(default_factory=list)
    rollout_logprobs: list[float] | None = None
    response_end_idx: int | None = None
    rollout_expert_indices: Any | None = None
    done: bool = False
    stop_reason: str = "length"
    last_obs: ConversationType = field(default_factory=list)
    #: (reward, index of the last response token of that turn)
    per_step_rewards: list[tuple[float, int | None]] = field(default_factory=list)
    steps: list[TrajectoryOutput] = field(default_factory=list)
    #: Engine calls made so far: the turn part of each request's derived seed.
    engine_calls: int = 0
    #: The policy version of each token in ``loss_mask``'s positions (None where the response is
    #: re-tokenized at the end, or step-wise, where each step carries its own).
    versions: list[int] | None = field(default_factory=list)
    #: A parked request's partial reply, continued by the next engine call.
    partial: Partial | None = None
