"""SkyRL's trainer with :class:`~skyrl_structured.StructuredGymGenerator` in place of ``SkyRLGymGenerator``.

SkyRL adds config fields by subclassing its config dataclasses; this module does that for the
structured-concurrency knobs and provides the experiment and entrypoint that use them:

- :class:`StructuredGeneratorConfig`: SkyRL's ``GeneratorConfig`` plus ``skip_failed_rollouts``,
  ``rollout_timeout_s``, ``max_rollout_retries``, ``rollout_retry_backoff_s``,
  ``max_concurrent_rollouts`` (a number, ``auto`` or null) with the ``admission_*`` knobs of ``auto``,
  ``env_cleanup_timeout_s``, ``max_failed_rollout_fraction``,
  ``failure_budget_action`` and ``failed_rollout_policy`` (the defaults of
  :class:`skyrl_structured.GeneratorConfig`), and ``agent`` (``generator.agent=default``,
  ``=module.path:function`` or ``=command:<command line>``: an OpenAI-API agent trained through
  :class:`~skyrl_structured.agents.StructuredAgentGenerator` instead of the gym generator);
- :class:`StructuredTrainConfig`: SkyRL's ``SkyRLTrainConfig`` with that generator section;
- ``StructuredPPOExp``: SkyRL's ``BasePPOExp`` whose ``get_generator`` returns the structured one
  (:func:`structured_generator`: :class:`~skyrl_structured.StructuredVLMGymGenerator` with
  ``generator.vision_language_generator=true``, as SkyRL picks its VLM generator);
- :func:`parse_config`: the checked :class:`StructuredTrainConfig` from ``key=value`` overrides;
- :func:`main`: the command, SkyRL's ``main`` for :class:`StructuredTrainConfig`.

Run it as ``python -m skyrl_structured.integrations.skyrl generator.skip_failed_rollouts=true ...``,
or keep SkyRL's entrypoint and add ``trainer.override_entrypoint=skyrl_structured.integrations.skyrl``.
Either drives SkyRL's synchronous trainer; fully-async training keeps its own entrypoint with the
three-line edit of docs/swap.md. ``StructuredPPOExp`` and ``main`` need SkyRL's training stack
(``pip install 'skyrl[fsdp]'``: Ray, vLLM, the FSDP trainer); the config classes need only
``skyrl`` itself. Without ``skyrl`` importing this module raises ``ImportError`` saying what to
install (run as a command, it prints that and exits 1).
"""

# No `from __future__ import annotations` here: SkyRL's config parser reads `dataclasses.fields(...).type`
# to find nested sections, and needs real classes there, not strings.
import dataclasses
import importlib
import logging
import platform
import sys
import textwrap
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .._episode.chat import load_custom_chat_template
from ..agents import AGENT_VALUES, check_agent_choice
from ..config import (
    AGENT_ENDPOINT_KNOBS,
    ENV_KNOBS,
    FailedRolloutPolicy,
    FailureBudgetAction,
    GeneratorConfig,
    ResilienceSettings,
    SkyRLGymConfig,
    StragglerCutoffScope,
    resolve_agent_endpoint,
    resolve_resilience,
)
from ..keys import dataclass_keys, did_you_mean, siblings, suggest
from ..types import SkyRLConfig
from ..validate import check_generator_config
from ..vlm_generator import check_vision_language_config
from ._fully_async import check_fully_async, fully_async_enabled
from ._skyrl_generator import AGENT_KEY, configured_agent
from ._skyrl_generator import fully_async_failure_budget as fully_async_failure_budget
from ._skyrl_generator import structured_generator as structured_generator

#: How to get SkyRL with the trainer this module drives (Ray, vLLM, FSDP).
INSTALL_HINT = "pip install 'skyrl[fsdp]' (Python 3.12 or newer; see SkyRL's install guide for the GPU stack)"

try:
    from skyrl.train.config import EnvironmentConfig as _SkyRLEnvironmentConfig
    from skyrl.train.config import GeneratorConfig as _SkyRLGeneratorConfig
    from skyrl.train.config import SkyRLGymConfig as _SkyRLGymConfig
    from skyrl.train.config import SkyRLTrainConfig as _SkyRLTrainConfig
except ImportError as _exc:  # exercised in a subprocess that hides skyrl
    _message = (
        f"skyrl_structured.integrations.skyrl needs SkyRL, which could not be imported ({_exc}); "
        f"install it with its trainer: {INSTALL_HINT}"
    )
    if __name__ == "__main__":  # run as a command: one line, no traceback
        print(f"error: {_message}", file=sys.stderr)
        raise SystemExit(1) from None
    raise ImportError(_message) from _exc

