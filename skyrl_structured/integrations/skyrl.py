"""SkyRL's trainer with :class:`~skyrl_structured.StructuredGymGenerator` in place of ``SkyRLGymGenerator``.

SkyRL adds config fields by subclassing its config dataclasses; this module does that for the
structured-concurrency knobs and provides the experiment and entrypoint that use them:

- :class:`StructuredGeneratorConfig`: SkyRL's ``GeneratorConfig`` plus ``skip_failed_rollouts``,
  ``rollout_timeout_s``, ``max_rollout_retries``, ``rollout_retry_backoff_s``,
  ``max_concurrent_rollouts``, ``env_cleanup_timeout_s``, ``max_failed_rollout_fraction``,
  ``failure_budget_action`` and ``failed_rollout_policy`` (the defaults of
  :class:`skyrl_structured.GeneratorConfig`);
- :class:`StructuredTrainConfig`: SkyRL's ``SkyRLTrainConfig`` with that generator section;
- ``StructuredPPOExp``: SkyRL's ``BasePPOExp`` whose ``get_generator`` returns the structured one;
- :func:`main`: SkyRL's ``main``, parsing :class:`StructuredTrainConfig`.

Run it as ``python -m skyrl_structured.integrations.skyrl generator.skip_failed_rollouts=true ...``,
or keep SkyRL's entrypoint and add ``trainer.override_entrypoint=skyrl_structured.integrations.skyrl``.
``StructuredPPOExp`` and ``main`` need SkyRL's training dependencies (ray, ...); the config classes
need only ``skyrl`` itself. Without ``skyrl`` importing this module raises ``ImportError`` saying
what to install.
"""

# No `from __future__ import annotations` here: SkyRL's config parser reads `dataclasses.fields(...).type`
# to find nested sections, and needs real classes there, not strings.
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from skyrl.train.config import GeneratorConfig as _SkyRLGeneratorConfig
    from skyrl.train.config import SkyRLTrainConfig as _SkyRLTrainConfig
except ImportError as exc:  # pragma: no cover - exercised in a subprocess that hides skyrl
    raise ImportError(
        f"skyrl_structured.integrations.skyrl needs SkyRL, which could not be imported ({exc}); "
        "install it with: pip install 'skyrl-structured[skyrl]'"
    ) from exc

from ..config import FailureBudgetAction, GeneratorConfig, ResilienceSettings, resolve_resilience
from ..tokens import load_custom_chat_template
from ..validate import check_generator_config

if TYPE_CHECKING:
    from ._skyrl_experiment import StructuredPPOExp

__all__ = [
    "STRUCTURED_KNOBS",
    "StructuredGeneratorConfig",
    "StructuredPPOExp",
    "StructuredTrainConfig",
    "check_structured_config",
    "main",
]

#: The fields this integration adds to SkyRL's generator config.
STRUCTURED_KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ResilienceSettings))

_DEFAULTS = ResilienceSettings()
_HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GeneratorConfig)}


def _knob(name: str) -> Any:
    return field(default=getattr(_DEFAULTS, name), metadata={"help": _HELP[name]})


@dataclass
class StructuredGeneratorConfig(_SkyRLGeneratorConfig):  # type: ignore[misc]  # SkyRL ships no type information
    """SkyRL's ``generator`` section plus the knobs :class:`~skyrl_structured.StructuredGymGenerator` reads."""

    skip_failed_rollouts: bool = _knob("skip_failed_rollouts")
    rollout_timeout_s: float | None = _knob("rollout_timeout_s")
    max_rollout_retries: int = _knob("max_rollout_retries")
    rollout_retry_backoff_s: float = _knob("rollout_retry_backoff_s")
    max_concurrent_rollouts: int | None = _knob("max_concurrent_rollouts")
    env_cleanup_timeout_s: float = _knob("env_cleanup_timeout_s")
    max_failed_rollout_fraction: float = _knob("max_failed_rollout_fraction")
    failure_budget_action: FailureBudgetAction = _knob("failure_budget_action")
    failed_rollout_policy: str = _knob("failed_rollout_policy")


@dataclass
class StructuredTrainConfig(_SkyRLTrainConfig):  # type: ignore[misc]
    """SkyRL's root config with :class:`StructuredGeneratorConfig` as its ``generator`` section."""

    generator: StructuredGeneratorConfig = field(default_factory=StructuredGeneratorConfig)


def check_structured_config(cfg: Any) -> None:
    """Refuse, before Ray starts, what :class:`~skyrl_structured.StructuredGymGenerator` would refuse.

    Raises:
        ValueError: a knob out of range or a combination the generator cannot honour; the message
            names the ``generator.*`` field.
    """
    settings = resolve_resilience(cfg.generator)
    template = load_custom_chat_template(cfg.generator.chat_template)
    check_generator_config(cfg.generator, cfg.environment.skyrl_gym, settings, template)
    if cfg.generator.vision_language_generator:
        raise ValueError(
            "`generator.vision_language_generator=true` is not supported by StructuredGymGenerator, which "
            "replaces SkyRL's text generator; run SkyRL's own entrypoint for vision-language rollouts"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """SkyRL's training entrypoint, parsing :class:`StructuredTrainConfig` from ``key=value`` overrides.

    Raises:
        ImportError: SkyRL's training dependencies (ray, ...) are not installed.
        ValueError: an unknown key, or a configuration the generator refuses.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    # SkyRL's own main dispatches here on `trainer.override_entrypoint=<this module>`; that key is
    # its routing, not a config field, so it is dropped before the strict parse.
    args = [a for a in args if not a.startswith("trainer.override_entrypoint=")]
    cfg = StructuredTrainConfig.from_cli_overrides(args)
    check_structured_config(cfg)
    from ._skyrl_experiment import run

    run(cfg)


def __getattr__(name: str) -> Any:
    # The experiment class subclasses SkyRL's BasePPOExp, whose module needs ray: import it on use so
    # the config classes stay usable where only `skyrl` itself is installed.
    if name in ("StructuredPPOExp", "skyrl_entrypoint"):
        from . import _skyrl_experiment

        return getattr(_skyrl_experiment, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
