"""SkyRL's batched single-turn path (``generator.batched=true``): one engine call for the batch.

It goes through the agent loop's layers, with its collaborators passed down explicitly
(:class:`BatchedSetup` and the call's :class:`~skyrl_structured._runtime.contexts.BatchContext`,
never the generator): environments are opened and closed by the env layer (``open_env`` through
the generator's env executor, counted in ``CleanupStats``), prompts are templated by the
:class:`~skyrl_structured._episode.chat.ChatTokenizer`, the one reply is checked by
:func:`~skyrl_structured._episode.replies.read_replies`, and every prompt is a rollout to the
observers (one attempt each; see ``docs/observers.md`` for the events and their order).

The order of work is SkyRL's: each prompt's environment is made and initialised in turn, one
engine request carries every prompt, then each environment is stepped, measured and closed in
turn. There is no per-rollout failure containment (``skip_failed_rollouts`` is refused with
``batched``): an error stops the batch, after every environment opened has been closed.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from .._episode.calls import env_call, shared_engine_call
from .._episode.chat import ChatTokenizer
from .._episode.replies import ReplyParts
from .._runtime.contexts import BatchContext, BatchRequest, BatchShape, RolloutContext
from .._runtime.supervisor import describe_error
from ..envs import EnvSettings, open_env
from ..observe import RolloutObserver, RolloutRef
from ..types import ConversationType, EnvHandle, GeneratorOutput, TrajectoryOutput
from .collector import overlong_filtered
from .metrics import failure_metrics, rollout_metrics
from .versions import version_rows

__all__ = ["BatchedSetup", "generate_batched"]


@dataclass(frozen=True)
class BatchedSetup:
    """What the batched path takes from its generator: the env layer, the templating, the engine's name."""

    #: How the generator opens and closes environments (its executor, the close's bound, env configs).
    envs: EnvSettings
    #: Renders each initial prompt with the tokenizer's chat template (SkyRL applies no custom one here).
    chat: ChatTokenizer
    #: ``generator.max_turns``, written into each environment's extras (as SkyRL does).
    max_turns: int
    #: ``generator.apply_overlong_filtering``.
    overlong_filtering: bool
    #: Passed as ``model`` on the engine call.
    policy_model_name: str | None = None


async def generate_batched(
    batch: BatchContext, setup: BatchedSetup, request: BatchRequest, max_tokens: int
) -> GeneratorOutput:
    """Single-turn generation of the whole batch in one engine call (SkyRL's ``batched=True``).

    ``batch.client`` is called, ``batch.observers`` hear the batch's and each prompt's events,
    ``batch.cleanup`` counts the environments' cleanups (reported in ``rollout_metrics`` as in the
    agent loop). ``request.trajectory_ids`` only name the rollouts to the observers.

    Raises:
        MalformedEngineReplyError: the engine's reply breaks the ``InferenceEngineOutput`` contract
            for this request of ``len(request.prompts)`` prompts (the message names the field and row).
        Exception: whatever the engine, an environment or the tokenizer raised, once every
            environment opened has been closed.
    """
    count = len(request.prompts)
    batch.observers.emit(RolloutObserver.batch_started, count)
    rollouts = _Rollouts(batch, request.shape())
    try:
        trajectories = await _run(rollouts, setup, request, max_tokens)
        output = _output(trajectories, request.env_classes, batch, setup.overlong_filtering)
    except BaseException as exc:
        rollouts.abort(exc)
        batch.observers.emit(RolloutObserver.batch_aborted, count, exc)
        raise
    batch.observers.emit(RolloutObserver.batch_finished, count, 0)
    return output


class _Rollouts:
    """The batch's prompts as rollouts to the observers: one attempt each, started as its environment is made."""

    def __init__(self, batch: BatchContext, shape: BatchShape) -> None:
        self.batch = batch
        self.shape = shape
        self.started: list[RolloutContext] = []
        #: How many of the started attempts have ended (they end in prompt order).
        self.ended = 0

    def start(self, index: int) -> RolloutContext:
        trajectory_id = self.shape.trajectory_ids[index] if self.shape.trajectory_ids is not None else None
        context = RolloutContext(self.batch, RolloutRef(index, 1, trajectory_id))
        self.started.append(context)
        context.emit(RolloutObserver.attempt_started)
        return context

    def finish(self, context: RolloutContext, trajectory: TrajectoryOutput) -> None:
        """The attempt returned its trajectory (its environment is closed): its final events."""
        self.ended += 1
        elapsed = time.monotonic() - context.started
        context.emit(RolloutObserver.attempt_finished, elapsed)
        context.finish(trajectory, env_class=self.shape.env_class(context.ref.index))

    def abort(self, error: BaseException) -> None:
        """The batch stopped on ``error``: every attempt started and not ended failed with it, or was cancelled.

        An ``Exception`` fails them all (one engine call served them, and nothing replaces a row),
        with no retry; a cancellation or an interrupt cancels them. Prompts whose environment was
        never made have no events.
        """
        for context in self.started[self.ended :]:
            if not isinstance(error, Exception):
                context.emit(RolloutObserver.attempt_cancelled)
                continue
            elapsed = time.monotonic() - context.started
            context.emit(RolloutObserver.attempt_failed, error, elapsed, timed_out=False, will_retry=False)
            env_class = self.shape.env_class(context.ref.index)
            context.fail(describe_error(error), elapsed, env_class=env_class, timed_out=False, step_wise=False)
        self.ended = len(self.started)


