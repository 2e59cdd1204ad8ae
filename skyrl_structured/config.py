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
    "FAILURE_BUDGET_ACTIONS",
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
FailureBudgetAction = Literal["raise", "warn"]
FAILURE_BUDGET_ACTIONS: tuple[str, ...] = ("raise", "warn")


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


@dataclass(frozen=True)
class ResilienceSettings:
    """The new knobs, read from any config object and checked once at construction.

    The single source of their defaults: :class:`GeneratorConfig`, the CLI and the SkyRL integration
    all take them from here.
    """

    skip_failed_rollouts: bool = False
    rollout_timeout_s: float | None = None
    max_rollout_retries: int = 0
    rollout_retry_backoff_s: float = 1.0
    max_concurrent_rollouts: int | None = None
    env_cleanup_timeout_s: float = 30.0
    max_failed_rollout_fraction: float = 1.0
    failure_budget_action: FailureBudgetAction = "raise"
    failed_rollout_policy: str = "placeholder"


_KNOB_DEFAULTS = ResilienceSettings()


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
    vision_language_generator: bool = _help("Use SkyRL's vision-language generator (not supported here).", False)
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
    max_concurrent_rollouts: int | None = _help(
        "Most rollouts (and so live environments) at once within one generate() call; null means all.",
        _KNOB_DEFAULTS.max_concurrent_rollouts,
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
    failed_rollout_policy: str = _help(
        "How failures enter the batch: 'placeholder', 'mask_group' (mask the failure's whole "
        "group) or 'fill_group_mean' (placeholder reward = mean of its successful siblings).",
        _KNOB_DEFAULTS.failed_rollout_policy,
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


def routed_experts_enabled(generator_cfg: Any) -> bool:
    """Whether ``generator.inference_engine.enable_return_routed_experts`` is on (any config object)."""
    engine_cfg = getattr(generator_cfg, "inference_engine", None)
    return bool(getattr(engine_cfg, "enable_return_routed_experts", False))


def _get(cfg: Any, name: str, default: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _shown(value: Any, *, with_type: bool) -> str:
    return f"{value!r} ({type(value).__name__})" if with_type else repr(value)


def invalid_value(path: str, value: Any, requirement: str, fix: str = "", *, with_type: bool = False) -> ValueError:
    """The one wording of every refused setting: the field, what it takes, what it got, and the fix."""
    message = f"`{path}` must be {requirement}; got {_shown(value, with_type=with_type)}"
    return ValueError(f"{message}. {fix}" if fix else message)


def check_number(
    path: str,
    value: Any,
    *,
    integer: bool,
    minimum: float,
    strict: bool = False,
    seconds: bool = False,
    null_means: str | None = None,
    fix: str = "",
) -> Any:
    """Check a numeric setting and return it (None where null is allowed and given).

    The rule is ``value >= minimum`` (``> minimum`` with ``strict``), finite, and an ``int`` where
    ``integer``; a ``bool`` is never a number. ``null_means`` allows None and says what it means.

    Raises:
        ValueError: from :func:`invalid_value`, naming ``path``.
    """
    what = "an integer" if integer else ("a finite number of seconds" if seconds else "a finite number")
    requirement = f"{what} {'>' if strict else '>='} {minimum:g}"
    if null_means is not None:
        requirement += f", or null for {null_means}"
    if value is None:
        if null_means is not None:
            return None
        raise invalid_value(path, value, requirement, fix, with_type=True)
    number: int | float
    if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and not integer):
        number = value
    else:
        raise invalid_value(path, value, requirement, fix, with_type=True)
    infinite = isinstance(number, float) and not math.isfinite(number)  # ints are always finite
    if infinite or number < minimum or (strict and number == minimum):
        raise invalid_value(path, value, requirement, fix)
    return value


def resolve_resilience(generator_cfg: Any) -> ResilienceSettings:
    """Read and check the new knobs from ``generator_cfg``; absent ones take their defaults.

    Every timeout follows one rule: a finite number of seconds > 0, and null (where the knob is
    optional) for no limit; ``rollout_timeout_s`` also takes ``inf`` (YAML ``.inf``) as null.

    Raises:
        ValueError: a knob has the wrong type or range; the message names it, what it accepts, what
            it got, and how to fix it.
    """
    defaults = ResilienceSettings()
    values = {f.name: _get(generator_cfg, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(defaults)}
    if not isinstance(values["skip_failed_rollouts"], bool):
        raise invalid_value(
            "generator.skip_failed_rollouts", values["skip_failed_rollouts"], "true or false", with_type=True
        )
    timeout = values["rollout_timeout_s"]
    if isinstance(timeout, float) and timeout == math.inf:
        values["rollout_timeout_s"] = None  # YAML's `.inf`: no deadline, like null
    check_number(
        "generator.rollout_timeout_s",
        values["rollout_timeout_s"],
        integer=False,
        minimum=0,
        strict=True,
        seconds=True,
        null_means="no deadline (.inf means the same)",
        fix="Set the longest one rollout attempt may run, e.g. 600, or null for no deadline.",
    )
    check_number(
        "generator.max_rollout_retries",
        values["max_rollout_retries"],
        integer=True,
        minimum=0,
        fix="0 runs each rollout once, without retries.",
    )
    check_number(
        "generator.rollout_retry_backoff_s",
        values["rollout_retry_backoff_s"],
        integer=False,
        minimum=0,
        seconds=True,
        fix="0 retries at once.",
    )
    check_number(
        "generator.max_concurrent_rollouts",
        values["max_concurrent_rollouts"],
        integer=True,
        minimum=1,
        null_means="no limit",
        fix="null runs every rollout of the batch at once.",
    )
    check_number(
        "generator.env_cleanup_timeout_s",
        values["env_cleanup_timeout_s"],
        integer=False,
        minimum=0,
        strict=True,
        seconds=True,
        fix="It bounds each environment close and session finish (0 would abandon every one of them, "
        "inf would let a hung close block the step); keep the default 30, or raise it for slow environments.",
    )
    fraction = values["max_failed_rollout_fraction"]
    fraction_fix = "It is the largest failed share a step tolerates; 1.0 (the default) tolerates any short of all."
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise invalid_value(
            "generator.max_failed_rollout_fraction", fraction, "within [0, 1]", fraction_fix, with_type=True
        )
    if not 0 <= fraction <= 1:  # NaN fails both comparisons
        raise invalid_value("generator.max_failed_rollout_fraction", fraction, "within [0, 1]", fraction_fix)
    if values["failure_budget_action"] not in FAILURE_BUDGET_ACTIONS:
        raise invalid_value(
            "generator.failure_budget_action",
            values["failure_budget_action"],
            f"one of {', '.join(FAILURE_BUDGET_ACTIONS)}",
            "'raise' fails an over-budget step; 'warn' returns it with placeholders and a warning.",
        )
    if values["failed_rollout_policy"] not in FAILED_ROLLOUT_POLICIES:
        raise invalid_value(
            "generator.failed_rollout_policy",
            values["failed_rollout_policy"],
            f"one of {', '.join(FAILED_ROLLOUT_POLICIES)}",
        )
    return ResilienceSettings(**values)
