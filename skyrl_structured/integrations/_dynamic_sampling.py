"""SkyRL's dynamic-sampling filter loop fed by InformativeBatches (``generator.oversample_groups``).

SkyRL's synchronous trainer, with ``trainer.algorithm.dynamic_sampling.type=filter``, takes a batch
of ``train_batch_size`` prompts from its dataloader, calls ``trainer.generate`` on it, and hands the
output and the prompts' ``uids`` to ``trainer.handle_dynamic_sampling``, which drops the groups whose
samples all scored alike and accumulates the rest; while fewer than ``train_batch_size`` groups are
collected it takes the next dataloader batch (up to ``max_sample_batches``). Each of those
``generate`` calls waits for its slowest rollout.

:func:`sample_informative_batches` replaces the trainer's ``generate``: the dataloader's prompts
join the :class:`~skyrl_structured.InformativeBatches` queue (none is lost), and one call over the
groups waiting (those carried first), up to ``1 + oversample_groups`` times the groups still
needed, returns as soon as they are final and informative, the rest carried into the next call.
The extra groups are those SkyRL's loop already took: a step's first call has its dataloader batch
and what earlier steps carried; a call that returns fewer groups than needed makes SkyRL take the
next batch, whose call then has more to choose from. (An empty output to ask for a batch early is
not possible: SkyRL's filter turns its empty ``rollout_logprobs`` into None, and its concatenation
then refuses the mix.) ``handle_dynamic_sampling`` is SkyRL's own, handed the rows' own
uids instead of the dataloader batch's; its filtering, its accumulation, its limit and its metrics
are unchanged. ``trainer.generate``'s other duties are kept: the rollout metrics go to
``trainer.all_metrics`` and the output is validated (for its own row count).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from ..generator import StructuredGymGenerator
from ..informative import InformativeBatches, PromptGroup
from ..types import GeneratorInput, GeneratorOutput
from ..validate import validate_generator_output

__all__ = ["prompt_groups", "sample_informative_batches"]

logger = logging.getLogger("skyrl_structured.integrations.skyrl")  # the module users configure

_HOOKED = "_skyrl_structured_informative"


def prompt_groups(generator_input: GeneratorInput) -> list[PromptGroup]:
    """The prompt groups of a batch SkyRL built (``prepare_generator_input``: each prompt's samples in a row)."""
    ids = generator_input.get("trajectory_ids")
    if ids is None:
        raise ValueError("generator.oversample_groups needs the batch's trajectory_ids (SkyRL's trainer passes them)")
    extras = generator_input.get("env_extras") or [{} for _ in ids]
    groups: dict[str, PromptGroup] = {}
    for i, trajectory_id in enumerate(ids):
        uid = str(trajectory_id.instance_id)
        if uid not in groups:
            groups[uid] = PromptGroup(
                uid, generator_input["prompts"][i], generator_input["env_classes"][i], dict(extras[i] or {})
            )
    return list(groups.values())


def sample_informative_batches(trainer: Any, generator: StructuredGymGenerator, cfg: Any) -> InformativeBatches:
    """Make ``trainer.generate`` run :class:`InformativeBatches` for SkyRL's filter loop (see the module docstring).

    ``trainer`` is SkyRL's ``RayPPOTrainer`` (anything with ``generate``, ``handle_dynamic_sampling``,
    ``dynamic_sampling_state`` and ``all_metrics``); ``cfg`` its root config. Idempotent.
    """
    existing = getattr(trainer.generate, _HOOKED, None)
    if isinstance(existing, InformativeBatches):
        return existing
    batches = InformativeBatches(generator, n_samples_per_prompt=int(cfg.generator.n_samples_per_prompt))
    train_batch_size = int(cfg.trainer.train_batch_size)
    handle: Callable[[GeneratorOutput, list[str]], Any] = trainer.handle_dynamic_sampling
    uids: list[list[str]] = []

    async def generate(generator_input: GeneratorInput) -> GeneratorOutput:
        batches.add(prompt_groups(generator_input))
        state = getattr(trainer, "dynamic_sampling_state", None) or {}
        needed = max(1, train_batch_size - int(state.get("num_prompts_in_batch", 0)))
        batch = await batches.next(
            needed,
            sampling_params=generator_input.get("sampling_params"),
            batch_metadata=generator_input.get("batch_metadata"),
        )
        while batch.groups == 0 and batches.pending:  # every group it ran was uninformative: go on
            batch = await batches.next(
                needed,
                sampling_params=generator_input.get("sampling_params"),
                batch_metadata=generator_input.get("batch_metadata"),
            )
        output = batch.output
        if batch.groups:
            validate_generator_output(len(batch.uids), output)
        metrics = cast(dict[str, Any], output).pop("rollout_metrics", None)  # as SkyRL's trainer.generate does
        if metrics is not None:
            trainer.all_metrics.update(metrics)
        uids[:] = [batch.uids]
        logger.debug(
            "informative batch: %d groups of %d needed, %d dropped, %d carried",
            batch.groups,
            needed,
            batch.dropped,
            batch.carried,
        )
        return output

    def handle_dynamic_sampling(generator_output: GeneratorOutput, batch_uids: list[str]) -> Any:
        # SkyRL's own filter, given the uids of the rows generate() returned, not the dataloader batch's.
        return handle(generator_output, uids.pop() if uids else batch_uids)

    hooked: Callable[[GeneratorInput], Awaitable[GeneratorOutput]] = generate
    setattr(hooked, _HOOKED, batches)
    trainer.generate = hooked
    trainer.handle_dynamic_sampling = handle_dynamic_sampling
    return batches
