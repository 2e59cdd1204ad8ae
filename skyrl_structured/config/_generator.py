"""``GeneratorConfig`` and ``SkyRLGymConfig``: SkyRL's generation and env fields, same names, same defaults,
plus our knobs (their defaults are :class:`ResilienceSettings`' and :class:`AgentEndpointSettings`')."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ._kinds import (
    EnvExecutorKind,
    FailedRolloutPolicy,
    FailureBudgetAction,
    StragglerCutoffScope,
    _help,
    _help_factory,
)
from ._settings import (
    _ENDPOINT_DEFAULTS,
    _KNOB_DEFAULTS,
    ChatTemplateConfig,
    InferenceEngineConfig,
    SamplingParams,
)


@dataclass
class GeneratorConfig:
    """SkyRL's ``generator`` section, field for field, plus the structured-concurrency knobs."""

    inference_engine: InferenceEngineConfig = _help_factory(
        "Inference engine settings read by the generator.", InferenceEngineConfig
    )
    n_samples_per_prompt: int = _help("Rollouts per prompt (the GRPO group size).", 5)
    batched: bool = _help("Single-turn batched generation through one engine call.", False)
    max_turns: int = _help("Maximum turns per multi-turn rollout.", 1)
    max_input_length: int | None = _help(
        "Longest input (prompt plus history) sent to the engine at any turn, in tokens (a positive "
        "integer); a longer one ends the rollout with stop_reason 'length'. null means no limit.",
        None,
    )
    chat_template: ChatTemplateConfig = _help_factory(
        "Custom chat template used to re-tokenize the history every turn.", ChatTemplateConfig
    )
    chat_template_kwargs: dict[str, Any] = _help_factory(
        "Keyword arguments passed to tokenizer.apply_chat_template.", dict
    )
    sampling_params: SamplingParams = _help_factory("Sampling parameters for training rollouts.", SamplingParams)
    use_conversation_multi_turn: bool = _help(
        "Keep each turn as its own chat message (True) or continue one assistant message in token space (False).",
        True,
    )
    append_eos_token_after_stop_str_in_multi_turn: bool = _help(
        "Append the EOS token after a matched stop string in multi-turn conversations.", True
    )
    eval_sampling_params: SamplingParams | None = _help(
        "Sampling parameters for evaluation; null means greedy with the training length.", None
    )
    eval_n_samples_per_prompt: int = _help("Rollouts per prompt during evaluation.", 1)
    zero_reward_on_non_stop: bool = _help("Zero the reward of rollouts whose stop reason is not 'stop'.", False)
    use_cache_salt: bool = _help("Salt the engine's prefix cache with the client's weight version.", True)
    apply_overlong_filtering: bool = _help(
        "Zero the loss mask of rollouts whose stop reason is not 'stop' (DAPO overlong filtering).", False
    )
    step_wise_trajectories: bool = _help("Return every turn as its own training sample.", False)
    vision_language_generator: bool = _help(
        "Vision-language rollouts: StructuredVLMGymGenerator (SkyRL's SkyRLVLMGymGenerator) in the SkyRL "
        "integration and the CLI; the engine renders each conversation with its images.",
        False,
    )
    merge_stepwise_output: bool = _help("Prefix-merge step-wise samples in the trainer.", False)

    # --- structured concurrency (new) ------------------------------------------------------
    skip_failed_rollouts: bool = _help(
        "Replace a rollout that raised with a zero-reward, loss-masked placeholder instead of failing the step.",
        _KNOB_DEFAULTS.skip_failed_rollouts,
    )
    rollout_timeout_s: float | None = _help(
        "Deadline for each rollout attempt in seconds (> 0); an attempt over it fails with TimeoutError. "
        "null (or .inf) means none.",
        _KNOB_DEFAULTS.rollout_timeout_s,
    )
    max_rollout_retries: int = _help(
        "Times a failed rollout is re-run from scratch with a fresh environment.", _KNOB_DEFAULTS.max_rollout_retries
    )
    rollout_retry_backoff_s: float = _help(
        "Base of the exponential backoff (with full jitter) between retries, in seconds.",
        _KNOB_DEFAULTS.rollout_retry_backoff_s,
    )
    max_concurrent_rollouts: int | Literal["auto"] | None = _help(
        "Most rollouts (and so live environments) at once, across every concurrent generate() call of one "
        "generator (FIFO between calls); null means all. 'auto' follows the engines' load: it admits more "
        "while their KV cache has room and fewer after preemptions, within admission_min_rollouts and "
        "admission_max_rollouts (docs/failures.md).",
        _KNOB_DEFAULTS.max_concurrent_rollouts,
    )
    admission_min_rollouts: int = _help(
        "With max_concurrent_rollouts='auto': the fewest rollouts admitted at once, and the first limit.",
        _KNOB_DEFAULTS.admission_min_rollouts,
    )
    admission_max_rollouts: int | None = _help(
        "With max_concurrent_rollouts='auto': the most rollouts admitted at once; null sets no ceiling (the "
        "limit grows only while rollouts wait for a slot).",
        _KNOB_DEFAULTS.admission_max_rollouts,
    )
    admission_kv_target: float = _help(
        "With max_concurrent_rollouts='auto': how full the engines' KV cache may get (a fraction in (0, 1]), "
        "the limit growing towards it and holding there: the larger of their KV usage and the share of their "
        "capacity the admitted rollouts' contexts take.",
        _KNOB_DEFAULTS.admission_kv_target,
    )
    env_cleanup_timeout_s: float = _help(
        "Bound on each cleanup (environment close, session finish) in seconds, finite and > 0; an overrun "
        "is abandoned with a warning.",
        _KNOB_DEFAULTS.env_cleanup_timeout_s,
    )
    max_failed_rollout_fraction: float = _help(
        "With skip_failed_rollouts, a step whose failed share exceeds this fraction (or whose every "
        "rollout failed) is over budget: see failure_budget_action.",
        _KNOB_DEFAULTS.max_failed_rollout_fraction,
    )
    failure_budget_action: FailureBudgetAction = _help(
        "With skip_failed_rollouts, what an over-budget step does: 'raise' a RuntimeError, or 'warn' "
        "(log a warning, return placeholders for the failed rows, report generate/failure_budget_exceeded=1). "
        "Use 'warn' where generate() gets one prompt group at a time (SkyRL's fully-async trainer).",
        _KNOB_DEFAULTS.failure_budget_action,
    )
    failed_rollout_policy: FailedRolloutPolicy = _help(
        "How failures enter the batch: 'placeholder', 'mask_group' (mask the failure's whole "
        "group) or 'fill_group_mean' (placeholder reward = mean of its successful siblings).",
        _KNOB_DEFAULTS.failed_rollout_policy,
    )
    sampling_seed: int | None = _help(
        "Seed each engine request from (this seed, prompt, sample, turn), so a run is reproducible whatever "
        "order requests reach the engine in; an integer. null sends requests unseeded, as SkyRL does.",
        _KNOB_DEFAULTS.sampling_seed,
    )
    gc_tuning: bool = _help(
        "Raise the garbage collector's generation-0 threshold while generate() runs (restored after), so a "
        "batch does not trigger full collections of the heap; false leaves the collector as it is.",
        _KNOB_DEFAULTS.gc_tuning,
    )
    straggler_cutoff: float | None = _help(
        "With skip_failed_rollouts, once this share of the batch's rollouts (or of a prompt group's, see "
        "straggler_cutoff_scope) is final, the rest get straggler_grace_s more, then are cut: cancelled, "
        "cleaned up, and replaced by placeholders (StragglerCutError). Within (0, 1]; null turns it off.",
        _KNOB_DEFAULTS.straggler_cutoff,
    )
    straggler_grace_s: float = _help(
        "Seconds the rollouts still running get once straggler_cutoff is reached (the clock stops while the "
        "generator is paused); 0 cuts them at once.",
        _KNOB_DEFAULTS.straggler_grace_s,
    )
    straggler_cutoff_scope: StragglerCutoffScope = _help(
        "What straggler_cutoff counts: 'batch' (all rollouts of the generate() call) or 'group' (each prompt "
        "group, the rollouts sharing trajectory_ids[i].instance_id, on its own).",
        _KNOB_DEFAULTS.straggler_cutoff_scope,
    )
    carry_over_cut_rollouts: bool = _help(
        "With straggler_cutoff: a rollout cut while its engine request runs is parked (its tokens, the partial "
        "reply, its open environment) instead of discarded, and resumed by a later generate() whose batch has "
        "the same trajectory id (docs/failures.md).",
        _KNOB_DEFAULTS.carry_over_cut_rollouts,
    )
    max_carry_over_steps: int = _help(
        "With carry_over_cut_rollouts: the most policy versions (weight syncs) a parked rollout may wait; one "
        "parked longer is dropped, its environment closed (generate/carry_over/dropped_stale). An integer >= 0.",
        _KNOB_DEFAULTS.max_carry_over_steps,
    )
    mask_tokens_older_than: int | None = _help(
        "Zero the loss mask of sampled tokens more than this many policy versions older than the policy at the "
        "end of generate() (rollout_policy_versions); an integer >= 0, or null to mask none.",
        _KNOB_DEFAULTS.mask_tokens_older_than,
    )
    oversample_groups: float | None = _help(
        "SkyRL integration, with trainer.algorithm.dynamic_sampling.type=filter and carry_over_cut_rollouts: start "
        "this share more prompt groups than the batch needs in one generate() call, return once enough groups with "
        "a reward spread are final and carry the others over (InformativeBatches); >= 0, or null for SkyRL's own "
        "loop.",
        _KNOB_DEFAULTS.oversample_groups,
    )
    agent_endpoint_host: str = _help(
        "With an agent: the address StructuredAgentGenerator's capture endpoint listens on. The default is "
        "loopback only; another address (0.0.0.0 for all) serves agents on other machines, each session's key "
        "then being its only credential over plain HTTP (docs/agents.md).",
        _ENDPOINT_DEFAULTS.agent_endpoint_host,
    )
    agent_endpoint_port: int = _help(
        "With an agent: the capture endpoint's port; 0 takes a free one.", _ENDPOINT_DEFAULTS.agent_endpoint_port
    )
    agent_endpoint_url: str | None = _help(
        "With an agent: the URL agents are given for the capture endpoint (a session's base URL is this URL "
        "followed by /sessions/KEY/v1), where {port} stands for the port bound; null: http://HOST:PORT. Required "
        "with a wildcard host (0.0.0.0).",
        _ENDPOINT_DEFAULTS.agent_endpoint_url,
    )
    agent_context_length: int | None = _help(
        "With an agent: the model's context length in tokens (vLLM's max_model_len). A longer prompt is answered "
        "with its API's own 400 (OpenAI's context_length_exceeded, Anthropic's 'prompt is too long') before any "
        "engine call; null: only when the engine refuses it.",
        _ENDPOINT_DEFAULTS.agent_context_length,
    )
    agent_endpoint_workers: int | str = _help(
        "With an agent: the capture endpoint's worker processes, which serve the agents' HTTP (parse, chat "
        "template, tokenizing) off the trainer's event loop, each on a port of its own (agent_endpoint_url then "
        "needs {port}; a fixed agent_endpoint_port P binds P..P+N-1). auto: one per usable core beyond the "
        "first, at most 8; 0: in the trainer's event loop.",
        _ENDPOINT_DEFAULTS.agent_endpoint_workers,
    )

    def __post_init__(self) -> None:
        if self.eval_sampling_params is None:
            self.eval_sampling_params = SamplingParams(
                temperature=0.0, max_generate_length=self.sampling_params.max_generate_length
            )


