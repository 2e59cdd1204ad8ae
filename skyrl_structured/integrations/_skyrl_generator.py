"""The generator SkyRL's trainer gets: :func:`structured_generator` and the fully-async failure-budget default.

Its own module so that :mod:`~skyrl_structured.integrations.skyrl` (the config classes and the
command) and :mod:`~skyrl_structured.integrations._skyrl_experiment` (SkyRL's experiment class) both
import it, and neither imports the other back. It needs no SkyRL import of its own.
"""

from __future__ import annotations

import logging

from ..generator import StructuredGymGenerator
from ..types import InferenceClient, SkyRLConfig, Tokenizer
from ..vlm_generator import StructuredVLMGymGenerator

__all__ = ["fully_async_failure_budget", "structured_generator"]

logger = logging.getLogger("skyrl_structured.integrations.skyrl")  # the module users configure


def structured_generator(
    cfg: SkyRLConfig,
    tokenizer: Tokenizer,
    inference_engine_client: InferenceClient,
    policy_model_name: str | None = None,
) -> StructuredGymGenerator:
    """The generator ``StructuredPPOExp.get_generator`` returns for ``cfg`` (SkyRL's root config).

    :class:`~skyrl_structured.StructuredVLMGymGenerator` when ``generator.vision_language_generator``
    is true, :class:`~skyrl_structured.StructuredGymGenerator` otherwise: the same choice SkyRL's
    ``BasePPOExp.get_generator`` makes between its two generators. Applies
    :func:`fully_async_failure_budget` first. Weight syncs are wired to the generator's pauses once
    the trainer exists (``StructuredPPOExp._setup_trainer``, see
    :func:`~skyrl_structured.integrations._weight_sync.pause_during_weight_sync`).
    """
    fully_async_failure_budget(cfg)
    vision = bool(getattr(cfg.generator, "vision_language_generator", False))
    generator_class = StructuredVLMGymGenerator if vision else StructuredGymGenerator
    return generator_class(
        generator_cfg=cfg.generator,
        skyrl_gym_cfg=cfg.environment.skyrl_gym,
        inference_engine_client=inference_engine_client,
        tokenizer=tokenizer,
        policy_model_name=policy_model_name,
    )


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
    fully_async = bool(getattr(getattr(cfg.trainer, "fully_async", None), "enabled", False))
    if fully_async and getattr(generator, "skip_failed_rollouts", False):
        generator.failure_budget_action = "warn"
        logger.info(
            "generator.failure_budget_action=warn (it was not set): SkyRL's fully-async trainer calls generate() "
            "once per prompt group, and a group whose every rollout failed returns placeholders instead of ending "
            "the run; set generator.failure_budget_action=raise to fail instead"
        )
