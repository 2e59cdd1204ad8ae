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
from types import MappingProxyType
from typing import Any, Literal, get_args

from .types import SkyRLConfig

__all__ = [
    "AGENT_ENDPOINT_KNOBS",
    "AUTO",
    "CHOICE_KNOBS",
    "ENV_EXECUTORS",
    "ENV_KNOBS",
    "FAILED_ROLLOUT_POLICIES",
    "FAILURE_BUDGET_ACTIONS",
    "STRAGGLER_CUTOFF_SCOPES",
    "AgentEndpointSettings",
    "ChatTemplateConfig",
    "EnvExecutorKind",
    "GeneratorConfig",
    "InferenceEngineConfig",
    "ResilienceSettings",
    "SamplingParams",
    "SkyRLGymConfig",
    "check_choice",
    "read_knob",
    "resolve_agent_endpoint",
    "resolve_resilience",
    "routed_experts_enabled",
]

FailedRolloutPolicy = Literal["placeholder", "mask_group", "fill_group_mean"]
FAILED_ROLLOUT_POLICIES: tuple[FailedRolloutPolicy, ...] = get_args(FailedRolloutPolicy)
FailureBudgetAction = Literal["raise", "warn"]
FAILURE_BUDGET_ACTIONS: tuple[FailureBudgetAction, ...] = get_args(FailureBudgetAction)
EnvExecutorKind = Literal["thread", "process", "ray"]
ENV_EXECUTORS: tuple[EnvExecutorKind, ...] = get_args(EnvExecutorKind)
StragglerCutoffScope = Literal["batch", "group"]
#: The ``max_concurrent_rollouts`` that follows the engines' load.
AUTO: Literal["auto"] = "auto"
STRAGGLER_CUTOFF_SCOPES: tuple[StragglerCutoffScope, ...] = get_args(StragglerCutoffScope)


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


#: SkyRL's sampling defaults by name, read off :class:`SamplingParams` (the one table): what an engine
#: uses for a request that carries no parameters, and what a missing key means in a request's dict.
SKYRL_SAMPLING_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name != "additional_kwargs"}
)


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
    max_concurrent_rollouts: int | Literal["auto"] | None = None
    admission_min_rollouts: int = 4
    admission_max_rollouts: int | None = None
    admission_kv_target: float = 0.8
    env_cleanup_timeout_s: float = 30.0
    max_failed_rollout_fraction: float = 1.0
    failure_budget_action: FailureBudgetAction = "raise"
    failed_rollout_policy: FailedRolloutPolicy = "placeholder"
    sampling_seed: int | None = None
    gc_tuning: bool = True
    straggler_cutoff: float | None = None
    straggler_grace_s: float = 0.0
    straggler_cutoff_scope: StragglerCutoffScope = "batch"
    carry_over_cut_rollouts: bool = False
    max_carry_over_steps: int = 1
    mask_tokens_older_than: int | None = None
    oversample_groups: float | None = None

    @property
    def straggler_groups(self) -> bool:
        """Whether the straggler cutoff counts each prompt group on its own (the one place of that rule)."""
        return self.straggler_cutoff is not None and self.straggler_cutoff_scope == "group"

    @property
    def adaptive_admission(self) -> bool:
        """Whether the rollout bound follows the engines' load (``max_concurrent_rollouts="auto"``)."""
        return self.max_concurrent_rollouts == AUTO


_KNOB_DEFAULTS = ResilienceSettings()

#: The hosts that mean "every address": agents cannot be sent there, so the advertised URL must be given.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class AgentEndpointSettings:
    """Where :class:`~skyrl_structured.agents.StructuredAgentGenerator`'s capture endpoint listens, and the URL
    it gives agents: the ``generator.agent_endpoint_*`` knobs, checked at construction.

    The single source of their defaults (loopback only, a free port). Beyond loopback each
    session's key is the only credential: see docs/agents.md, "Agents on other machines".
    """

    agent_endpoint_host: str = "127.0.0.1"
    agent_endpoint_port: int = 0
    agent_endpoint_url: str | None = None

    def __post_init__(self) -> None:
        host, port, url = self.agent_endpoint_host, self.agent_endpoint_port, self.agent_endpoint_url
        if not isinstance(host, str) or not host.strip():
            raise invalid_value(
                "generator.agent_endpoint_host",
                host,
                "an address to listen on (127.0.0.1, a machine's address, 0.0.0.0 for all)",
                with_type=True,
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise invalid_value(
                "generator.agent_endpoint_port", port, "a port number from 0 to 65535 (0: a free one)", with_type=True
            )
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise invalid_value(
                "generator.agent_endpoint_url",
                url,
                "an http:// or https:// URL (where {port} stands for the port bound), or null",
                with_type=True,
            )
        if url is None and host in _WILDCARD_HOSTS:
            raise invalid_value(
                "generator.agent_endpoint_url",
                url,
                f"the URL agents reach this machine at when generator.agent_endpoint_host={host!r} (every address)",
                "Set it, e.g. generator.agent_endpoint_url=http://10.0.0.5:{port} ({port} becomes the port bound).",
            )


#: The knobs of :class:`AgentEndpointSettings`, in their order.
AGENT_ENDPOINT_KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AgentEndpointSettings))
_ENDPOINT_DEFAULTS = AgentEndpointSettings()


