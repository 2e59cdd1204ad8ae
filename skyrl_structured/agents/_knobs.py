"""The agent generator's knobs, given as keywords or read from SkyRL's ``generator`` section.

Checked by the gym generator's rules and in its wording (:func:`~skyrl_structured.config.resolve_resilience`),
plus what only an agent refuses (carry-over) and its row flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import (
    AGENT_ENDPOINT_KNOBS,
    AgentEndpointSettings,
    ResilienceSettings,
    invalid_value,
    resolve_agent_endpoint,
    resolve_resilience,
)
from ..validate import check_failure_knobs

__all__ = ["OUTPUT_KNOBS", "AgentOutputConfig", "read_knobs"]

#: The ``generator`` fields (SkyRL's names) that shape and filter the rows, with their defaults.
OUTPUT_KNOBS: dict[str, bool] = {
    "step_wise_trajectories": False,
    "zero_reward_on_non_stop": False,
    "apply_overlong_filtering": False,
}
_RESILIENCE_KNOBS = frozenset(f.name for f in dataclasses.fields(ResilienceSettings))


@dataclass(frozen=True)
class AgentOutputConfig:
    """The ``generator`` fields the collector reads, in SkyRL's names: how rows are shaped and filtered."""

    step_wise_trajectories: bool = False
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False


def read_knobs(knobs: Mapping[str, Any]) -> tuple[ResilienceSettings, AgentOutputConfig, AgentEndpointSettings]:
    """The generator knobs given as keywords, checked by the gym generator's rules and wording."""
    unknown = sorted(set(knobs) - _RESILIENCE_KNOBS - set(OUTPUT_KNOBS) - set(AGENT_ENDPOINT_KNOBS))
    if unknown:
        known = ", ".join(sorted(_RESILIENCE_KNOBS | set(OUTPUT_KNOBS) | set(AGENT_ENDPOINT_KNOBS)))
        raise TypeError(f"StructuredAgentGenerator got unknown knob(s) {unknown}; the generator knobs are: {known}")
    settings = resolve_resilience(knobs)
    check_failure_knobs(settings)
    if settings.carry_over_cut_rollouts:
        raise ValueError(
            "`generator.carry_over_cut_rollouts=true` is not supported with an agent: an agent is a running program, "
            "which cannot be parked between generate() calls (only state can); set it to false."
        )
    flags: dict[str, bool] = {}
    for name, default in OUTPUT_KNOBS.items():
        value = knobs.get(name, default)
        if not isinstance(value, bool):
            raise invalid_value(f"generator.{name}", value, "true or false", with_type=True)
        flags[name] = value
    return settings, AgentOutputConfig(**flags), resolve_agent_endpoint(knobs)
