"""The generator SkyRL's trainer gets: :func:`structured_generator` and the fully-async failure-budget default.

Its own module so that :mod:`~skyrl_structured.integrations.skyrl` (the config classes and the
command) and :mod:`~skyrl_structured.integrations._skyrl_experiment` (SkyRL's experiment class) both
import it, and neither imports the other back. It needs no SkyRL import of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from ..agents import StructuredAgentGenerator, resolve_agent
from ..config import read_knob
from ..generator import StructuredGymGenerator
from ..types import InferenceClient, SkyRLConfig, Tokenizer
from ..vlm_generator import StructuredVLMGymGenerator
from ._fully_async import check_fully_async, fully_async_enabled

__all__ = ["AGENT_KEY", "configured_agent", "fully_async_failure_budget", "structured_generator"]

#: The generator setting that selects :class:`~skyrl_structured.agents.StructuredAgentGenerator`.
AGENT_KEY = "generator.agent"

logger = logging.getLogger("skyrl_structured.integrations.skyrl")  # the module users configure


def structured_generator(
    cfg: SkyRLConfig,
    tokenizer: Tokenizer,
    inference_engine_client: InferenceClient,
    policy_model_name: str | None = None,
) -> StructuredGymGenerator | StructuredAgentGenerator:
    """The generator ``StructuredPPOExp.get_generator`` returns for ``cfg`` (SkyRL's root config).

    With ``generator.agent`` set (``default``, ``module.path:function`` or ``command:<command line>``,
    see :func:`~skyrl_structured.agents.resolve_agent`),
    :class:`~skyrl_structured.agents.StructuredAgentGenerator` running that agent, built from the same
    ``generator`` section and serving ``policy_model_name``. Otherwise
    :class:`~skyrl_structured.StructuredVLMGymGenerator` when ``generator.vision_language_generator``
    is true, :class:`~skyrl_structured.StructuredGymGenerator` otherwise: the same choice SkyRL's
    ``BasePPOExp.get_generator`` makes between its two generators. Applies
    :func:`fully_async_failure_budget` first. Weight syncs are wired to the generator's pauses once
    the trainer exists (``StructuredPPOExp._setup_trainer``, see
    :func:`~skyrl_structured.integrations._weight_sync.pause_during_weight_sync`).

    Raises:
        ValueError: under ``trainer.fully_async.enabled=true``, ``generator.oversample_groups`` or
            ``generator.carry_over_cut_rollouts`` (see :mod:`~skyrl_structured.integrations._fully_async`).
    """
    check_fully_async(cfg)  # the three-line route to the fully-async trainer never runs parse_config
    fully_async_failure_budget(cfg)
    agent = configured_agent(cfg.generator)
    if agent is not None:
        return StructuredAgentGenerator.from_config(
            cfg.generator,
            inference_engine_client,
            tokenizer,
            resolve_agent(agent, key=AGENT_KEY),
            model=policy_model_name or "skyrl-agent",
        )
    vision = bool(getattr(cfg.generator, "vision_language_generator", False))
    generator_class = StructuredVLMGymGenerator if vision else StructuredGymGenerator
    return generator_class(
        generator_cfg=cfg.generator,
        skyrl_gym_cfg=cfg.environment.skyrl_gym,
        inference_engine_client=inference_engine_client,
        tokenizer=tokenizer,
        policy_model_name=policy_model_name,
    )


def configured_agent(generator_cfg: Any) -> Any:
    """``generator.agent``; None where unset or absent (SkyRL's own section, a ``MagicMock``): the gym generator."""
    return read_knob(generator_cfg, "agent", None)


def fully_async_failure_budget(cfg: SkyRLConfig) -> None:
    """Default ``generator.failure_budget_action`` to ``warn`` for SkyRL's fully-async trainer, in place.

    That trainer calls ``generate()`` once per prompt group, and its generation worker exits the
    process on an exception: with ``raise``, one prompt whose every rollout failed would end the
    run. So where the user left the action unset (None), ``skip_failed_rollouts`` is on and
    ``trainer.fully_async.enabled`` is true, it becomes ``warn``, with one INFO line saying so. An
    action the user set is kept.
    """
    generator = cfg.generator
    if getattr(generator, "failure_budget_action", "raise") is not None:
        return
    if fully_async_enabled(cfg) and getattr(generator, "skip_failed_rollouts", False):
        generator.failure_budget_action = "warn"
        logger.info(
            "generator.failure_budget_action=warn (it was not set): SkyRL's fully-async trainer calls generate() "
            "once per prompt group, and a group whose every rollout failed returns placeholders instead of ending "
            "the run; set generator.failure_budget_action=raise to fail instead"
        )
