"""A captured session as training rows: which branch is the rollout's main conversation, and its rows.

An agent's session may hold several branches: its main conversation, side calls it made on the way (a
title, a summary, a quota check: Claude Code makes them on a small model, in parallel with the main
turn), forks, and the branches a template that is not append-only starts. The row is the main
conversation whatever order the calls completed in (issue 45); :func:`main_branch` holds the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import AgentError
from ..types import StepWiseOutput, TrajectoryOutput
from ._apierrors import APIError
from ._capture import Branch, CallTag, Capture

if TYPE_CHECKING:
    from ._session import CaptureSession

__all__ = ["BRANCH_HEADER", "call_tag", "main_branch", "step_wise", "trajectory"]

#: The request header that names a call's conversation: ``main`` (this call's branch is the row) or ``side``.
BRANCH_HEADER = "x-skyrl-branch"
_MARKS = ("main", "side")


def call_tag(headers: Mapping[str, str], model: Any, served_model: str) -> CallTag:
    """What one request says about its conversation: its ``x-skyrl-branch`` mark, and whether it names the
    served model. ``headers`` are keyed in lower case.

    Raises:
        APIError: 400 when ``x-skyrl-branch`` is neither ``main`` nor ``side``.
    """
    mark = headers.get(BRANCH_HEADER)
    if mark is not None:
        mark = mark.strip().lower()
        if mark not in _MARKS:
            raise APIError(
                400,
                f"`{BRANCH_HEADER}: {headers[BRANCH_HEADER]}` is not a branch mark; send `main` (this call's "
                "conversation is the rollout's row) or `side` (it is not), or leave the header out",
                param=BRANCH_HEADER,
            )
    return CallTag(mark, served=model == served_model)


def main_branch(capture: Capture) -> int:
    """The index of the rollout's main conversation among ``capture``'s branches (its calls must not be empty).

    In order:

    1. the branch of the last call marked ``x-skyrl-branch: main``, if any;
    2. otherwise, among the branches with a call not marked ``side`` (all of them if every call is), and
       of those only the ones with a call naming the served model if any does: the branch whose
       conversation has the most turns (assistant messages sent, plus the reply); then the longest in
       tokens; then the one whose last call completed last.

    Completion order decides only a full tie, so a side call answered after the main conversation's
    last turn does not become the row.
    """
    calls = capture.calls
    marked = [call.branch for call in calls if call.tag.mark == "main"]
    if marked:
        return marked[-1]
    candidates = {call.branch for call in calls if call.tag.mark != "side"} or {call.branch for call in calls}
    served = {call.branch for call in calls if call.branch in candidates and call.tag.served}
    candidates = served or candidates
    turns: dict[int, int] = {}
    last: dict[int, int] = {}
    for order, call in enumerate(calls):
        turns[call.branch] = max(turns.get(call.branch, 0), call.turns)
        last[call.branch] = order
    return max(candidates, key=lambda b: (turns[b], capture.branches[b].length, last[b]))


def _main(session: CaptureSession) -> int:
    """The session's main branch; an agent that made no call fails by name."""
    if not session.capture.calls:
        raise AgentError(
            f"rollout {session.rollout}: the agent made no chat completion request to its base URL "
            f"{session.base_url}; point its OpenAI client there (base_url=ctx.base_url, api_key=ctx.api_key)"
        )
    return main_branch(session.capture)


def _row(branch: Branch, prompt_ids: list[int], span: slice, reward: float | None, stop: str) -> TrajectoryOutput:
    """A training row: ``prompt_ids``, then ``branch``'s response tokens in ``span``; ``reward`` on the last token."""
    response = branch.response_ids[span]
    rewards = [0.0] * len(response)
    if reward is not None:
        rewards[-1] = reward
    return TrajectoryOutput(
        response_ids=list(response),
        reward=rewards,
        stop_reason=stop,
        loss_mask=list(branch.loss_mask[span]),
        prompt_ids=list(prompt_ids),
        rollout_logprobs=list(branch.logprobs[span]) if branch.has_logprobs else None,
        env_metrics={},
    )


def trajectory(session: CaptureSession, reward: float) -> TrajectoryOutput:
    """The rollout's row outside step-wise mode: its main branch (other branches are counted only)."""
    branch = session.capture.branches[_main(session)]
    return _row(branch, branch.prompt_ids, slice(None), reward, branch.stop_reason)


def step_wise(session: CaptureSession, reward: float) -> StepWiseOutput:
    """Every branch as steps, one per call: no captured token is left out.

    A call's step is its engine prompt, then what it sampled (loss mask 1) and the tokens rendered
    after it on its branch up to the next call (loss mask 0), so a branch's steps, concatenated,
    are the branch from its first call on (a fork's shared ids are its source's steps). The
    branches come in order, the main branch last: its last step ends the rollout and carries the
    reward (SkyRL broadcasts the last step's advantage to the others).
    """
    capture = session.capture
    main = _main(session)
    steps: list[TrajectoryOutput] = []
    for index in [*(b for b in range(len(capture.branches)) if b != main), main]:
        branch = capture.branches[index]
        calls = [call for call in capture.calls if call.branch == index]
        starts = [len(call.prompt_ids) - len(branch.prompt_ids) for call in calls] + [len(branch.response_ids)]
        for k, call in enumerate(calls):
            final = index == main and k == len(calls) - 1
            span = slice(starts[k], starts[k + 1])
            steps.append(_row(branch, call.prompt_ids, span, reward if final else None, call.stop_reason))
    return StepWiseOutput(step_outputs=steps)