def resolve_agent_endpoint(generator_cfg: SkyRLConfig) -> AgentEndpointSettings:
    """Read and check the ``agent_endpoint_*`` knobs from ``generator_cfg`` (any config object, or a mapping).

    Raises:
        ValueError: a knob has the wrong type or range, or a wildcard host comes without a URL.
    """
    return AgentEndpointSettings(
        **{name: read_knob(generator_cfg, name, getattr(_ENDPOINT_DEFAULTS, name)) for name in AGENT_ENDPOINT_KNOBS}
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


def routed_experts_enabled(generator_cfg: SkyRLConfig) -> bool:
    """Whether ``generator.inference_engine.enable_return_routed_experts`` is on (any config object)."""
    engine_cfg = getattr(generator_cfg, "inference_engine", None)
    return bool(getattr(engine_cfg, "enable_return_routed_experts", False))


_ABSENT: Any = object()


def _made_up_by_mock(value: Any) -> bool:
    """Whether ``value`` is what ``unittest.mock`` invents for a name nobody set.

    SkyRL's own tests (and users' tests of their generator subclasses) pass ``MagicMock()`` as a
    config: every attribute exists there, as another mock. Compared by module, so reading a config
    never imports ``unittest.mock``.
    """
    return type(value).__module__ == "unittest.mock"


def read_knob(cfg: SkyRLConfig, name: str, default: Any) -> Any:
    """The one reader of our knobs from a SkyRL config section: ``cfg.name``, or ``default`` where absent.

    A field the object lacks is absent, whatever the object: SkyRL's dataclasses (whose schema has
    none of our knobs), an OmegaConf ``DictConfig`` or a ``dict`` (read as mappings, so a key is
    never confused with a method), an attribute bag, and a ``MagicMock``, whose made-up attributes
    count as absent while the ones a test set are read. A ``None`` that is set is returned as is:
    for several knobs null has a meaning of its own.
    """
    if cfg is None:
        return default
    try:
        value = cfg.get(name, _ABSENT) if isinstance(cfg, Mapping) else getattr(cfg, name, _ABSENT)
    except Exception:  # a strict config object refusing an unknown key: absent, as for any other
        return default
    if value is _ABSENT or _made_up_by_mock(value):
        return default
    return value


def _shown(value: Any, *, with_type: bool) -> str:
    return f"{value!r} ({type(value).__name__})" if with_type else repr(value)


def invalid_value(path: str, value: Any, requirement: str, fix: str = "", *, with_type: bool = False) -> ValueError:
    """The one wording of every refused setting: the field, what it takes, what it got, and the fix."""
    message = f"`{path}` must be {requirement}; got {_shown(value, with_type=with_type)}"
    return ValueError(f"{message}. {fix}" if fix else message)


@dataclass(frozen=True)
class NumberRule:
    """The accepted range of one numeric setting and the fix its refusal suggests; :meth:`check` applies it.

    The rule is ``value >= minimum`` (``> minimum`` with ``strict``), ``value <= maximum`` when given,
    finite, and an ``int`` where ``integer``; a ``bool`` is never a number. ``null_means`` allows None
    and says what it means. Every refused value of one setting gets the same message but for its
    ``got`` part, so a user who fixes one wrong value is not told a different rule for the next.
    """

    integer: bool
    minimum: float
    fix: str = ""
    maximum: float | None = None
    strict: bool = False
    seconds: bool = False
    null_means: str | None = None
    #: A word taken besides the numbers, and what it means (``("auto", "follow the engines' load")``).
    word: tuple[str, str] | None = None

    def requirement(self) -> str:
        """What the rule takes, in words: ``"an integer >= 1, or null for no limit"``."""
        integer, minimum, maximum, strict = self.integer, self.minimum, self.maximum, self.strict
        if maximum is None:
            what = "an integer" if integer else ("a finite number of seconds" if self.seconds else "a finite number")
            requirement = f"{what} {'>' if strict else '>='} {minimum:g}"
        else:  # a closed interval already says "finite"
            what = "an integer " if integer else ("seconds " if self.seconds else "")
            requirement = f"{what}within {'(' if strict else '['}{minimum:g}, {maximum:g}]"
        if self.word is not None:
            requirement = f"{requirement}, {self.word[0]!r} ({self.word[1]})"
        return f"{requirement}, or null for {self.null_means}" if self.null_means is not None else requirement

    def check(self, path: str, value: Any) -> Any:
        """``value`` if the rule takes it (None where null is allowed and given).

        Raises:
            ValueError: from :func:`invalid_value`, naming ``path``.
        """
        if self.word is not None and isinstance(value, str) and value == self.word[0]:
            return value
        requirement = self.requirement()
        if value is None:
            if self.null_means is not None:
                return None
            raise invalid_value(path, value, requirement, self.fix, with_type=True)
        number: int | float
        if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and not self.integer):
            number = value
        else:
            raise invalid_value(path, value, requirement, self.fix, with_type=True)
        infinite = isinstance(number, float) and not math.isfinite(number)  # ints are always finite; NaN too
        too_small = number < self.minimum or (self.strict and number == self.minimum)
        if infinite or too_small or (self.maximum is not None and number > self.maximum):
            raise invalid_value(path, value, requirement, self.fix)
        return value


