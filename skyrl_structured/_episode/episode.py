"""One episode: turns of engine call and environment step, with SkyRL's token bookkeeping.

Kept token-for-token identical to SkyRL's ``SkyRLGymGenerator.agent_loop``: the three ways of
growing the sequence (multi-turn chat messages, one continued assistant message, re-tokenizing
with a custom template), step-wise samples, stop-string EOS, and reward placement. An
:class:`Episode` holds what is fixed per generator; each :meth:`Episode.run` keeps its own state.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, Protocol

from .._runtime.contexts import RolloutContext
from .._runtime.parking import RolloutParked
from .._runtime.versions import NOT_SAMPLED
from ..engines._no_partial import no_partial_reason
from ..engines.partial import PartialReply, collecting_partial
from ..errors import PromptTooLongError
from ..types import (
    ConversationType,
    EnvHandle,
    InferenceEngineInput,
    RolloutOutput,
    SkyRLConfig,
    StepWiseOutput,
    TrajectoryOutput,
)
from .calls import engine_call, env_call
from .chat import ChatTokenizer
from .parked import ParkedState, continuation_params
from .state import Partial, Run, Turn

__all__ = ["Episode", "EpisodeRunner", "PromptTooLongError"]

logger = logging.getLogger(__name__)

#: ``encode(new_obs, is_done)``: the token ids an observation adds (the generator's
#: ``get_obs_ids_from_obs``, so a subclass that overrides it is honoured).
ObservationEncoder = Callable[[ConversationType, bool], list[int]]


class EpisodeRunner(Protocol):
    """What the generator's ``agent_loop`` runs inside an open environment (text or vision-language turns).

    The engine session of every request is the rollout's, ``context.ref.session_id`` (set by ``agent_loop``).
    """

    async def run(
        self,
        env: EnvHandle,
        prompt: ConversationType,
        *,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> RolloutOutput: ...


def eos_after_stop_string(
    generator_cfg: SkyRLConfig,
    stop: list[str] | None,
    text: str,
    ids: list[int],
    logprobs: list[float] | None,
    eos_token_id: int,
) -> bool:
    """SkyRL's ``append_eos_token_after_stop_str_in_multi_turn``: the one place of that rule.

    A reply that ends in one of the request's ``stop`` strings, and not already in EOS, gets the EOS
    id appended to ``ids`` (and a 0.0 logprob), in place; the caller masks that token out of the
    loss. Returns whether it was appended. Both episodes (text and vision) call it on multi-turn
    conversations only.
    """
    if (
        stop is None
        or not generator_cfg.append_eos_token_after_stop_str_in_multi_turn
        or not text.endswith(tuple(stop))
        or (ids and ids[-1] == eos_token_id)
    ):
        return False
    ids.append(eos_token_id)
    if logprobs is not None:
        logprobs.append(0.0)
    return True


class Episode:
    """Runs episodes for one generator configuration; testable on its own with any env and engine."""

    def __init__(
        self,
        *,
        generator_cfg: SkyRLConfig,
        chat: ChatTokenizer,
        custom_chat_template: str | None,
        encode_observation: ObservationEncoder,
        policy_model_name: str | None,
        routed_experts: bool,
    ) -> None:
        self.cfg = generator_cfg
        self.chat = chat
        self.custom_chat_template = custom_chat_template
        self.encode_observation = encode_observation
        self.policy_model_name = policy_model_name
        self.routed_experts = routed_experts
        self.multi_turn = bool(generator_cfg.use_conversation_multi_turn)
        self.step_wise = bool(generator_cfg.step_wise_trajectories)
        self.retokenize = bool(self.multi_turn and custom_chat_template)

    async def run(
        self,
        env: EnvHandle,
        prompt: ConversationType,
        *,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> RolloutOutput:
        """Play ``env`` against the engine until it is done (or out of input) and build the trajectory.

        Raises:
            RolloutParked: the straggler cutoff parked it (``generator.carry_over_cut_rollouts``).
        """
        run = await self._start(env, prompt, context, sampling_params)
        return await self.play(env, run, context, max_input_length, sampling_params, cache_salt)

    async def play(
        self,
        env: EnvHandle,
        run: Run,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> RolloutOutput:
        """Play ``run`` on from where it is (a fresh start, or a parked run resumed) and build the trajectory."""
        park = context.park
        while not run.done:
            if park is not None and park.requested:
                # Asked to park while its engine call returned anyway: parks at this turn boundary.
                raise RolloutParked(ParkedState(self, run))
            if max_input_length is not None and len(run.input_ids) > max_input_length:
                run.stop_reason = "length"
                if not self.step_wise and not run.per_step_rewards:
                    raise PromptTooLongError(
                        f"the prompt is {len(run.input_ids)} tokens after env.init, longer than "
                        f"generator.max_input_length={max_input_length}; raise max_input_length or shorten "
                        "the prompt"
                    )
                break
            if self.step_wise or self.retokenize:
                # Re-render the whole history so the length check above sees the real input.
                run.input_ids = self._render(run.chat_history, add_generation_prompt=True)
                run.loss_mask = []
                run.rollout_logprobs = None
                run.versions = None
            turn = await self._generate(run, context, sampling_params, cache_salt)
            reward = await self._step(env, run, turn, context)
            self._record(env, run, turn, reward)
        return self._finish(env, run)

    # ------------------------------------------------------------------ the seams of one turn

    def _render(self, history: ConversationType, *, add_generation_prompt: bool) -> list[int]:
        template = self.custom_chat_template if self.retokenize else None
        return self.chat.render(history, add_generation_prompt=add_generation_prompt, chat_template=template)

    async def _start(
        self,
        env: EnvHandle,
        prompt: ConversationType,
        context: RolloutContext,
        sampling_params: dict[str, Any] | None,
    ) -> Run:
        chat_history, _ = await env_call(context, "init", 0, lambda: env.init(copy.deepcopy(prompt)), timed=False)
        # With re-tokenization the generation prompt would land in both prompt and response ids.
        initial_ids = self._render(chat_history, add_generation_prompt=not self.retokenize)
        # Read only (stop strings, logprobs): one dict per batch serves every rollout.
        params = sampling_params if sampling_params is not None else context.batch.default_params
        return Run(
            chat_history=chat_history,
            input_ids=initial_ids,
            initial_prompt_length=len(initial_ids),
            initial_history_length=len(chat_history),
            params=params,
            rollout_logprobs=[] if params.get("logprobs", None) is not None else None,
            versions=None if self.retokenize or self.step_wise else [],
        )

    async def _generate(
        self,
        run: Run,
        context: RolloutContext,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> Turn:
        partial = run.partial
        # Seeded from (prompt, sample, turn) with generator.sampling_seed; as given without it.
        params = context.request_params(sampling_params, run.engine_calls)
        prompt_ids = list(run.input_ids)
        if partial is not None:
            # A parked request continued: its sampled tokens extend the prompt, the budget shrinks by them.
            prompt_ids += partial.ids
            params = continuation_params(
                params, context, len(partial.ids), self.cfg.sampling_params.max_generate_length
            )
        version = context.policy_version
        if params is not None and params.get("max_tokens") == 0:
            # The parked request had sampled its whole budget: nothing is left to ask for.
            output, output_ids, run.stop_reason, output_logprobs, expert_indices = "", [], "length", [], None
            run.engine_calls += 1
        else:
            engine_input: InferenceEngineInput = {
                "prompt_token_ids": [prompt_ids],
                "session_ids": [context.ref.session_id],
                "sampling_params": params,
                "cache_salt": cache_salt,
            }
            output, output_ids, run.stop_reason, output_logprobs, expert_indices = await self._call_engine(
                run, context, engine_input, version
            )
        versions = [version] * len(output_ids)
        if partial is not None:
            run.partial = None
            output = partial.text + output
            output_ids = partial.ids + output_ids
            versions = partial.versions + versions
            if output_logprobs is not None:
                output_logprobs = (partial.logprobs or [0.0] * len(partial.ids)) + output_logprobs
        if output_logprobs is not None and self.custom_chat_template is not None:
            raise ValueError(
                "the engine returned logprobs, but logprob bookkeeping is not supported with a custom "
                "chat template; set generator.sampling_params.logprobs=null"
            )
        if expert_indices is not None and self.custom_chat_template is not None:
            raise ValueError(
                "routed expert indices are not supported with a custom chat template; disable "
                "generator.inference_engine.enable_return_routed_experts"
            )
        added_eos = self.multi_turn and eos_after_stop_string(
            self.cfg, run.params.get("stop", None), output, output_ids, output_logprobs, self.chat.eos_token_id
        )
        if added_eos:
            versions.append(NOT_SAMPLED)
        return Turn(output, output_ids, output_logprobs, expert_indices, added_eos, versions)

    async def _call_engine(
        self, run: Run, context: RolloutContext, engine_input: InferenceEngineInput, version: int
    ) -> Any:
        """One engine request; with carry-over, in a scope the cutoff may cancel to park the rollout."""
        turn = run.engine_calls
        run.engine_calls += 1
        prompt_tokens = len((engine_input.get("prompt_token_ids") or [[]])[0])

        def request() -> Any:
            return context.client.generate(engine_input, model=self.policy_model_name)

        park = context.park
        if park is None:
            return await engine_call(context, turn, prompt_tokens, request)
        parts = None
        scope = park.call_scope()
        try:
            with scope, collecting_partial() as sink:
                parts = await engine_call(context, turn, prompt_tokens, request)
        finally:
            park.call_ended()
        if parts is None:  # the cutoff cancelled the request: park with what the engine had sampled
            run.engine_calls = turn  # the continuation is the same request: the same turn, the same seed
            run.partial = self._kept_partial(run.partial, sink.reply, version, context)
            raise RolloutParked(ParkedState(self, run))
        return parts

    def _kept_partial(
        self, before: Partial | None, offered: PartialReply | None, version: int, context: RolloutContext
    ) -> Partial | None:
        """The partial reply a parked rollout keeps: what an earlier cut kept plus what this engine offered."""
        if offered is None:
            parking = context.batch.parking
            if parking is not None and not parking.said_no_partial:
                parking.said_no_partial = True
                logger.info(
                    "the engine handed back no partial reply for a request the straggler cutoff stopped (%s): the "
                    "parked rollout resumes from its last finished turn and that request is sampled again",
                    no_partial_reason(context.client),
                )
            return before
        return (before or Partial([], [], "", [])).extended(offered, version)

    async def _step(self, env: EnvHandle, run: Run, turn: Turn, context: RolloutContext) -> float:
        step = run.engine_calls - 1
        step_output = await env_call(context, "step", step, lambda: env.step(turn.output), timed=True)
        turn.new_obs = step_output["observations"]
        run.done = step_output["done"]
        postprocessed_action = step_output.get("postprocessed_action", None)
        if postprocessed_action is not None:
            logger.warning(
                "the environment rewrote the action (postprocessed_action); its tokens are re-encoded "
                "from text, which breaks token-in-token-out"
            )
            turn.output = postprocessed_action
            turn.output_ids = self.chat.tokenizer.encode(turn.output, add_special_tokens=False)
        turn.obs_ids = self.encode_observation(turn.new_obs, run.done)
        reward: float = step_output["reward"]
        return reward

    def _record(self, env: EnvHandle, run: Run, turn: Turn, reward: float) -> None:
        if self.step_wise:
            run.steps.append(
                TrajectoryOutput(
                    response_ids=turn.output_ids + turn.obs_ids,
                    reward=reward,
                    loss_mask=turn.loss_mask(),
                    prompt_ids=run.input_ids,
                    rollout_logprobs=turn.logprobs(),
                    stop_reason=run.stop_reason,
                    env_metrics=env.get_metrics() if run.done else {},
                    rollout_expert_indices=turn.rollout_expert_indices,
                    policy_versions=turn.version_row(),
                )
            )
        run.chat_history.append({"role": "assistant", "content": self.chat.strip_eos_text(turn.output)})
        run.chat_history.extend(turn.new_obs)
        run.last_obs = turn.new_obs
        if self.retokenize:
            # Loss mask and response ids come from the custom template at the end.
            run.loss_mask = None
            run.response_end_idx = None
            run.rollout_logprobs = None
            run.rollout_expert_indices = None
        elif self.multi_turn:
            self._extend_multi_turn(run, turn)
        else:
            self._extend_single_turn(run, turn)
        run.per_step_rewards.append((reward, run.response_end_idx))

    def _extend_multi_turn(self, run: Run, turn: Turn) -> None:
        """Token-in-token-out with one chat message per turn."""
        if self.step_wise:
            # Step-wise rollouts keep no running sequence: each turn is its own sample.
            run.response_end_idx = len(turn.output_ids) - 1
            run.loss_mask = None
            run.rollout_logprobs = None
            run.rollout_expert_indices = None
            return
        assert run.loss_mask is not None
        turn_logprobs = turn.logprobs()
        run.response_end_idx = len(run.input_ids) + len(turn.output_ids) - 1
        run.input_ids += turn.output_ids + turn.obs_ids
        run.loss_mask += turn.loss_mask()
        if run.versions is not None:
            run.versions += turn.version_row()
        if run.rollout_logprobs is not None and turn_logprobs is not None:
            run.rollout_logprobs += turn_logprobs
        if turn.rollout_expert_indices is not None:
            # The engine returns routing for the whole sequence so far: keep the latest.
            run.rollout_expert_indices = turn.rollout_expert_indices

    def _extend_single_turn(self, run: Run, turn: Turn) -> None:
        """Token-in-token-out inside one assistant message: EOS dropped, observations as raw text."""
        assert run.loss_mask is not None
        response = list(turn.output_ids)
        if response and response[-1] == self.chat.eos_token_id:
            response.pop()
        run.response_end_idx = len(run.input_ids) + len(response) - 1
        run.input_ids += response + turn.obs_ids
        run.loss_mask += [1] * len(response) + [0] * len(turn.obs_ids)
        if run.versions is not None:
            run.versions += turn.versions[: len(response)] + [NOT_SAMPLED] * len(turn.obs_ids)
        if run.rollout_logprobs is not None and turn.output_logprobs is not None:
            run.rollout_logprobs += turn.output_logprobs[: len(response)] + [0.0] * len(turn.obs_ids)
        if self.routed_experts and turn.rollout_expert_indices is not None:
            run.rollout_expert_indices = turn.rollout_expert_indices

    # ------------------------------------------------------------------ the trajectory

    def _finish(self, env: EnvHandle, run: Run) -> RolloutOutput:
        env_metrics = env.get_metrics()
        if self.step_wise:
            for step, (reward, end) in zip(run.steps, run.per_step_rewards, strict=True):
                token_rewards = [0.0] * len(step.response_ids)
                assert end is not None
                token_rewards[end] = float(reward)
                step.reward = token_rewards
            return StepWiseOutput(step_outputs=run.steps)
        return self._assemble(run, env_metrics)

    def _assemble(self, run: Run, env_metrics: dict[str, Any]) -> TrajectoryOutput:
        """The rollout's final trajectory: the last observation cut off, rewards placed on tokens."""
        prompt_ids = run.input_ids[: run.initial_prompt_length]
        logprobs: list[float] | None = None
        versions: list[int] | None = None
        expert_indices = None
        if self.retokenize:
            assert self.custom_chat_template is not None
            history = run.chat_history
            response_messages = history[run.initial_history_length : len(history) - len(run.last_obs)]
            response_ids, loss_mask = self.chat.assistant_spans(response_messages, self.custom_chat_template)
            rewards_at = run.per_step_rewards
        else:
            assert run.loss_mask is not None
            assert run.response_end_idx is not None
            end = run.response_end_idx - run.initial_prompt_length + 1
            assert not any(run.loss_mask[end:]), "loss mask after the response end must be all 0"
            loss_mask = run.loss_mask[:end]
            response_ids = run.input_ids[run.initial_prompt_length : run.response_end_idx + 1]
            if run.rollout_logprobs is not None:
                logprobs = run.rollout_logprobs[:end]
            if run.versions is not None:
                versions = run.versions[:end]
            if run.rollout_expert_indices is not None:
                expert_indices = run.rollout_expert_indices[: run.response_end_idx + 1]
            rewards_at = [
                (reward, idx - run.initial_prompt_length if idx is not None else None)
                for reward, idx in run.per_step_rewards
            ]
            assert len(loss_mask) == len(response_ids)

        appended_eos = False
        eos = self.chat.eos_token_id
        if not self.multi_turn and run.stop_reason != "length" and response_ids and response_ids[-1] != eos:
            response_ids.append(eos)
            loss_mask.append(1)
            if logprobs is not None:
                logprobs.append(0.0)
            if versions is not None:
                versions.append(NOT_SAMPLED)
            appended_eos = True

        return TrajectoryOutput(
            response_ids=response_ids,
            reward=self._place_rewards(rewards_at, response_ids, appended_eos),
            stop_reason=run.stop_reason,
            loss_mask=loss_mask,
            prompt_ids=prompt_ids,
            rollout_logprobs=logprobs,
            env_metrics=env_metrics,
            rollout_expert_indices=expert_indices,
            policy_versions=versions,
        )

    def _place_rewards(
        self, per_step_rewards: list[tuple[float, int | None]], response_ids: list[int], appended_eos: bool
    ) -> float | list[float]:
        """Per-token rewards at each turn's last token; the last step's reward with a custom template."""
        if self.custom_chat_template:
            return per_step_rewards[-1][0]
        token_rewards = [0.0] * len(response_ids)
        last = len(per_step_rewards) - 1
        for i, (reward, idx) in enumerate(per_step_rewards):
            assert reward is not None
            assert idx is not None
            if idx >= len(response_ids):
                break
            if appended_eos and i == last:
                # The reward belongs on the EOS we appended, where the trainer looks for it.
                token_rewards[-1] = reward
            else:
                token_rewards[idx] += reward
        return token_rewards