if TYPE_CHECKING:
    from ._skyrl_experiment import StructuredPPOExp

__all__ = [
    "AGENT_KNOBS",
    "INSTALL_HINT",
    "STRUCTURED_KNOBS",
    "SkyRLUnavailableError",
    "StructuredEnvironmentConfig",
    "StructuredGeneratorConfig",
    "StructuredPPOExp",
    "StructuredSkyRLGymConfig",
    "StructuredTrainConfig",
    "check_structured_config",
    "entrypoint_config",
    "fully_async_failure_budget",
    "main",
    "parse_config",
    "structured_generator",
    "usage",
]

logger = logging.getLogger(__name__)

#: The fields this integration adds to SkyRL's generator config.
STRUCTURED_KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ResilienceSettings))
#: The field that swaps the gym generator for :class:`~skyrl_structured.agents.StructuredAgentGenerator`, and
#: where that generator's capture endpoint listens (:class:`~skyrl_structured.config.AgentEndpointSettings`).
AGENT_KNOBS: tuple[str, ...] = ("agent", *AGENT_ENDPOINT_KNOBS)

_LIBRARY = GeneratorConfig()
_HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GeneratorConfig)}


def _knob(name: str) -> Any:
    return field(default=getattr(_LIBRARY, name), metadata={"help": _HELP[name]})


@dataclass
class StructuredGeneratorConfig(_SkyRLGeneratorConfig):  # type: ignore[misc]  # SkyRL ships no type information
    """SkyRL's ``generator`` section plus the knobs :class:`~skyrl_structured.StructuredGymGenerator` reads,
    and ``agent``, which swaps it for :class:`~skyrl_structured.agents.StructuredAgentGenerator`."""

    skip_failed_rollouts: bool = _knob("skip_failed_rollouts")
    rollout_timeout_s: float | None = _knob("rollout_timeout_s")
    max_rollout_retries: int = _knob("max_rollout_retries")
    rollout_retry_backoff_s: float = _knob("rollout_retry_backoff_s")
    max_concurrent_rollouts: int | Literal["auto"] | None = _knob("max_concurrent_rollouts")
    admission_min_rollouts: int = _knob("admission_min_rollouts")
    admission_max_rollouts: int | None = _knob("admission_max_rollouts")
    admission_kv_target: float = _knob("admission_kv_target")
    env_cleanup_timeout_s: float = _knob("env_cleanup_timeout_s")
    max_failed_rollout_fraction: float = _knob("max_failed_rollout_fraction")
    # None (not set) lets the integration choose: see fully_async_failure_budget.
    failure_budget_action: FailureBudgetAction | None = field(
        default=None,
        metadata={
            "help": _HELP["failure_budget_action"]
            + " null (the default here): 'warn' when StructuredPPOExp builds the generator for SkyRL's fully-async "
            "trainer with skip_failed_rollouts=true, else 'raise'."
        },
    )
    failed_rollout_policy: FailedRolloutPolicy = _knob("failed_rollout_policy")
    sampling_seed: int | None = _knob("sampling_seed")
    gc_tuning: bool = _knob("gc_tuning")
    straggler_cutoff: float | None = _knob("straggler_cutoff")
    straggler_grace_s: float = _knob("straggler_grace_s")
    straggler_cutoff_scope: StragglerCutoffScope = _knob("straggler_cutoff_scope")
    carry_over_cut_rollouts: bool = _knob("carry_over_cut_rollouts")
    max_carry_over_steps: int = _knob("max_carry_over_steps")
    mask_tokens_older_than: int | None = _knob("mask_tokens_older_than")
    oversample_groups: float | None = _knob("oversample_groups")
    agent: str | None = field(
        default=None,
        metadata={
            "help": "An agent that speaks the OpenAI chat API, trained token-exact through StructuredAgentGenerator "
            f"instead of the gym generator: {AGENT_VALUES}. null (the default): StructuredGymGenerator."
        },
    )
    agent_endpoint_host: str = _knob("agent_endpoint_host")
    agent_endpoint_port: int = _knob("agent_endpoint_port")
    agent_endpoint_url: str | None = _knob("agent_endpoint_url")
    agent_context_length: int | None = _knob("agent_context_length")
    agent_endpoint_workers: int | str = _knob("agent_endpoint_workers")


