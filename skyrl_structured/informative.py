"""Batches of informative prompt groups, without waiting for whole batches (issue 43, item 3).

SkyRL's ``dynamic_sampling.type=filter`` (DAPO) generates a whole batch, drops the groups whose
samples all got the same reward (no GRPO gradient), and generates another whole batch until enough
groups are left, each batch waiting on its own tail. :class:`InformativeBatches` starts more groups
than the batch needs (``oversample``) in one ``generate()`` call, stops that call as soon as the
groups it needs are final and informative (the rollouts still running are cut: with
``generator.carry_over_cut_rollouts`` those in an engine call are parked), and carries every group
it did not finish into the next call: the samples a group already finished are kept, its parked
samples are resumed, the ones not started start then. Nothing sampled is dropped but the
uninformative groups (as the filter drops them) and failures.

Prompts come from the caller (:meth:`InformativeBatches.add`, e.g. the dataloader's batches) and
wait in order, carried groups first; none is lost.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ._output.rows import join_rows, take_row
from ._runtime.group_stop import GroupStop
from .config import invalid_value
from .generator import StructuredGymGenerator, _Call
from .types import ConversationType, GeneratorInput, GeneratorOutput, TrajectoryID

__all__ = ["InformativeBatch", "InformativeBatches", "PromptGroup", "empty_output"]

logger = logging.getLogger(__name__)

_DEFAULT_OVERSAMPLE = 0.5


@dataclass(frozen=True)
class PromptGroup:
    """One prompt, sampled ``n_samples_per_prompt`` times: SkyRL's dataset row (its ``uid`` names the group)."""

    uid: str
    prompt: ConversationType
    env_class: str
    env_extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class InformativeBatch:
    """What one :meth:`InformativeBatches.next` call returns.

    ``output`` holds ``groups`` whole groups, each group's samples in a row (repetition order), and
    ``uids`` each row's group uid (SkyRL's ``uids``): at most the ``needed`` asked for, fewer when the
    groups waiting ran out.
    """

    output: GeneratorOutput
    uids: list[str]
    groups: int
    #: Groups final in this call whose samples all got one reward: dropped, as SkyRL's filter drops them.
    dropped: int
    #: Groups this call started or went on with, and those it carries into the next call.
    started: int
    carried: int
    #: The dropped groups' rows (what the filter threw away), for logging and accounting.
    filtered: GeneratorOutput | None = None


@dataclass
class _Group:
    spec: PromptGroup
    #: The finished samples' rows, by repetition id.
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Whether a call has started it (its unfinished samples are parked or to start again).
    started: bool = False


