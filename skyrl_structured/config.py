"""Generator configuration: SkyRL's generation fields (same names, same defaults) plus our knobs.

The generator also accepts SkyRL's own ``GeneratorConfig``/``SkyRLGymConfig`` objects unchanged;
the knobs added here are then read with their defaults (see :func:`resolve_resilience`).
Every field carries a ``help`` text in its metadata: the CLI and the docs' configuration
reference are generated from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "FAILED_ROLLOUT_POLICIES",
    "ChatTemplateConfig",
    "GeneratorConfig",
    "InferenceEngineConfig",
    "ResilienceSettings",
    "SamplingParams",
    "SkyRLGymConfig",
    "resolve_resilience",
    "routed_experts_enabled",
]

FailedRolloutPolicy = Literal["placeholder", "mask_group", "fill_group_mean"]
FAILED_ROLLOUT_POLICIES: tuple[str, ...] = ("placeholder", "mask_group", "fill_group_mean")


def _help(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": text}, **kwargs)


def _help_factory(text: str, factory: Any) -> Any:
    return field(default_factory=factory, metadata={"help": text})


@dataclass
class SamplingParams:
    """Sampling parameters sent to the inference engine (SkyRL's names and defaults)."""

    max_generate_length: int = _help("Maximum number of tokens generated per turn.", 1024)
    repetition_penalty: float = _help("Repetition penalty; 1.0 applies none.", 1.0)
    temperature: float = _help("Sampling temperature; 0.0 is greedy.", 1.0)
    top_p: float = _help("Nucleus sampling probability mass.", 1.0)
    min_p: float = _help("Min-p sampling threshold.", 0.0)
    top_k: int = _help("Top-k sampling; -1 disables it.", -1)
    logprobs: int | None = _help("Logprobs of the chosen token per generated token (0 or 1); null disables them.", 1)
    stop: list[str] | None = _help("Stop strings; generation ends after one is produced.", None)
    additional_kwargs: dict[str, Any] | None = _help("Extra sampling arguments passed through to the engine.", None)


@dataclass
class ChatTemplateConfig:
    """A custom chat template used to re-tokenize the whole history (SkyRL's Qwen3 path)."""

    source: str = _help("'name' (a built-in template) or 'file' (a Jinja2 file).", "name")
    name_or_path: str | None = _help(
        "Template name (qwen3_with_thinking, qwen3_without_thinking) or file path; null uses the "
        "tokenizer's own template.",
        None,
    )


@dataclass
class InferenceEngineConfig:
    """The inference-engine fields the generator reads (SkyRL's config has many more)."""

    enable_return_routed_experts: bool = _help(
        "Return per-token MoE routing indices from the engine (router replay).", False
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
        "Longest input (prompt plus history) sent to the engine at any turn; a longer one ends the "
        "rollout with stop_reason 'length'. null means no limit.",
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
    vision_language_generator: bool = _help("Use SkyRL's vision-language generator (not supported here).", False)
    merge_stepwise_output: bool = _help("Prefix-merge step-wise samples in the trainer.", False)

    # --- structured concurrency (new) ------------------------------------------------------
    skip_failed_rollouts: bool = _help(
        "Replace a rollout that raised with a zero-reward, loss-masked placeholder instead of failing the step.",
        False,
    )
    rollout_timeout_s: float | None = _help(
        "Deadline for each rollout attempt in seconds; an attempt over it fails with TimeoutError. null means none.",
        None,
    )
    max_rollout_retries: int = _help("Times a failed rollout is re-run from scratch with a fresh environment.", 0)
    rollout_retry_backoff_s: float = _help(
        "Base of the exponential backoff (with full jitter) between retries, in seconds.", 1.0
    )
    max_concurrent_rollouts: int | None = _help(
        "Most rollouts (and so live environments) at once within one generate() call; null means all.",
        None,
    )
    env_cleanup_timeout_s: float = _help(
        "Bound on each cleanup (environment close, session finish) in seconds; an overrun is abandoned with a warning.",
        30.0,
    )
    max_failed_rollout_fraction: float = _help(
        "With skip_failed_rollouts, a step whose failed share exceeds this fraction raises.", 1.0
    )
    failed_rollout_policy: str = _help(
        "How failures enter the batch: 'placeholder', 'mask_group' (mask the failure's whole "
        "group) or 'fill_group_mean' (placeholder reward = mean of its successful siblings).",
        "placeholder",
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
        "Worker threads for blocking environment calls (init, step, close); 0 runs them inline.", 32
    )
    env_configs: dict[str, Any] = _help_factory("Per-environment configuration, keyed by env class name.", dict)


@dataclass(frozen=True)
class ResilienceSettings:
    """The new knobs, read from any config object and checked once at construction."""

    skip_failed_rollouts: bool = False
    rollout_timeout_s: float | None = None
    max_rollout_retries: int = 0
    rollout_retry_backoff_s: float = 1.0
    max_concurrent_rollouts: int | None = None
    env_cleanup_timeout_s: float = 30.0
    max_failed_rollout_fraction: float = 1.0
    failed_rollout_policy: str = "placeholder"


def routed_experts_enabled(generator_cfg: Any) -> bool:
    """Whether ``generator.inference_engine.enable_return_routed_experts`` is on (any config object)."""
    engine_cfg = getattr(generator_cfg, "inference_engine", None)
    return bool(getattr(engine_cfg, "enable_return_routed_experts", False))


def _get(cfg: Any, name: str, default: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _check_number(name: str, value: Any, *, allow_none: bool, integer: bool, minimum: float) -> None:
    if value is None:
        if allow_none:
            return
        raise ValueError(f"`generator.{name}` must be a number, got None")
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if integer else "a number"
        raise ValueError(f"`generator.{name}` must be {want}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"`generator.{name}` must be >= {minimum:g}, got {value!r}")


def resolve_resilience(generator_cfg: Any) -> ResilienceSettings:
    """Read and check the new knobs from ``generator_cfg``; absent ones take their defaults.

    Raises:
        ValueError: a knob has the wrong type or range; the message names it and what it accepts.
    """
    defaults = ResilienceSettings()
    values = {f.name: _get(generator_cfg, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(defaults)}
    if not isinstance(values["skip_failed_rollouts"], bool):
        raise ValueError(
            f"`generator.skip_failed_rollouts` must be true or false, got {values['skip_failed_rollouts']!r}"
        )
    _check_number("rollout_timeout_s", values["rollout_timeout_s"], allow_none=True, integer=False, minimum=0)
    if values["rollout_timeout_s"] is not None and values["rollout_timeout_s"] <= 0:
        raise ValueError(
            f"`generator.rollout_timeout_s` must be > 0 (or null for no deadline), got {values['rollout_timeout_s']!r}"
        )
    _check_number("max_rollout_retries", values["max_rollout_retries"], allow_none=False, integer=True, minimum=0)
    _check_number(
        "rollout_retry_backoff_s", values["rollout_retry_backoff_s"], allow_none=False, integer=False, minimum=0
    )
    _check_number(
        "max_concurrent_rollouts", values["max_concurrent_rollouts"], allow_none=True, integer=True, minimum=1
    )
    _check_number("env_cleanup_timeout_s", values["env_cleanup_timeout_s"], allow_none=False, integer=False, minimum=0)
    fraction = values["max_failed_rollout_fraction"]
    _check_number("max_failed_rollout_fraction", fraction, allow_none=False, integer=False, minimum=0)
    if fraction > 1:
        raise ValueError(f"`generator.max_failed_rollout_fraction` must be within [0, 1], got {fraction!r}")
    if values["failed_rollout_policy"] not in FAILED_ROLLOUT_POLICIES:
        raise ValueError(
            f"`generator.failed_rollout_policy` must be one of {', '.join(FAILED_ROLLOUT_POLICIES)}; "
            f"got {values['failed_rollout_policy']!r}"
        )
    return ResilienceSettings(**values)
