"""SkyRL's batched single-turn path (``generator.batched=true``): one engine call for the batch."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

from ._collector import overlong_filtered
from .envs import CleanupStats, env_config_for, open_env
from .metrics import rollout_metrics
from .types import ConversationType, GeneratorOutput

__all__ = ["generate_batched"]


async def generate_batched(
    generator: Any,
    client: Any,
    prompts: list[ConversationType],
    env_classes: list[str],
    env_extras: list[dict[str, Any]],
    max_tokens: int,
    sampling_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> GeneratorOutput:
    """Single-turn generation of the whole batch in one engine call (SkyRL's ``batched=True``).

    Every environment opened is closed on every path; there is no per-rollout failure
    containment here (one engine call serves all prompts).
    """
    runner = generator._env_runner()
    cleanup = CleanupStats()
    async with AsyncExitStack() as stack:
        envs = []
        init_prompts = []
        for env_class, extras, prompt in zip(env_classes, env_extras, prompts, strict=True):
            extras["max_turns"] = generator.max_turns
            env = await stack.enter_async_context(
                open_env(
                    env_class,
                    env_config=env_config_for(generator.skyrl_gym_cfg, env_class),
                    extras=extras,
                    runner=runner,
                    cleanup_timeout=generator.resilience.env_cleanup_timeout_s,
                    stats=cleanup,
                )
            )
            init_prompt, _ = await env.init(prompt)
            init_prompts.append(init_prompt)
            envs.append(env)

        rendered = generator.tokenizer.apply_chat_template(
            init_prompts, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt_token_ids = [list(ids) for ids in (rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)]
        engine_output = await client.generate(
            {"prompt_token_ids": prompt_token_ids, "sampling_params": sampling_params, "cache_salt": cache_salt},
            model=generator.policy_model_name,
        )
        texts = engine_output["responses"]
        all_ids = engine_output["response_ids"]
        stop_reasons = engine_output["stop_reasons"]
        all_logprobs = engine_output.get("response_logprobs", None)
        all_indices = engine_output.get("rollout_expert_indices", None)

        responses: list[list[int]] = []
        rewards: list[Any] = []
        loss_masks: list[list[int]] = []
        env_metrics: list[dict[str, Any]] = []
        logprobs: list[list[float]] | None = [] if all_logprobs is not None else None
        indices: list[Any] | None = [] if all_indices is not None else None
        for i, (text, ids, env) in enumerate(zip(texts, all_ids, envs, strict=True)):
            step_output = await env.step(text)
            rewards.append(step_output["reward"])
            response = list(ids[:max_tokens])
            responses.append(response)
            loss_masks.append([1] * len(response))
            if logprobs is not None:
                assert all_logprobs is not None
                logprobs.append(list(all_logprobs[i][: len(response)]))
            if indices is not None:
                assert all_indices is not None
                indices.append(all_indices[i][: len(prompt_token_ids[i]) + len(response)])
            env_metrics.append(env.get_metrics())

    metrics = rollout_metrics(responses, rewards, env_metrics, env_classes, loss_masks)
    if generator.generator_cfg.apply_overlong_filtering:
        loss_masks = overlong_filtered(loss_masks, stop_reasons)
    generator_output: GeneratorOutput = {
        "prompt_token_ids": prompt_token_ids,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": loss_masks,
        "stop_reasons": stop_reasons,
        "rollout_metrics": metrics,
        "rollout_logprobs": logprobs,
        "rollout_expert_indices": indices,
    }
    return generator_output
