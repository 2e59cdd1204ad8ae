"""The agent loop's inner episode: turns of engine call and environment step, token bookkeeping.

Kept token-for-token identical to SkyRL's ``SkyRLGymGenerator.agent_loop``: the three ways of
growing the sequence (multi-turn chat messages, one continued assistant message, re-tokenizing
with a custom template), step-wise samples, stop-string EOS, and reward placement.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .config import routed_experts_enabled
from .tokens import ChatTokenizer
from .types import ConversationType, StepWiseOutput, TrajectoryOutput

__all__ = ["EpisodeMixin", "MalformedEngineReplyError", "PromptTooLongError", "using_client"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Batch:
    """What one ``generate()`` call fixes for all its rollouts (inherited by their tasks)."""

    generator: Any
    #: The client rollouts call: the generator's own, or a trio-asyncio bridge to it.
    client: Any
    #: ``asdict(generator_cfg.sampling_params)``, computed once rather than per rollout.
    default_params: dict[str, Any]


_BATCH: ContextVar[_Batch | None] = ContextVar("skyrl_structured_batch", default=None)


@contextmanager
def using_client(generator: Any, client: Any) -> Iterator[None]:
    """Within the block, ``generator``'s rollouts call ``client`` instead of its own client."""
    token = _BATCH.set(_Batch(generator, client, _sampling_params_dict(generator.generator_cfg.sampling_params)))
    try:
        yield
    finally:
        _BATCH.reset(token)


class PromptTooLongError(ValueError):
    """A rollout's first prompt is already longer than ``generator.max_input_length``."""


class MalformedEngineReplyError(ValueError):
    """The engine's reply to a rollout's request breaks the ``InferenceEngineOutput`` contract.

    Raised inside the rollout that made the request, so it is that rollout's failure: a placeholder
    with ``generator.skip_failed_rollouts``, else the error ``generate()`` raises. Caught here, a bad
    reply cannot misalign tokens and logprobs or fail the whole batch later, in output building.
    """


#: What one reply carries for its single prompt: text, token ids (a fresh list), stop reason,
#: logprobs (a fresh list, or None) and routed expert indices (or None).
_ReplyParts = tuple[str, list[int], str, list[float] | None, Any]

_REQUIRED_REPLY_FIELDS = ("responses", "response_ids", "stop_reasons")


def _kind(value: Any) -> str:
    return "None" if value is None else f"of type {type(value).__name__}"


def _malformed(field: str, problem: str, fix: str) -> MalformedEngineReplyError:
    return MalformedEngineReplyError(f"the engine's reply field `{field}` {problem}; {fix}")


def _only_entry(reply: Mapping[str, Any], key: str) -> Any:
    """The single entry of the reply's per-prompt list ``key`` (a rollout's request has one prompt)."""
    value = reply[key]
    if not isinstance(value, list | tuple):
        raise _malformed(
            key,
            f"is {_kind(value)}, expected a list with one entry per prompt",
            "an engine must return every per-prompt field as a list, even for a single prompt",
        )
    if len(value) != 1:
        raise _malformed(
            key,
            f"has {len(value)} entries, expected 1 (the request carried one prompt)",
            "an engine must return exactly one entry per prompt, in request order",
        )
    return value[0]


