"""``StructuredVLMGymGenerator``: SkyRL's ``SkyRLVLMGymGenerator`` on the structured machinery.

Same constructor, same validation, the same ``GeneratorOutput`` token for token as SkyRL's
vision-language generator (``generator.vision_language_generator=true``): the conversation, images
included, is rendered by the inference client's ``render_chat_completion`` before each turn, the
render's ``features`` go to ``generate`` as ``mm_features``, and the trajectory carries the last
render's ``pixel_values`` and ``image_grid_thw``.

Everything else is the text generator's, shared rather than copied: the supervisor (deadlines,
retries, slots, interrupts, cancellation), the environments (closed exactly once on every path),
the session end, observers, and the collector (placeholders, failure budget, group policies). A
failed rollout's placeholder carries empty image tensors of the batch's width, which SkyRL's
trainer concatenates like any other row.
"""

from __future__ import annotations

import logging
from typing import Any

from ._episode.episode import EpisodeRunner
from ._episode.vision import VisionEpisode
from .generator import StructuredGymGenerator
from .types import ConversationType, GeneratorInput, GeneratorOutput, InferenceClient, SkyRLConfig, Tokenizer

__all__ = ["StructuredVLMGymGenerator"]

logger = logging.getLogger(__name__)


def check_vision_language_config(generator_cfg: SkyRLConfig) -> None:
    """What SkyRL's VLM generator refuses, in its order, each as one line naming the field and the fix.

    Raises:
        ValueError: ``batched``, ``step_wise_trajectories``, or ``use_conversation_multi_turn=false``.
    """
    if generator_cfg.batched:
        raise ValueError(
            "StructuredVLMGymGenerator does not support `generator.batched=true` (as SkyRL's VLM generator); "
            "set generator.batched=false"
        )
    if generator_cfg.step_wise_trajectories:
        raise ValueError(
            "StructuredVLMGymGenerator does not support `generator.step_wise_trajectories=true` (as SkyRL's VLM "
            "generator); set generator.step_wise_trajectories=false"
        )
    if not generator_cfg.use_conversation_multi_turn:
        raise ValueError(
            "StructuredVLMGymGenerator requires `generator.use_conversation_multi_turn=true`: image observations "
            "must be user messages of their own; set generator.use_conversation_multi_turn=true"
        )


class StructuredVLMGymGenerator(StructuredGymGenerator):
    """Multi-turn vision-language rollouts: SkyRL's ``SkyRLVLMGymGenerator`` with the structured guarantees.

    Args:
        generator_cfg: SkyRL's ``GeneratorConfig`` or :class:`skyrl_structured.GeneratorConfig`.
        skyrl_gym_cfg: SkyRL's ``SkyRLGymConfig`` or :class:`skyrl_structured.SkyRLGymConfig`.
        inference_engine_client: a client with ``render_chat_completion({"json": {...}})`` (vLLM's
            render endpoint: ``{"token_ids": [...], "features": {...} | None}``) besides ``generate``
            and ``finish_session``: SkyRL's ``RemoteInferenceClient``,
            :class:`~skyrl_structured.engines.HTTPEngine`, or a scripted one from
            :mod:`skyrl_structured.testing`.
        tokenizer: the policy's tokenizer (its EOS is appended after a stop string).
        policy_model_name: passed as ``model`` on every engine call.

    Raises:
        ValueError: ``generator.batched``, ``generator.step_wise_trajectories`` or
            ``generator.use_conversation_multi_turn=false`` (as SkyRL), or a knob out of range.
    """

    def __init__(
        self,
        generator_cfg: SkyRLConfig,
        skyrl_gym_cfg: SkyRLConfig,
        inference_engine_client: InferenceClient,
        tokenizer: Tokenizer,
        policy_model_name: str | None = None,
    ) -> None:
        # SkyRL's VLM generator refuses these before anything else is checked.
        check_vision_language_config(generator_cfg)
        super().__init__(generator_cfg, skyrl_gym_cfg, inference_engine_client, tokenizer, policy_model_name)

    def _make_episode(self) -> EpisodeRunner:
        return VisionEpisode(
            generator_cfg=self.generator_cfg,
            # The chat tokenizer's: the same id, already checked to be set.
            eos_token_id=self._chat.eos_token_id,
            policy_model_name=self.policy_model_name,
        )

    def _rewards_are_floats(self) -> bool:
        # Rewards are per token whatever the chat template: the engine renders the conversation.
        return False

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        """Generate one trajectory per prompt, in input order (see :meth:`StructuredGymGenerator.generate`).

        Raises:
            TypeError: the inference client has no ``render_chat_completion``, before any rollout starts.
        """
        if not callable(getattr(self.inference_engine_client, "render_chat_completion", None)):
            raise TypeError(
                f"StructuredVLMGymGenerator renders conversations through the inference client, but "
                f"{type(self.inference_engine_client).__name__} has no render_chat_completion(); use a client for "
                "vLLM's render endpoint (SkyRL's RemoteInferenceClient, skyrl_structured.engines.HTTPEngine)"
            )
        return await super().generate(input_batch, disable_tqdm=disable_tqdm)

    async def generate_batched(
        self,
        prompts: list[ConversationType],
        env_classes: list[str],
        env_extras: list[dict[str, Any]],
        max_tokens: int,
        sampling_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> GeneratorOutput:
        """Refused, as in SkyRL: vision-language rollouts go through the per-rollout agent loop.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "StructuredVLMGymGenerator does not support batched generation; use generate(), which runs each "
            "rollout's agent loop"
        )
