"""One vision-language episode: the conversation rendered by the engine, token for token as SkyRL's VLM generator.

SkyRL's ``SkyRLVLMGymGenerator`` keeps the conversation (text and images) as the source of truth
and has the engine render it (``render_chat_completion``: chat template, tokens, image
placeholders and image features) before every turn. Generated tokens keep their logprobs and a
loss mask of 1; an observation's tokens are cut from the *next* render, past the previous input
and the generated tokens, with a loss mask of 0 (so each turn costs one render, not two).
Rewards sit on each turn's last generated token; the trajectory carries the image tensors of the
last render.

:class:`VisionEpisode` has the same ``run`` as :class:`~skyrl_structured._episode.episode.Episode`, so the
generator's ``agent_loop`` (environment, session end, deadlines, retries) is shared unchanged.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .._runtime.contexts import RolloutContext
from ..types import ConversationType, EnvHandle, InferenceEngineInput, RenderingClient, SkyRLConfig, TrajectoryOutput
from .calls import engine_call, env_call
from .episode import eos_after_stop_string
from .images import decode_vision_features
from .replies import MalformedEngineReplyError, check_token_ids

__all__ = ["VisionEpisode", "read_render"]


def read_render(reply: Any) -> tuple[list[int], Mapping[str, Any] | None]:
    """``(token_ids, features)`` of a ``render_chat_completion`` reply, checked before use.

    Raises:
        MalformedEngineReplyError: not a dict, no ``token_ids`` list of ints, or ``features`` not a dict.
    """
    if not isinstance(reply, Mapping) or "token_ids" not in reply:
        raise MalformedEngineReplyError(
            "the engine's render reply must be a dict with `token_ids` (and `features` when the conversation "
            f"holds images), got {type(reply).__name__}; check what the client's render_chat_completion returns"
        )
    ids = check_token_ids(reply["token_ids"], "token_ids", context="render reply")
    features = reply.get("features", None)
    if features is not None and not isinstance(features, Mapping):
        raise MalformedEngineReplyError(
            f"the engine's render reply field `features` is {type(features).__name__}, expected a dict "
            "(mm_hashes, mm_placeholders, kwargs_data) or None"
        )
    return ids, features


@dataclass
class _VisionRun:
    """The state of one :meth:`VisionEpisode.run`."""

    conversation: ConversationType
    params: dict[str, Any]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] | None = None
    #: (reward, index in the response of that turn's last generated token)
    rewards_at: list[tuple[float, int]] = field(default_factory=list)
    stop_reason: str = "stop"
    done: bool = False
    #: Where the last observation's tokens start in the next render (SkyRL's deferred slicing).
    pending_obs_offset: int | None = None
    features: Mapping[str, Any] | None = None
    engine_calls: int = 0


class VisionEpisode:
    """Runs vision-language episodes for one generator configuration."""

    def __init__(self, *, generator_cfg: SkyRLConfig, eos_token_id: int, policy_model_name: str | None) -> None:
        self.cfg = generator_cfg
        self.eos_token_id = eos_token_id
        self.policy_model_name = policy_model_name

    async def _render(
        self, context: RolloutContext, conversation: ConversationType
    ) -> tuple[list[int], Mapping[str, Any] | None]:
        """Token ids of the whole conversation (generation prompt included) and the render's features."""
        # The VLM generator refused a client without render_chat_completion before any rollout started.
        client = cast(RenderingClient, context.client)
        payload = {"json": {"model": getattr(client, "model_name", None), "messages": conversation}}
        started = time.monotonic()
        try:
            reply = await client.render_chat_completion(payload)
        finally:
            context.time_splits["llm"] += time.monotonic() - started
        return read_render(reply)

    async def run(
        self,
        env: EnvHandle,
        prompt: ConversationType,
        *,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> TrajectoryOutput:
        """Play ``env`` against the engine until it is done (or out of input) and build the trajectory."""
        conversation, _ = await env_call(context, "init", 0, lambda: env.init(copy.deepcopy(prompt)), timed=False)
        params = sampling_params if sampling_params is not None else context.batch.default_params
        run = _VisionRun(
            conversation=conversation,
            params=params,
            rollout_logprobs=[] if params.get("logprobs", None) is not None else None,
        )
        # The first render serves the first turn too (SkyRL renders the unchanged prompt twice).
        prompt_ids, run.features = await self._render(context, run.conversation)
        input_ids = prompt_ids
        while True:
            self._flush_observation(run, input_ids)
            if max_input_length is not None and len(input_ids) > max_input_length:
                run.stop_reason = "length"
                break
            await self._turn(env, run, context, input_ids, cache_salt)
            if run.done:
                break
            input_ids, run.features = await self._render(context, run.conversation)
        return self._assemble(env, run, prompt_ids)

    def _flush_observation(self, run: _VisionRun, input_ids: list[int]) -> None:
        """Append the previous observation's tokens, cut from this render past what came before them."""
        if run.pending_obs_offset is None:
            return
        obs = input_ids[run.pending_obs_offset :]
        run.response_ids.extend(obs)
        run.loss_mask.extend([0] * len(obs))
        if run.rollout_logprobs is not None:
            run.rollout_logprobs.extend([0.0] * len(obs))
        run.pending_obs_offset = None

    async def _turn(
        self,
        env: EnvHandle,
        run: _VisionRun,
        context: RolloutContext,
        input_ids: list[int],
        cache_salt: str | None,
    ) -> None:
        engine_input: InferenceEngineInput = {
            "prompt_token_ids": [input_ids],
            "session_ids": [context.ref.session_id],
            # SkyRL's VLM generator sends the config's sampling params when the batch has none.
            "sampling_params": context.request_params(run.params, run.engine_calls),
            "mm_features": [run.features] if run.features is not None else None,
            "cache_salt": cache_salt,
        }
        turn = run.engine_calls
        run.engine_calls += 1
        text, ids, run.stop_reason, logprobs, _ = await engine_call(
            context, turn, len(input_ids), lambda: context.client.generate(engine_input, model=self.policy_model_name)
        )
        stop = run.params.get("stop", None)
        added_eos = eos_after_stop_string(self.cfg, stop, text, ids, logprobs, self.eos_token_id)
        step = await env_call(context, "step", turn, lambda: env.step(text), timed=True)
        reward: float = step["reward"]
        run.done = bool(step["done"])
        run.conversation.append({"role": "assistant", "content": text})

        run.response_ids.extend(ids)
        run.loss_mask.extend([1] * (len(ids) - 1) + [0 if added_eos else 1])
        if run.rollout_logprobs is not None:
            run.rollout_logprobs.extend(logprobs if logprobs else [0.0] * len(ids))
        run.rewards_at.append((reward, len(run.response_ids) - 1))
        if not run.done:
            run.conversation.extend(step["observations"])
            run.pending_obs_offset = len(input_ids) + len(ids)

    def _assemble(self, env: EnvHandle, run: _VisionRun, prompt_ids: list[int]) -> TrajectoryOutput:
        rewards = [0.0] * len(run.response_ids)
        for reward, index in run.rewards_at:
            rewards[index] = float(reward)
        pixel_values, image_grid_thw = decode_vision_features(run.features)
        return TrajectoryOutput(
            response_ids=run.response_ids,
            reward=rewards,
            stop_reason=run.stop_reason,
            loss_mask=run.loss_mask,
            prompt_ids=prompt_ids,
            rollout_logprobs=run.rollout_logprobs,
            env_metrics=env.get_metrics(),
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        )