class InformativeBatches:
    """Informative GRPO batches from a :class:`StructuredGymGenerator` with carry-over on.

    Args:
        generator: its ``generator.carry_over_cut_rollouts`` must be on (a cut rollout is parked, not lost).
        n_samples_per_prompt: samples per group (SkyRL's ``generator.n_samples_per_prompt``).
        oversample: the share of extra groups started per call (0.5: 1.5 times the groups needed); None takes
            ``generator.oversample_groups``, else 0.5. It pays past ``1 / p - 1`` for an informative share ``p``.

    Raises:
        ValueError: carry-over off, step-wise trajectories, or a value out of range (named).
    """

    def __init__(
        self, generator: StructuredGymGenerator, *, n_samples_per_prompt: int, oversample: float | None = None
    ) -> None:
        if not generator.resilience.carry_over_cut_rollouts:
            raise ValueError(
                "InformativeBatches stops each call once it has its groups and cuts the rest, which needs "
                "`generator.carry_over_cut_rollouts=true` so the cut rollouts are parked, not lost; turn it on"
            )
        if generator.generator_cfg.step_wise_trajectories:
            raise ValueError("InformativeBatches needs whole trajectories: set generator.step_wise_trajectories=false")
        if (
            isinstance(n_samples_per_prompt, bool)
            or not isinstance(n_samples_per_prompt, int)
            or n_samples_per_prompt < 1
        ):
            raise invalid_value("n_samples_per_prompt", n_samples_per_prompt, "an integer >= 1", with_type=True)
        if oversample is None:
            configured = generator.resilience.oversample_groups
            oversample = configured if configured is not None else _DEFAULT_OVERSAMPLE
        if isinstance(oversample, bool) or not isinstance(oversample, int | float) or not 0 <= oversample < math.inf:
            raise invalid_value(
                "oversample", oversample, "a finite number >= 0", "0.5 starts 1.5 times the groups a batch needs."
            )
        self.generator = generator
        self.n = n_samples_per_prompt
        self.oversample = float(oversample)
        self._waiting: deque[_Group] = deque()

    @property
    def pending(self) -> int:
        """Groups waiting: carried from an earlier call, or added and not started."""
        return len(self._waiting)

    def wanted(self, needed: int) -> int:
        """How many groups a call for ``needed`` starts or goes on with: ``ceil(needed * (1 + oversample))``."""
        return math.ceil(needed * (1.0 + self.oversample))

    def held(self) -> GeneratorOutput | None:
        """The rows finished and waiting for the rest of their group (None: none), in queue order."""
        rows = [group.done[r] for group in self._waiting for r in sorted(group.done)]
        return join_rows(rows, None) if rows else None

    def add(self, groups: Iterable[PromptGroup]) -> None:
        """Queue fresh groups (after the ones already waiting)."""
        self._waiting.extend(_Group(group) for group in groups)

    async def next(
        self,
        needed: int,
        *,
        sampling_params: dict[str, Any] | None = None,
        batch_metadata: Any = None,
        disable_tqdm: bool = True,
    ) -> InformativeBatch:
        """One ``generate()`` call over up to ``ceil(needed * (1 + oversample))`` waiting groups, stopped once
        ``needed`` of them are final and informative; returns those groups.

        Raises:
            ValueError: ``needed`` below 1.
            Exception: what ``generate()`` raises (the waiting groups stay queued).
        """
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
            raise invalid_value("needed", needed, "an integer >= 1", with_type=True)
        # Every group already started goes on (its parked samples would go stale waiting), then fresh ones
        # up to 1 + oversample times the groups needed.
        cap = self.wanted(needed)
        chosen = [g for g in self._waiting if g.started]
        chosen += [g for g in self._waiting if not g.started][: max(0, cap - len(chosen))]
        for group in chosen:
            group.started = True
        batch, rows_of = self._input(chosen, sampling_params, batch_metadata)
        held = {g.spec.uid: [_score(row) for row in g.done.values()] for g in chosen}
        stop = GroupStop(needed, [uid for uid, _ in rows_of], held, self.n)
        call = _Call(group_stop=stop)
        output = await self.generator._generate(batch, disable_tqdm, call) if rows_of else None
        result = call.result
        unfinished = result.cut if result is not None else frozenset()
        by_uid = {g.spec.uid: g for g in chosen}
        for index, (uid, repetition) in enumerate(rows_of):
            if index not in unfinished and output is not None:
                by_uid[uid].done[repetition] = take_row(output, index)
        informative, dropped = self._settle(chosen, stop.informative)
        kept = informative[:needed]
        for extra in reversed(informative[needed:]):  # whole and informative: first in the next batch
            self._waiting.appendleft(extra)
        rows = [group.done[r] for group in kept for r in range(self.n)]
        metrics: dict[str, Any] = dict(output["rollout_metrics"] or {}) if output is not None else {}
        metrics.update(
            {
                "generate/informative/groups": float(len(kept)),
                "generate/informative/dropped_groups": float(len(dropped)),
                "generate/informative/carried_groups": float(self.pending),
            }
        )
        filtered = [group.done[r] for group in dropped for r in range(self.n)]
        return InformativeBatch(
            output=join_rows(rows, metrics) if rows else empty_output(metrics),
            uids=[group.spec.uid for group in kept for _ in range(self.n)],
            groups=len(kept),
            dropped=len(dropped),
            started=len(chosen),
            carried=self.pending,
            filtered=join_rows(filtered, None) if filtered else None,
        )

    def _input(
        self, chosen: list[_Group], sampling_params: dict[str, Any] | None, batch_metadata: Any
    ) -> tuple[GeneratorInput, list[tuple[str, int]]]:
        """The call's batch: every sample of the chosen groups not finished yet (parked ones resume by id)."""
        rows_of: list[tuple[str, int]] = []
        prompts: list[ConversationType] = []
        env_classes: list[str] = []
        extras: list[dict[str, Any]] = []
        ids: list[TrajectoryID] = []
        for group in chosen:
            for repetition in range(self.n):
                if repetition in group.done:
                    continue
                rows_of.append((group.spec.uid, repetition))
                prompts.append(group.spec.prompt)  # one object per group: a parked sample's prompt compares equal
                env_classes.append(group.spec.env_class)
                extras.append(copy.deepcopy(group.spec.env_extras))
                ids.append(TrajectoryID(group.spec.uid, repetition))
        batch: GeneratorInput = {
            "prompts": prompts,
            "env_classes": env_classes,
            "env_extras": extras,
            "trajectory_ids": ids,
        }
        if sampling_params is not None:
            batch["sampling_params"] = sampling_params
        if batch_metadata is not None:
            batch["batch_metadata"] = batch_metadata
        return batch, rows_of

    def _settle(self, chosen: list[_Group], order: list[str]) -> tuple[list[_Group], list[_Group]]:
        """Take the chosen groups now whole out of the queue: (informative ones, in the order they became
        final, then any other; uninformative ones, dropped). The others stay queued, in their order."""
        whole = [g for g in chosen if len(g.done) == self.n]
        for group in whole:
            self._waiting.remove(group)
        rank = {uid: k for k, uid in enumerate(order)}
        informative = sorted((g for g in whole if self._informative(g)), key=lambda g: rank.get(g.spec.uid, len(rank)))
        dropped = [g for g in whole if not self._informative(g)]
        if dropped:
            logger.debug("dropped %d prompt groups whose samples all got one reward", len(dropped))
        return informative, dropped

    def _informative(self, group: _Group) -> bool:
        scores = [_score(row) for row in group.done.values()]
        return self.n == 1 or max(scores) != min(scores)


def _score(row: dict[str, Any]) -> float:
    reward = row.get("rewards")
    if isinstance(reward, list):
        return float(sum(reward))
    return float(cast(float, reward or 0.0))


def empty_output(metrics: dict[str, Any] | None = None) -> GeneratorOutput:
    """A ``GeneratorOutput`` of no rows."""
    return {
        "prompt_token_ids": [],
        "response_ids": [],
        "rewards": [],
        "loss_masks": [],
        "stop_reasons": [],
        "rollout_metrics": metrics,
        "rollout_logprobs": None,
        "rollout_expert_indices": None,
    }