def _read_reply(reply: Any) -> _ReplyParts:
    """Check an engine reply to a one-prompt request and take its parts apart.

    Cheap by design (it runs once per turn): batch shapes, types, the first and last token's type
    and one length comparison; no per-token scan. A reply with no tokens is malformed too: an engine
    returns at least one token for ``max_tokens >= 1`` (EOS included when generation stopped on it),
    and token bookkeeping (stop-string EOS, reward placement) needs a last token.

    Raises:
        MalformedEngineReplyError: a missing field, a batch list without exactly one entry, a wrong
            type, no tokens, or logprobs whose count differs from the token count.
    """
    if not isinstance(reply, Mapping):
        raise MalformedEngineReplyError(
            f"the engine's reply is {_kind(reply)}, expected a dict with `responses`, `response_ids` and "
            "`stop_reasons` (InferenceEngineOutput); check what the inference client's generate() returns"
        )
    for key in _REQUIRED_REPLY_FIELDS:
        if key not in reply:
            raise MalformedEngineReplyError(
                f"the engine's reply has no field `{key}` (it has {sorted(map(str, reply))}); an engine must "
                "return `responses`, `response_ids` and `stop_reasons`, each a list with one entry per prompt"
            )
    text = _only_entry(reply, "responses")
    if not isinstance(text, str):
        raise _malformed(
            "responses[0]", f"is {_kind(text)}, expected the response text (str)", "an engine must return decoded text"
        )
    ids = _only_entry(reply, "response_ids")
    if not isinstance(ids, list | tuple):
        raise _malformed(
            "response_ids[0]",
            f"is {_kind(ids)}, expected a list of token ids (int)",
            "convert tensors or arrays with .tolist()",
        )
    if not ids:
        raise _malformed(
            "response_ids[0]",
            "is empty, expected at least one token",
            "an engine must return the generated token ids (EOS included when generation stopped on it), "
            "with max_tokens >= 1",
        )
    for position in (0, len(ids) - 1):
        if type(ids[position]) is not int:
            raise _malformed(
                "response_ids[0]",
                f"holds a value {_kind(ids[position])} at position {position}, expected token ids of type int",
                "convert tensors or arrays with .tolist()",
            )
    stop_reason = _only_entry(reply, "stop_reasons")
    if not isinstance(stop_reason, str):
        raise _malformed(
            "stop_reasons[0]",
            f'is {_kind(stop_reason)}, expected a str such as "stop" or "length"',
            "an engine must report why each response ended",
        )
    logprobs: list[float] | None = None
    if reply.get("response_logprobs", None) is not None:
        entry = _only_entry(reply, "response_logprobs")
        if not isinstance(entry, list | tuple):
            raise _malformed(
                "response_logprobs[0]",
                f"is {_kind(entry)}, expected a list of floats, one per token",
                "return `response_logprobs: None` when logprobs were not requested",
            )
        if len(entry) != len(ids):
            raise _malformed(
                "response_logprobs[0]",
                f"has {len(entry)} entries but `response_ids[0]` has {len(ids)} tokens",
                "an engine must return one logprob per token",
            )
        logprobs = list(entry)
    indices_batch = reply.get("rollout_expert_indices", None)
    expert_indices = indices_batch[0] if indices_batch is not None else None
    return text, list(ids), stop_reason, logprobs, expert_indices


@dataclass
class _LoopState:
    chat_history: ConversationType
    input_ids: list[int]
    loss_mask: list[int] | None
    rollout_logprobs: list[float] | None
    response_end_idx: int | None
    done: bool
    rollout_expert_indices: Any | None = None


@dataclass
class _Turn:
    output: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    new_obs: ConversationType
    obs_ids: list[int]
    rollout_expert_indices: Any | None
    added_eos: bool

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


def _sampling_params_dict(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, Mapping):
        return dict(params)
    return dict(vars(params))