@dataclass
class _Opened:
    """One prompt's rollout once its environment is initialised: the env, its own exit stack, its prompt ids."""

    context: RolloutContext
    env: EnvHandle
    closing: AsyncExitStack
    prompt_ids: list[int]


async def _run(
    rollouts: _Rollouts, setup: BatchedSetup, request: BatchRequest, max_tokens: int
) -> list[TrajectoryOutput]:
    """Open and init every environment, make the one engine call, then step and close each environment."""
    client = rollouts.batch.client
    async with AsyncExitStack() as stack:
        opened: list[_Opened] = []
        rows = zip(request.env_classes, request.env_extras, request.prompts, strict=True)
        for index, (env_class, extras, prompt) in enumerate(rows):
            opened.append(await _open(stack, rollouts.start(index), setup, env_class, extras, prompt))
        prompt_token_ids = [rollout.prompt_ids for rollout in opened]
        replies = await shared_engine_call(
            [rollout.context for rollout in opened],
            [len(ids) for ids in prompt_token_ids],
            lambda: client.generate(
                {
                    "prompt_token_ids": prompt_token_ids,
                    "sampling_params": request.sampling_params,
                    "cache_salt": request.cache_salt,
                },
                model=setup.policy_model_name,
            ),
        )
        trajectories: list[TrajectoryOutput] = []
        for rollout, parts in zip(opened, replies, strict=True):
            trajectory = await _step(rollout, parts, max_tokens)
            # Closed right after its step, as SkyRL does; the attempt ends with its close.
            await rollout.closing.aclose()
            trajectories.append(trajectory)
            rollouts.finish(rollout.context, trajectory)
    return trajectories


async def _step(rollout: _Opened, parts: ReplyParts, max_tokens: int) -> TrajectoryOutput:
    """Step one prompt's environment with its response; its row, the response cut to ``max_tokens`` (as SkyRL)."""
    text, ids, stop_reason, logprobs, expert_indices = parts
    env = rollout.env
    step_output = await env_call(rollout.context, "step", 0, lambda: env.step(text), timed=True)
    response = ids[:max_tokens]
    return TrajectoryOutput(
        response_ids=response,
        reward=step_output["reward"],
        stop_reason=stop_reason,
        loss_mask=[1] * len(response),
        prompt_ids=rollout.prompt_ids,
        rollout_logprobs=logprobs[: len(response)] if logprobs is not None else None,
        env_metrics=env.get_metrics(),
        rollout_expert_indices=(
            expert_indices[: len(rollout.prompt_ids) + len(response)] if expert_indices is not None else None
        ),
    )


async def _open(
    stack: AsyncExitStack,
    context: RolloutContext,
    setup: BatchedSetup,
    env_class: str,
    extras: dict[str, Any],
    prompt: ConversationType,
) -> _Opened:
    """Make and init one prompt's environment; it is closed by its own stack, which ``stack`` closes on an error."""
    extras["max_turns"] = setup.max_turns
    closing = AsyncExitStack()
    # Closing an already closed stack does nothing: the env is closed once, after its step or on the way out.
    stack.push_async_exit(closing)
    env = await closing.enter_async_context(
        open_env(env_class, setup.envs, extras=extras, stats=context.cleanup, rollout=context)
    )
    init_prompt, _ = await env_call(context, "init", 0, lambda: env.init(prompt), timed=False)
    # For token-in-token-out, as SkyRL: the tokenizer's own chat template, with the generation prompt.
    prompt_ids = setup.chat.render(init_prompt, add_generation_prompt=True)
    return _Opened(context, env, closing, prompt_ids)


def _output(
    trajectories: list[TrajectoryOutput], env_classes: list[str], batch: BatchContext, overlong_filtering: bool
) -> GeneratorOutput:
    """The batch's ``GeneratorOutput`` (SkyRL's batched keys and metrics), in prompt order."""
    responses = [t.response_ids for t in trajectories]
    rewards: list[Any] = [t.reward for t in trajectories]
    loss_masks = [t.loss_mask for t in trajectories]
    stop_reasons = [t.stop_reason for t in trajectories]
    metrics = rollout_metrics(responses, rewards, [t.env_metrics for t in trajectories], env_classes, loss_masks)
    metrics.update(failure_metrics([], len(trajectories), 0, batch.cleanup))
    has_logprobs = bool(trajectories) and trajectories[0].rollout_logprobs is not None
    has_indices = bool(trajectories) and trajectories[0].rollout_expert_indices is not None
    # One engine call: every sampled token is of the version the call started under (versions.py).
    version = batch.versions.value if batch.versions is not None else 0
    versions = version_rows(trajectories, version)
    return {
        "prompt_token_ids": [t.prompt_ids for t in trajectories],
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": overlong_filtered(loss_masks, stop_reasons) if overlong_filtering else loss_masks,
        "stop_reasons": stop_reasons,
        "rollout_metrics": metrics,
        "rollout_logprobs": [t.rollout_logprobs or [] for t in trajectories] if has_logprobs else None,
        "rollout_expert_indices": [t.rollout_expert_indices for t in trajectories] if has_indices else None,
        "rollout_policy_versions": versions,
    }