_GYM_FIELDS = {f.name: f for f in dataclasses.fields(SkyRLGymConfig)}
_GYM_TYPES = typing.get_type_hints(SkyRLGymConfig)
_GYM_DEFAULTS = SkyRLGymConfig()

#: SkyRL's ``environment.skyrl_gym`` section plus the env executor knobs (:data:`~skyrl_structured.config.ENV_KNOBS`),
#: built from our :class:`~skyrl_structured.SkyRLGymConfig` so a knob added there reaches SkyRL's parser too.
StructuredSkyRLGymConfig: type = dataclasses.make_dataclass(
    "StructuredSkyRLGymConfig",
    [
        (
            name,
            _GYM_TYPES[name],
            field(default=getattr(_GYM_DEFAULTS, name), metadata=dict(_GYM_FIELDS[name].metadata)),
        )
        for name in ENV_KNOBS
    ],
    bases=(_SkyRLGymConfig,),
    namespace={
        "__doc__": "SkyRL's ``environment.skyrl_gym`` section plus the env executor knobs.",
        "__module__": __name__,
    },
)


@dataclass
class StructuredEnvironmentConfig(_SkyRLEnvironmentConfig):  # type: ignore[misc]
    """SkyRL's ``environment`` section with :data:`StructuredSkyRLGymConfig` as its ``skyrl_gym`` section."""

    skyrl_gym: StructuredSkyRLGymConfig = field(default_factory=StructuredSkyRLGymConfig)  # type: ignore[valid-type]


_Parsed = typing.TypeVar("_Parsed")


def _override_keys(args: Sequence[str] | Mapping[str, Any]) -> list[str]:
    if isinstance(args, Mapping):
        return [str(key) for key in args]
    return [arg.partition("=")[0] for arg in args]


def _unknown_key(config_cls: type, args: Sequence[str] | Mapping[str, Any]) -> ValueError | None:
    """The first override naming no field of ``config_cls`` (a key below a value field, a dict's, is SkyRL's call)."""
    known = dataclass_keys(config_cls)
    leaves = [key for key, takes_value in known.items() if takes_value]
    for key in _override_keys(args):
        if key in known or any(key.startswith(f"{leaf}.") for leaf in leaves):
            continue
        close = suggest(key, known, leaves)
        parent = key.rpartition(".")[0]
        if close:
            listing = ""
        elif parent in known:
            listing = f" Keys under `{parent}`: {', '.join(sorted(siblings(key, known)))}"
        else:
            listing = (
                f" Sections: {', '.join(k for k, takes_value in known.items() if '.' not in k and not takes_value)}"
            )
        return ValueError(f"unknown key `{key}`{did_you_mean(close)}{listing}")
    return None


def _suggesting(
    config_cls: type, args: Sequence[str] | Mapping[str, Any], parse: typing.Callable[[], _Parsed]
) -> _Parsed:
    """Run SkyRL's parser; its refusal of an unknown key (``Invalid fields {...}``) becomes one line, with close
    matches."""
    try:
        return parse()
    except ValueError as exc:
        refusal = _unknown_key(config_cls, args) if str(exc).startswith("Invalid fields") else None
        if refusal is None:
            raise
        raise refusal from exc


@dataclass
class StructuredTrainConfig(_SkyRLTrainConfig):  # type: ignore[misc]
    """SkyRL's root config with our ``generator`` and ``environment`` sections (SkyRL's plus our knobs)."""

    generator: StructuredGeneratorConfig = field(default_factory=StructuredGeneratorConfig)
    environment: StructuredEnvironmentConfig = field(default_factory=StructuredEnvironmentConfig)

    @classmethod
    def from_cli_overrides(cls, args: Sequence[str] | Mapping[str, Any]) -> Any:
        """SkyRL's parser, which refuses an unknown key; here in one line naming the key, with close matches.

        Raises:
            ValueError: an unknown key (``unknown key `generator.max_turn`; did you mean
                `generator.max_turns`?``), or any refusal of SkyRL's own.
        """
        return _suggesting(cls, args, lambda: super(StructuredTrainConfig, cls).from_cli_overrides(args))


