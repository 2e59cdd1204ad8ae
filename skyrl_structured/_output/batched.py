"""SkyRL's batched single-turn path (``generator.batched=true``): one engine call for the batch."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from .._runtime.cleanup import CleanupStats
from ..envs import env_config_for, open_env
from ..types import ConversationType, GeneratorOutput, InferenceEngineOutput
from .collector import overlong_filtered
from .metrics import failure_metrics, rollout_metrics

__all__ = ["generate_batched"]


@dataclass
class _Rows:
    """The batch's per-rollout results, one entry per prompt, filled in prompt order."""

    responses: list[list[int]] = field(default_factory=list)
    rewards: list[Any] = field(default_factory=list)
    loss_masks: list[list[int]] = field(default_factory=list)
    env_metrics: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None
    expert_indices: list[Any] | None = None


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
    containment here (one engine call serves all prompts). The cleanup counters (opened, closed,
    close errors and timeouts) are reported as in the agent-loop path.
    """
    cleanup = CleanupStats()
    async with AsyncExitStack() as stack:
        envs, init_prompts = await _open_envs(stack, generator, prompts, env_classes, env_extras, cleanup)
        prompt_token_ids = _templated(generator.tokenizer, init_prompts)
        engine_output: InferenceEngineOutput = await client.generate(
            {"prompt_token_ids": prompt_token_ids, "sampling_params": sampling_params, "cache_salt": cache_salt},
            model=generator.policy_model_name,
        )
        rows = await _step_envs(envs, engine_output, prompt_token_ids, max_tokens)

    stop_reasons = engine_output["stop_reasons"]
    metrics = rollout_metrics(rows.responses, rows.rewards, rows.env_metrics, env_classes, rows.loss_masks)
    metrics.update(failure_metrics([], len(prompts), 0, cleanup))
    loss_masks = rows.loss_masks
    if generator.generator_cfg.apply_overlong_filtering:
        loss_masks = overlong_filtered(loss_masks, stop_reasons)
    return {
        "prompt_token_ids": prompt_token_ids,
        "response_ids": rows.responses,
        "rewards": rows.rewards,
        "loss_masks": loss_masks,
        "stop_reasons": stop_reasons,
        "rollout_metrics": metrics,
        "rollout_logprobs": rows.logprobs,
        "rollout_expert_indices": rows.expert_indices,
    }


async def _open_envs(
    stack: AsyncExitStack,
    generator: Any,
    prompts: list[ConversationType],
    env_classes: list[str],
    env_extras: list[dict[str, Any]],
    cleanup: CleanupStats,
) -> tuple[list[Any], list[ConversationType]]:
    """Open and init one environment per prompt, each closed when ``stack`` exits; their initial prompts."""
    runner = generator._env_runner()
    envs: list[Any] = []
    init_prompts: list[ConversationType] = []
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
    return envs, init_prompts


def _templated(tokenizer: Any, conversations: list[ConversationType]) -> list[list[int]]:
    """The generation prompt's token ids of each conversation, by the tokenizer's chat template."""
    rendered = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # transformers 5 may return a BatchEncoding even with return_dict=False.
    return [list(ids) for ids in (rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)]


async def _step_envs(
    envs: list[Any], engine_output: InferenceEngineOutput, prompt_token_ids: list[list[int]], max_tokens: int
) -> _Rows:
    """Step each environment with its response (cut to ``max_tokens``) and collect the rows."""
    all_logprobs = engine_output.get("response_logprobs", None)
    all_indices = engine_output.get("rollout_expert_indices", None)
    rows = _Rows(
        logprobs=[] if all_logprobs is not None else None, expert_indices=[] if all_indices is not None else None
    )
    texts, all_ids = engine_output["responses"], engine_output["response_ids"]
    for i, (text, ids, env) in enumerate(zip(texts, all_ids, envs, strict=True)):
        step_output = await env.step(text)
        rows.rewards.append(step_output["reward"])
        response = list(ids[:max_tokens])
        rows.responses.append(response)
        rows.loss_masks.append([1] * len(response))
        if rows.logprobs is not None and all_logprobs is not None:
            rows.logprobs.append(list(all_logprobs[i][: len(response)]))
        if rows.expert_indices is not None and all_indices is not None:
            rows.expert_indices.append(all_indices[i][: len(prompt_token_ids[i]) + len(response)])
        rows.env_metrics.append(env.get_metrics())
    return rows