class EpisodeMixin:
    """The episode half of :class:`~skyrl_structured.StructuredGymGenerator`."""

    generator_cfg: Any
    inference_engine_client: Any
    policy_model_name: str | None
    use_conversation_multi_turn: bool
    custom_chat_template: str | None
    _chat: ChatTokenizer

    def get_obs_ids_from_obs(self, new_obs: ConversationType, is_done: bool) -> list[int]:
        """Token ids an observation adds (chat-formatted in multi-turn mode, raw text otherwise)."""
        return self._chat.observation_ids(new_obs, done=is_done, multi_turn=self.use_conversation_multi_turn)

    def _batch(self) -> _Batch | None:
        batch = _BATCH.get()
        return batch if batch is not None and batch.generator is self else None

    def _engine(self) -> Any:
        """The client to call: the batch's (possibly bridged) client, else the generator's own."""
        batch = self._batch()
        return batch.client if batch is not None else self.inference_engine_client

    def _default_sampling_params(self) -> dict[str, Any]:
        batch = self._batch()
        return batch.default_params if batch is not None else _sampling_params_dict(self.generator_cfg.sampling_params)

    def _retokenizes(self) -> bool:
        return bool(self.use_conversation_multi_turn and self.custom_chat_template)

    def _append_turn_to_history(self, history: ConversationType, output: str, new_obs: ConversationType) -> None:
        history.append({"role": "assistant", "content": self._chat.strip_eos_text(output)})
        history.extend(new_obs)

    async def _run_episode(
        self,
        env: Any,
        prompt: ConversationType,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        session_id: Hashable,
        cache_salt: str | None,
        time_splits: dict[str, float],
    ) -> TrajectoryOutput | StepWiseOutput:
        cfg = self.generator_cfg
        chat = self._chat
        retokenize = self._retokenizes()
        step_wise = bool(cfg.step_wise_trajectories)
        multi_turn = self.use_conversation_multi_turn

        chat_history, _ = await env.init(copy.deepcopy(prompt))
        initial_history_length = len(chat_history)
        initial_ids = chat.render(
            chat_history,
            # With re-tokenization the generation prompt would land in both prompt and response ids.
            add_generation_prompt=not retokenize,
            chat_template=self.custom_chat_template if retokenize else None,
        )
        initial_prompt_length = len(initial_ids)
        # Read only (stop strings, logprobs): one dict per batch serves every rollout.
        current_params = sampling_params if sampling_params is not None else self._default_sampling_params()
        stop_strings: list[str] | None = current_params.get("stop", None)
        append_eos_after_stop = (
            stop_strings is not None and cfg.append_eos_token_after_stop_str_in_multi_turn and multi_turn
        )
        eos = chat.eos_token_id
        state = _LoopState(
            chat_history=chat_history,
            input_ids=initial_ids,
            loss_mask=[],
            rollout_logprobs=[] if current_params.get("logprobs", None) is not None else None,
            response_end_idx=None,
            done=False,
        )
        # (reward, index of the last response token of that turn)
        per_step_rewards: list[tuple[float, int | None]] = []
        steps: list[TrajectoryOutput] = []
        stop_reason = "length"
        new_obs: ConversationType = []

        while not state.done:
            if max_input_length is not None and len(state.input_ids) > max_input_length:
                stop_reason = "length"
                if not step_wise and not per_step_rewards:
                    raise PromptTooLongError(
                        f"the prompt is {len(state.input_ids)} tokens after env.init, longer than "
                        f"generator.max_input_length={max_input_length}; raise max_input_length or shorten "
                        "the prompt"
                    )
                break

            if step_wise or retokenize:
                # Re-render the whole history so the length check above sees the real input.
                state.input_ids = chat.render(
                    chat_history,
                    add_generation_prompt=True,
                    chat_template=self.custom_chat_template if retokenize else None,
                )
                state.loss_mask = []
                state.rollout_logprobs = None

            engine_input = {
                "prompt_token_ids": [list(state.input_ids)],
                "session_ids": [session_id],
                "sampling_params": sampling_params,
                "cache_salt": cache_salt,
            }
            llm_started = time.monotonic()
            try:
                engine_output = await self._engine().generate(engine_input, model=self.policy_model_name)
            finally:
                # Recorded on every exit: a failed rollout's placeholder reports where its time went.
                time_splits["llm"] += time.monotonic() - llm_started
            # Checked before any use: a bad reply fails this rollout alone, never the batch.
            output, output_ids, stop_reason, output_logprobs, expert_indices = _read_reply(engine_output)
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

            added_eos = False
            if (
                append_eos_after_stop
                and stop_strings is not None
                and output.endswith(tuple(stop_strings))
                and (not output_ids or output_ids[-1] != eos)
            ):
                output_ids.append(eos)
                if output_logprobs is not None:
                    output_logprobs.append(0.0)
                added_eos = True

            env_started = time.monotonic()
            try:
                step_output = await env.step(output)
            finally:
                time_splits["env"] += time.monotonic() - env_started
            new_obs = step_output["observations"]
            step_reward = step_output["reward"]
            state.done = step_output["done"]

            if step_output.get("postprocessed_action", None) is not None:
                logger.warning(
                    "the environment rewrote the action (postprocessed_action); its tokens are re-encoded "
                    "from text, which breaks token-in-token-out"
                )
                output = step_output["postprocessed_action"]
                output_ids = chat.tokenizer.encode(output, add_special_tokens=False)

            turn = _Turn(
                output=output,
                output_ids=output_ids,
                output_logprobs=output_logprobs,
                new_obs=new_obs,
                obs_ids=self.get_obs_ids_from_obs(new_obs, state.done),
                rollout_expert_indices=expert_indices,
                added_eos=added_eos,
            )

            if step_wise:
                steps.append(
                    TrajectoryOutput(
                        response_ids=turn.output_ids + turn.obs_ids,
                        reward=step_reward,
                        loss_mask=turn.loss_mask(),
                        prompt_ids=state.input_ids,
                        rollout_logprobs=turn.logprobs(),
                        stop_reason=stop_reason,
                        env_metrics=env.get_metrics() if state.done else {},
                        rollout_expert_indices=turn.rollout_expert_indices,
                    )
                )

            self._append_turn_to_history(state.chat_history, turn.output, turn.new_obs)
            if retokenize:
                # Loss mask and response ids come from the custom template at the end.
                state.loss_mask = None
                state.response_end_idx = None
                state.rollout_logprobs = None
                state.rollout_expert_indices = None
            elif multi_turn:
                self._extend_multi_turn(state, turn, step_wise)
            else:
                self._extend_single_turn(state, turn)
            per_step_rewards.append((step_reward, state.response_end_idx))

        env_metrics = env.get_metrics()
        if step_wise:
            for step, (reward, end) in zip(steps, per_step_rewards, strict=True):
                token_rewards = [0.0] * len(step.response_ids)
                assert end is not None
                token_rewards[end] = float(reward)
                step.reward = token_rewards
            return StepWiseOutput(step_outputs=steps)
        return self._assemble(
            state,
            initial_prompt_length=initial_prompt_length,
            initial_history_length=initial_history_length,
            last_obs=new_obs,
            per_step_rewards=per_step_rewards,
            stop_reason=stop_reason,
            env_metrics=env_metrics,
        )

    def _extend_multi_turn(self, state: _LoopState, turn: _Turn, step_wise: bool) -> None:
        """Token-in-token-out with one chat message per turn."""
        if step_wise:
            # Step-wise rollouts keep no running sequence: each turn is its own sample.
            state.response_end_idx = len(turn.output_ids) - 1
            state.loss_mask = None
            state.rollout_logprobs = None
            state.rollout_expert_indices = None
            return
        assert state.loss_mask is not None
        turn_logprobs = turn.logprobs()
        state.response_end_idx = len(state.input_ids) + len(turn.output_ids) - 1
        state.input_ids += turn.output_ids + turn.obs_ids
        state.loss_mask += turn.loss_mask()
        if state.rollout_logprobs is not None and turn_logprobs is not None:
            state.rollout_logprobs += turn_logprobs
        if turn.rollout_expert_indices is not None:
            # The engine returns routing for the whole sequence so far: keep the latest.
            state.rollout_expert_indices = turn.rollout_expert_indices

    def _extend_single_turn(self, state: _LoopState, turn: _Turn) -> None:
        """Token-in-token-out inside one assistant message: EOS dropped, observations as raw text."""
        assert state.loss_mask is not None
        response = list(turn.output_ids)
        if response and response[-1] == self._chat.eos_token_id:
            response.pop()
        state.response_end_idx = len(state.input_ids) + len(response) - 1
        state.input_ids += response + turn.obs_ids
        state.loss_mask += [1] * len(response) + [0] * len(turn.obs_ids)
        if state.rollout_logprobs is not None and turn.output_logprobs is not None:
            state.rollout_logprobs += turn.output_logprobs[: len(response)] + [0.0] * len(turn.obs_ids)
        if self._routed_experts() and turn.rollout_expert_indices is not None:
            state.rollout_expert_indices = turn.rollout_expert_indices

    def _routed_experts(self) -> bool:
        return routed_experts_enabled(self.generator_cfg)

    def _assemble(
        self,
        state: _LoopState,
        *,
        initial_prompt_length: int,
        initial_history_length: int,
        last_obs: ConversationType,
        per_step_rewards: list[tuple[float, int | None]],
        stop_reason: str,
        env_metrics: dict[str, Any],
    ) -> TrajectoryOutput:
        """The rollout's final trajectory: the last observation cut off, rewards placed on tokens."""
        prompt_ids = state.input_ids[:initial_prompt_length]
        logprobs: list[float] | None = None
        expert_indices = None
        if self._retokenizes():
            assert self.custom_chat_template is not None
            response_messages = state.chat_history[initial_history_length : len(state.chat_history) - len(last_obs)]
            response_ids, loss_mask = self._chat.assistant_spans(response_messages, self.custom_chat_template)
            rewards_at = per_step_rewards
        else:
            assert state.loss_mask is not None
            assert state.response_end_idx is not None
            end = state.response_end_idx - initial_prompt_length + 1
            assert not any(state.loss_mask[end:]), "loss mask after the response end must be all 0"
            loss_mask = state.loss_mask[:end]
            response_ids = state.input_ids[initial_prompt_length : state.response_end_idx + 1]
            if state.rollout_logprobs is not None:
                logprobs = state.rollout_logprobs[:end]
            if state.rollout_expert_indices is not None:
                expert_indices = state.rollout_expert_indices[: state.response_end_idx + 1]
            rewards_at = [
                (reward, idx - initial_prompt_length if idx is not None else None) for reward, idx in per_step_rewards
            ]
            assert len(loss_mask) == len(response_ids)

        appended_eos = False
        eos = self._chat.eos_token_id
        if (
            not self.use_conversation_multi_turn
            and stop_reason != "length"
            and response_ids
            and response_ids[-1] != eos
        ):
            response_ids.append(eos)
            loss_mask.append(1)
            if logprobs is not None:
                logprobs.append(0.0)
            appended_eos = True

        return TrajectoryOutput(
            response_ids=response_ids,
            reward=self._place_rewards(rewards_at, response_ids, appended_eos),
            stop_reason=stop_reason,
            loss_mask=loss_mask,
            prompt_ids=prompt_ids,
            rollout_logprobs=logprobs,
            env_metrics=env_metrics,
            rollout_expert_indices=expert_indices,
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