def check_structured_config(cfg: SkyRLConfig) -> None:
    """Refuse, before Ray starts, what :class:`~skyrl_structured.StructuredGymGenerator` would refuse.

    Raises:
        ValueError: a knob out of range or a combination the generator cannot honour; the message
            names the ``generator.*`` field.
    """
    agent = configured_agent(cfg.generator)
    if agent is not None:
        # Imports the agent's module, or finds its executable, now: before Ray starts.
        vision = bool(getattr(cfg.generator, "vision_language_generator", False))
        check_agent_choice(agent, key=AGENT_KEY, vision_language_generator=vision)
        resolve_resilience(cfg.generator)
        resolve_agent_endpoint(cfg.generator)
        return
    if getattr(cfg.generator, "vision_language_generator", False):
        check_vision_language_config(cfg.generator)
    settings = resolve_resilience(cfg.generator)
    check_fully_async(cfg)  # first: under the fully-async trainer the fix is another key, not dynamic_sampling
    template = load_custom_chat_template(cfg.generator.chat_template)
    check_generator_config(cfg.generator, cfg.environment.skyrl_gym, settings, template)
    check_oversampling(cfg, settings)


class SkyRLUnavailableError(ImportError):
    """SkyRL is installed but cannot build its configuration or trainer here; the message says how to fix it."""


#: The module ``SkyRLTrainConfig.__post_init__`` imports; it pulls in ``skyrl.backends`` (torch, pydantic models).
_SKYRL_CONFIG_NEEDS = "skyrl.backends.skyrl_train.inference_servers.utils"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _require_skyrl_runtime() -> None:
    """Import what SkyRL's config needs, turning a failure into one message that says what to do."""
    try:
        importlib.import_module(_SKYRL_CONFIG_NEEDS)
    except ImportError as exc:
        raise SkyRLUnavailableError(
            f"SkyRL's trainer cannot start: {_first_line(exc)}; install SkyRL with its trainer: {INSTALL_HINT}"
        ) from exc
    except Exception as exc:  # SkyRL's own modules failing to import on this Python
        python = platform.python_version()
        if sys.version_info < (3, 12) and "TypedDict" in str(exc):
            # SkyRL's tinker types use typing.TypedDict, which pydantic accepts only from Python 3.12.
            raise SkyRLUnavailableError(
                f"SkyRL cannot build its configuration on Python {python}: importing skyrl.backends fails "
                f"({_first_line(exc)}). Run SkyRL's trainer on Python 3.12 or newer, e.g. "
                "`uv venv --python 3.12 && uv pip install 'skyrl[fsdp]' -e /path/to/skyrl-structured` "
                "(this package installs from its checkout: it is not on PyPI yet)"
            ) from exc
        raise SkyRLUnavailableError(
            f"SkyRL cannot build its configuration on Python {python}: importing {_SKYRL_CONFIG_NEEDS} fails "
            f"({_first_line(exc)}); check that SkyRL and its trainer are installed for this Python: {INSTALL_HINT}"
        ) from exc


def _strip_routing(args: Sequence[str]) -> list[str]:
    # SkyRL's own main dispatches here on `trainer.override_entrypoint=<this module>`; that key is
    # its routing, not a config field, so it is dropped before the strict parse.
    return [a for a in args if not a.startswith("trainer.override_entrypoint=")]


def parse_config(argv: Sequence[str], config_cls: type | None = None) -> Any:
    """The config from SkyRL-style ``key=value`` overrides, checked before Ray starts.

    ``config_cls`` is the root config class an entrypoint parses with (default
    :class:`StructuredTrainConfig`; SkyRL's ``SkyRLTrainConfig`` or a subclass of it); SkyRL's own
    parser reads the overrides either way.

    Raises:
        SkyRLUnavailableError: SkyRL cannot build its configuration on this Python or install
            (the message names the fix).
        ValueError: an unknown key (one line, with close matches), or a configuration the generator refuses.
    """
    _require_skyrl_runtime()
    root: Any = StructuredTrainConfig if config_cls is None else config_cls
    args = _strip_routing(argv)
    cfg = _suggesting(root, args, lambda: root.from_cli_overrides(args))
    check_structured_config(cfg)
    return cfg


def entrypoint_config(argv: Sequence[str]) -> StructuredTrainConfig:
    """What this module's entrypoint trains with: :func:`parse_config`, and refused if fully-async (it drives
    SkyRL's synchronous trainer).

    Raises:
        SkyRLUnavailableError: as :func:`parse_config`.
        ValueError: as :func:`parse_config`, or ``trainer.fully_async.enabled=true``.
    """
    cfg: StructuredTrainConfig = parse_config(argv)
    _refuse_fully_async(cfg)
    return cfg