@dataclass
class SkyRLGymConfig:
    """SkyRL's ``environment.skyrl_gym`` section.

    Per-environment configuration is looked up by env class name: as an attribute (SkyRL's own
    config has ``text2sql``, ``search``, ...) or in ``env_configs``.
    """

    max_env_workers: int = _help(
        "Workers (threads, processes or Ray actors: see env_executor) for blocking environment calls "
        "(init, step, close); 0 runs them inline.",
        32,
    )
    env_configs: dict[str, Any] = _help_factory("Per-environment configuration, keyed by env class name.", dict)
    env_executor: EnvExecutorKind = _help(
        "Where blocking environment code runs: 'thread' (worker threads, SkyRL's behaviour), 'process' "
        "(worker processes: hard deadlines, crash containment, every core) or 'ray' (Ray actors). "
        "See docs/envs.md.",
        "thread",
    )
    env_worker_num_cpus: float = _help("CPUs Ray reserves for each env worker actor (env_executor='ray' only).", 1.0)
    env_workers_warm: int = _help(
        "Env worker processes or Ray actors started ahead of need at the first generate(), and kept started: "
        "one that died is replaced at the next generate() or env placement (0: start them on demand).",
        0,
    )
    env_worker_start_timeout_s: float = _help(
        "Seconds an env worker process or Ray actor may take to start; past it, the rollouts waiting on it fail "
        "with EnvWorkerError. Time spent waiting for a start never counts against rollout_timeout_s.",
        120.0,
    )
    env_worker_max_rss_mb: float | None = _help(
        "Recycle an env worker process whose resident memory exceeds this many MB, once it hosts no env "
        "(env_executor='process' only; null: never).",
        None,
    )


#: The fields of :class:`SkyRLGymConfig` that are ours (SkyRL's ``environment.skyrl_gym`` has the others):
#: the SkyRL integration adds exactly these to SkyRL's section.
ENV_KNOBS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(SkyRLGymConfig) if f.name not in ("max_env_workers", "env_configs")
)