#: The ranges of SkyRL's sampling parameters, by the engine's names: the CLI checks
#: :class:`SamplingParams` and the engines check each request's ``sampling_params`` against these.
SAMPLING_RANGES: dict[str, NumberRule] = {
    "max_tokens": NumberRule(integer=True, minimum=1, fix="It is the most tokens one turn generates, e.g. 1024."),
    "temperature": NumberRule(integer=False, minimum=0, fix="0 is greedy."),
    "top_p": NumberRule(integer=False, minimum=0, maximum=1, strict=True, fix="1.0 keeps every token."),
    "min_p": NumberRule(integer=False, minimum=0, maximum=1, fix="0.0 disables it."),
    "repetition_penalty": NumberRule(integer=False, minimum=0, strict=True, fix="1.0 applies none."),
    "min_tokens": NumberRule(integer=True, minimum=0, fix="0 sets no minimum."),
}

#: The range of every numeric knob of :class:`ResilienceSettings`, checked in this order.
_NUMERIC_KNOBS: dict[str, NumberRule] = {
    "rollout_timeout_s": NumberRule(
        integer=False,
        minimum=0,
        strict=True,
        seconds=True,
        null_means="no deadline (.inf means the same)",
        fix="Set the longest one rollout attempt may run, e.g. 600, or null for no deadline.",
    ),
    "max_rollout_retries": NumberRule(integer=True, minimum=0, fix="0 runs each rollout once, without retries."),
    "rollout_retry_backoff_s": NumberRule(integer=False, minimum=0, seconds=True, fix="0 retries at once."),
    "max_concurrent_rollouts": NumberRule(
        integer=True,
        minimum=1,
        null_means="no limit",
        word=(AUTO, "follow the engines' load"),
        fix="null runs every rollout of the batch at once; 'auto' admits as many as the engines' KV cache holds.",
    ),
    "admission_min_rollouts": NumberRule(
        integer=True, minimum=1, fix="It is the fewest rollouts max_concurrent_rollouts='auto' admits, e.g. 4."
    ),
    "admission_max_rollouts": NumberRule(
        integer=True,
        minimum=1,
        null_means="no ceiling",
        fix="It is the most rollouts max_concurrent_rollouts='auto' admits, e.g. 256.",
    ),
    "admission_kv_target": NumberRule(
        integer=False,
        minimum=0,
        maximum=1,
        strict=True,
        fix="It is the KV-cache usage the admission limit aims at; 0.8 (the default) leaves room for growing contexts.",
    ),
    "env_cleanup_timeout_s": NumberRule(
        integer=False,
        minimum=0,
        strict=True,
        seconds=True,
        fix="It bounds each environment close and session finish (0 would abandon every one of them, "
        "inf would let a hung close block the step); keep the default 30, or raise it for slow environments.",
    ),
    "max_failed_rollout_fraction": NumberRule(
        integer=False,
        minimum=0,
        maximum=1,
        fix="It is the largest failed share a step tolerates; 1.0 (the default) tolerates any short of all.",
    ),
    "straggler_cutoff": NumberRule(
        integer=False,
        minimum=0,
        maximum=1,
        strict=True,
        null_means="no cutoff",
        fix="It is the share of rollouts that must be final before the rest are cut, e.g. 0.95.",
    ),
    "straggler_grace_s": NumberRule(
        integer=False, minimum=0, seconds=True, fix="0 cuts the stragglers as soon as the cutoff is reached."
    ),
    "max_carry_over_steps": NumberRule(
        integer=True, minimum=0, fix="It is how many weight syncs a parked rollout may wait, e.g. 1 (the default)."
    ),
    "oversample_groups": NumberRule(
        integer=False,
        minimum=0,
        null_means="SkyRL's own filter loop",
        fix="It is the share of extra prompt groups started per call, e.g. 1.0 with 40% uninformative groups.",
    ),
    "mask_tokens_older_than": NumberRule(
        integer=True,
        minimum=0,
        null_means="masking none",
        fix="It is how many policy versions old a sampled token may be and still train, e.g. 1.",
    ),
}