def _format_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def usage(width: int = 100) -> str:
    """What ``--help`` prints: how to run the entrypoint and every setting it adds to SkyRL's."""
    fields = {f.name: f for f in dataclasses.fields(StructuredGeneratorConfig)}
    defaults = StructuredGeneratorConfig()
    lines = [
        "usage: python -m skyrl_structured.integrations.skyrl [KEY=VALUE ...]",
        "   or: python -m skyrl.train.entrypoints.main_base "
        "trainer.override_entrypoint=skyrl_structured.integrations.skyrl [KEY=VALUE ...]",
        "",
        *textwrap.wrap(
            "SkyRL's synchronous PPO trainer with StructuredGymGenerator as the generator. Takes every key of "
            "SkyRL's configuration (SkyRLTrainConfig, SkyRL's names and defaults) plus the generator settings "
            "below; a bad key or value is refused (exit 2) before Ray starts, and a Python or install SkyRL "
            "cannot run on is reported with the fix (exit 1).",
            width,
            break_on_hyphens=False,
        ),
        "",
        "generator settings added to SkyRL's:",
    ]
    for name in (*STRUCTURED_KNOBS, *AGENT_KNOBS):
        lines.append(f"  generator.{name}={_format_default(getattr(defaults, name))}")
        text = str(fields[name].metadata.get("help", ""))
        lines.extend(textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    lines += [
        "",
        *textwrap.wrap(
            "Fully-async training (trainer.fully_async.enabled=true) is not driven from here: keep SkyRL's "
            "fully-async entrypoint and make the three-line edit (import StructuredPPOExp and "
            "StructuredTrainConfig, subclass StructuredPPOExp, parse StructuredTrainConfig); see docs/swap.md. "
            f"SkyRL's trainer needs: {INSTALL_HINT}.",
            width,
            break_on_hyphens=False,
        ),
    ]
    return "\n".join(lines)


def check_oversampling(cfg: SkyRLConfig, settings: ResilienceSettings) -> None:
    """Refuse ``generator.oversample_groups`` where SkyRL's sync trainer would not run it as documented.

    Raises:
        ValueError: naming the key to set and how.
    """
    share = settings.oversample_groups
    if share is None:
        return
    algorithm = getattr(getattr(cfg, "trainer", None), "algorithm", None)
    sampling = getattr(getattr(algorithm, "dynamic_sampling", None), "type", None)
    if sampling != "filter":
        raise ValueError(
            f"`generator.oversample_groups={share:g}` replaces SkyRL's dynamic-sampling filter loop, but "
            f"`trainer.algorithm.dynamic_sampling.type` is {sampling!r}: set it to filter, or oversample_groups to null"
        )
    if not settings.carry_over_cut_rollouts:
        raise ValueError(
            f"`generator.oversample_groups={share:g}` cuts the groups still running once the batch has its groups, "
            "which needs `generator.carry_over_cut_rollouts=true` so they are parked, not lost: turn it on"
        )
    if getattr(cfg.generator, "step_wise_trajectories", False):
        raise ValueError(
            f"`generator.oversample_groups={share:g}` needs whole trajectories: set "
            "generator.step_wise_trajectories=false, or oversample_groups to null"
        )


def _refuse_fully_async(cfg: SkyRLConfig) -> None:
    if fully_async_enabled(cfg):
        raise ValueError(
            "`trainer.fully_async.enabled=true`: this entrypoint (and trainer.override_entrypoint) drives SkyRL's "
            "synchronous trainer; for fully-async training keep your fully-async entrypoint and make the "
            "three-line edit (StructuredPPOExp, StructuredTrainConfig) described in docs/swap.md"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """The command: SkyRL's training entrypoint, parsing :class:`StructuredTrainConfig` from ``key=value``.

    ``--help`` prints :func:`usage`. A refused configuration prints one line and exits 2; SkyRL or its
    trainer not runnable here (missing packages, an unsupported Python) prints the fix and exits 1.
    Errors raised while training propagate as SkyRL's do.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(usage())
        return
    try:
        cfg = entrypoint_config(args)
        from ._skyrl_experiment import run
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run(cfg)


def __getattr__(name: str) -> Any:
    # The experiment class subclasses SkyRL's BasePPOExp, whose module needs ray: import it on use so
    # the config classes stay usable where only `skyrl` itself is installed.
    if name in ("StructuredPPOExp", "skyrl_entrypoint"):
        # SkyRL's own modules fail on Python 3.11 with a pydantic error: say what to do instead.
        _require_skyrl_runtime()
        from . import _skyrl_experiment

        return getattr(_skyrl_experiment, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
