"""The sampling, chat-template and engine sections, the resilience and agent-endpoint knobs, and their
resolution from any config object (one range per numeric knob, one table of choice knobs)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from ..types import SkyRLConfig
from ._checks import NumberRule, invalid_value, read_knob
from ._kinds import (
    AUTO,
    ENV_EXECUTORS,
    FAILED_ROLLOUT_POLICIES,
    FAILURE_BUDGET_ACTIONS,
    STRAGGLER_CUTOFF_SCOPES,
    FailedRolloutPolicy,
    FailureBudgetAction,
    StragglerCutoffScope,
    _help,
)


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
    #: The model's context length in tokens, when known: a longer prompt gets its API's own 400 before any engine call.
    agent_context_length: int | None = None
    #: Endpoint worker processes serving the sessions' HTTP (``"auto"``: one per usable core beyond the first,
    #: at most 8; 0: in the trainer's event loop). Each listens on a port of its own.
    agent_endpoint_workers: int | str = "auto"

    def __post_init__(self) -> None:
        host, port, url = self.agent_endpoint_host, self.agent_endpoint_port, self.agent_endpoint_url
        self._check_workers()
        length = self.agent_context_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise invalid_value(
                "generator.agent_context_length",
                length,
                "the model's context length in tokens (a positive integer, vLLM's max_model_len), or null",
                with_type=True,
            )
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

    def _check_workers(self) -> None:
        workers, port, url = self.agent_endpoint_workers, self.agent_endpoint_port, self.agent_endpoint_url
        if workers != AUTO and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise invalid_value(
                "generator.agent_endpoint_workers",
                workers,
                '"auto", 0 (the endpoint in the trainer\'s event loop) or a number of endpoint worker processes',
                with_type=True,
            )
        if not isinstance(workers, int) or workers == 0:
            return
        if isinstance(url, str) and "{port}" not in url:
            raise ValueError(
                f"generator.agent_endpoint_workers={workers} needs one port per worker but "
                f"generator.agent_endpoint_url={url!r} names one; put {{port}} in it or set agent_endpoint_workers=0"
            )
        if isinstance(port, int) and port and port + workers - 1 > 65535:
            raise ValueError(
                f"generator.agent_endpoint_workers={workers} binds ports {port}..{port + workers - 1} "
                f"(generator.agent_endpoint_port={port} onwards), past 65535; lower the port or the workers"
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