#: Every choice knob of ours, by its path in SkyRL's config (its section included): the values it
#: takes (its ``Literal`` above) and the fix a refusal suggests. Checked by :func:`check_choice`.
CHOICE_KNOBS: Mapping[str, tuple[tuple[str, ...], str]] = MappingProxyType(
    {
        "generator.failure_budget_action": (
            FAILURE_BUDGET_ACTIONS,
            "'raise' fails an over-budget step; 'warn' returns it with placeholders and a warning.",
        ),
        "generator.failed_rollout_policy": (
            FAILED_ROLLOUT_POLICIES,
            "'placeholder' (the default) replaces each failed rollout alone; the group policies are described in "
            "docs/failures.md.",
        ),
        "generator.straggler_cutoff_scope": (
            STRAGGLER_CUTOFF_SCOPES,
            "'batch' counts the whole generate() call; 'group' counts each prompt group on its own.",
        ),
        "environment.skyrl_gym.env_executor": (
            ENV_EXECUTORS,
            "'thread' is SkyRL's behaviour; 'process' runs envs in killable worker processes, 'ray' in Ray "
            "actors (see docs/envs.md).",
        ),
    }
)


def check_choice(knob: str, value: Any, *, named: str | None = None) -> None:
    """Refuse a ``value`` the choice knob ``knob`` (its path in :data:`CHOICE_KNOBS`) does not take.

    ``named``: what the message calls the setting, where it is not the knob itself (a function's argument).

    Raises:
        ValueError: the one wording of :func:`invalid_value`, with the knob's values and fix.
    """
    choices, fix = CHOICE_KNOBS[knob]
    if value not in choices:
        raise invalid_value(named or knob, value, f"one of {', '.join(choices)}", fix)


def resolve_resilience(generator_cfg: SkyRLConfig) -> ResilienceSettings:
    """Read and check the new knobs from ``generator_cfg``; absent ones take their defaults.

    Every timeout follows one rule: a finite number of seconds > 0, and null (where the knob is
    optional) for no limit; ``rollout_timeout_s`` also takes ``inf`` (YAML ``.inf``) as null.

    Raises:
        ValueError: a knob has the wrong type or range; the message names it, what it accepts, what
            it got, and how to fix it.
    """
    defaults = ResilienceSettings()
    values = {f.name: read_knob(generator_cfg, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(defaults)}
    if not isinstance(values["skip_failed_rollouts"], bool):
        raise invalid_value(
            "generator.skip_failed_rollouts", values["skip_failed_rollouts"], "true or false", with_type=True
        )
    if values["failure_budget_action"] is None:
        # The SkyRL integration's "not set" (its default): raise, unless it picked warn for the
        # fully-async trainer before building the generator (integrations/skyrl.py).
        values["failure_budget_action"] = defaults.failure_budget_action
    timeout = values["rollout_timeout_s"]
    if isinstance(timeout, float) and timeout == math.inf:
        values["rollout_timeout_s"] = None  # YAML's `.inf`: no deadline, like null
    for name, rule in _NUMERIC_KNOBS.items():
        rule.check(f"generator.{name}", values[name])
    for knob in CHOICE_KNOBS:
        section, _, name = knob.rpartition(".")
        if section == "generator":
            check_choice(knob, values[name])
    seed = values["sampling_seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid_value(
            "generator.sampling_seed",
            seed,
            "an integer, or null for unseeded requests",
            "Any integer makes the samples reproducible: the same seed gives the same samples.",
            with_type=True,
        )
    floor, ceiling = values["admission_min_rollouts"], values["admission_max_rollouts"]
    if ceiling is not None and ceiling < floor:
        raise invalid_value(
            "generator.admission_max_rollouts",
            ceiling,
            f"at least generator.admission_min_rollouts={floor}, or null for no ceiling",
            "Raise it, or lower admission_min_rollouts.",
        )
    for flag in ("gc_tuning", "carry_over_cut_rollouts"):
        if not isinstance(values[flag], bool):
            raise invalid_value(f"generator.{flag}", values[flag], "true or false", with_type=True)
    return ResilienceSettings(**values)
