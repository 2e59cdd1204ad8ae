"""The SkyRL experiment running :class:`~skyrl_structured.StructuredGymGenerator` (needs ray).

Imported on first use by :mod:`skyrl_structured.integrations.skyrl`; SkyRL's ``main_base`` imports
ray and its trainer at module level, so this module does too.
"""

from __future__ import annotations

from typing import Any

try:
    import ray
    from skyrl.backends.skyrl_train.inference_servers.utils import resolve_policy_model_name
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray
except ImportError as exc:
    raise ImportError(
        f"running SkyRL's trainer needs SkyRL with its training dependencies, which could not be imported "
        f"({exc}); install them with: pip install 'skyrl[fsdp]' (Ray, vLLM and the FSDP trainer; Python 3.12 "
        "or newer; see SkyRL's install guide for the GPU stack)"
    ) from exc

from ..agents import StructuredAgentGenerator
from ..generator import StructuredGymGenerator
from ..types import InferenceClient, SkyRLConfig, Tokenizer
from ._dynamic_sampling import sample_informative_batches
from ._skyrl_generator import structured_generator
from ._weight_sync import pause_during_weight_sync

__all__ = ["StructuredPPOExp", "run", "skyrl_entrypoint"]


class StructuredPPOExp(BasePPOExp):  # type: ignore[misc]  # SkyRL ships no type information
    """SkyRL's PPO experiment with :class:`~skyrl_structured.StructuredGymGenerator` as the generator.

    For the fully-async trainer an unset ``generator.failure_budget_action`` becomes ``warn``, and on
    every trainer the weight syncs pause the generator's deadlines. With
    ``generator.vision_language_generator=true``, :class:`~skyrl_structured.StructuredVLMGymGenerator`
    (SkyRL's entrypoint picks its VLM generator on the same key); with ``generator.agent`` set,
    :class:`~skyrl_structured.agents.StructuredAgentGenerator` running that agent.
    """

    def get_generator(
        self, cfg: SkyRLConfig, tokenizer: Tokenizer, inference_engine_client: InferenceClient
    ) -> StructuredGymGenerator | StructuredAgentGenerator:
        # failure_budget_action defaults to warn for the fully-async trainer (see structured_generator).
        return structured_generator(cfg, tokenizer, inference_engine_client, resolve_policy_model_name(cfg))

    def _setup_trainer(self) -> Any:
        trainer = super()._setup_trainer()
        # Weight syncs (save_weights_for_sampler) pause the generator's deadlines, on the synchronous
        # and the fully-async trainer alike; see _weight_sync.py.
        generator = getattr(trainer, "generator", None)
        if isinstance(generator, StructuredGymGenerator):
            # Each sync also advances the generator's policy version (rollout_policy_versions).
            pause_during_weight_sync(trainer, generator.pauses, generator.advance_policy_version)
            if generator.resilience.oversample_groups is not None:
                # SkyRL's filter loop fed by InformativeBatches (generator.oversample_groups; _dynamic_sampling.py).
                sample_informative_batches(trainer, generator, self.cfg)
        return trainer


@ray.remote(num_cpus=1)  # type: ignore[misc,untyped-decorator]
def skyrl_entrypoint(cfg: SkyRLConfig) -> None:
    # As in SkyRL: the training loop runs in a Ray task, not on the head node.
    StructuredPPOExp(cfg).run()


def run(cfg: SkyRLConfig) -> None:
    """Validate ``cfg`` the way SkyRL does, start Ray, and train."""
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))
