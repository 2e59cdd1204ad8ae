"""Generator configuration: SkyRL's generation fields (same names, same defaults) plus our knobs.

The generator also accepts SkyRL's own ``GeneratorConfig``/``SkyRLGymConfig`` objects unchanged;
the knobs added here are then read with their defaults (see :func:`resolve_resilience`).
Every field carries a ``help`` text in its metadata: the CLI and the docs' configuration
reference are generated from it.

The parts: ``_kinds`` (the choice knobs' values), ``_checks`` (reading a knob from any config object,
wording and ranging a refused value), ``_settings`` (the sections and our knobs, resolved), ``_generator``
(the two config classes SkyRL's entrypoints build).
"""

from __future__ import annotations

from typing import Any, Literal  # noqa: F401 - the classes' annotations resolve here (see the end)

from ._checks import SAMPLING_RANGES as SAMPLING_RANGES
from ._checks import NumberRule as NumberRule
from ._checks import invalid_value as invalid_value
from ._checks import read_knob as read_knob
from ._checks import routed_experts_enabled as routed_experts_enabled
from ._generator import ENV_KNOBS as ENV_KNOBS
from ._generator import GeneratorConfig as GeneratorConfig
from ._generator import SkyRLGymConfig as SkyRLGymConfig
from ._kinds import AUTO as AUTO
from ._kinds import ENV_EXECUTORS as ENV_EXECUTORS
from ._kinds import FAILED_ROLLOUT_POLICIES as FAILED_ROLLOUT_POLICIES
from ._kinds import FAILURE_BUDGET_ACTIONS as FAILURE_BUDGET_ACTIONS
from ._kinds import STRAGGLER_CUTOFF_SCOPES as STRAGGLER_CUTOFF_SCOPES
from ._kinds import EnvExecutorKind as EnvExecutorKind
from ._kinds import FailedRolloutPolicy as FailedRolloutPolicy
from ._kinds import FailureBudgetAction as FailureBudgetAction
from ._kinds import StragglerCutoffScope as StragglerCutoffScope
from ._settings import AGENT_ENDPOINT_KNOBS as AGENT_ENDPOINT_KNOBS
from ._settings import CHOICE_KNOBS as CHOICE_KNOBS
from ._settings import SKYRL_SAMPLING_DEFAULTS as SKYRL_SAMPLING_DEFAULTS
from ._settings import AgentEndpointSettings as AgentEndpointSettings
from ._settings import ChatTemplateConfig as ChatTemplateConfig
from ._settings import InferenceEngineConfig as InferenceEngineConfig
from ._settings import ResilienceSettings as ResilienceSettings
from ._settings import SamplingParams as SamplingParams
from ._settings import check_choice as check_choice
from ._settings import resolve_agent_endpoint as resolve_agent_endpoint
from ._settings import resolve_resilience as resolve_resilience

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

# The classes are this module's, as before it was split: their reprs, pickles and docs name
# ``skyrl_structured.config``, and their annotations (strings) resolve in this namespace.
for _cls in (
    AgentEndpointSettings,
    ChatTemplateConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    NumberRule,
    ResilienceSettings,
    SamplingParams,
    SkyRLGymConfig,
):
    _cls.__module__ = __name__
del _cls
