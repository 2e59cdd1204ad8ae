"""Data shapes shared with SkyRL, key for key, so either side's objects flow through unchanged.

The generator only reads these structurally: SkyRL's own ``TrajectoryID``, ``GeneratorInput`` and
engine outputs work as they are, and ours can be handed to SkyRL's trainer.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, Protocol, TypedDict, runtime_checkable

__all__ = [
    "ROLLOUT_ERROR_STOP_REASON",
    "BatchMetadata",
    "ConversationType",
    "GeneratorInput",
    "GeneratorOutput",
    "InferenceClient",
    "InferenceEngineInput",
    "InferenceEngineOutput",
    "MessageType",
    "StepWiseOutput",
    "TrajectoryID",
    "TrajectoryOutput",
]

MessageType = dict[str, Any]
ConversationType = list[MessageType]

#: ``stop_reason`` of a placeholder that stands in for a failed rollout.
ROLLOUT_ERROR_STOP_REASON = "rollout_error"

TrainingPhase = Literal["train", "eval"]


@dataclass
class TrajectoryID:
    """Which dataset instance a rollout belongs to, and which sample of it."""

    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


@dataclass
class BatchMetadata:
    global_step: int
    training_phase: TrainingPhase


class GeneratorInput(TypedDict):
    prompts: list[ConversationType]
    env_classes: list[str]
    env_extras: list[dict[str, Any]] | None
    sampling_params: NotRequired[dict[str, Any] | None]
    trajectory_ids: NotRequired[list[TrajectoryID] | None]
    batch_metadata: NotRequired[BatchMetadata | None]


class GeneratorOutput(TypedDict):
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | list[list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None
    rollout_metrics: dict[str, Any] | None
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: NotRequired[list[Any] | None]
    trajectory_generation_times: NotRequired[list[float] | None]
    trajectory_time_splits: NotRequired[dict[str, list[float]] | None]
    rollout_expert_indices: list[Any] | None
    is_last_step: NotRequired[list[bool] | None]
    env_metrics: NotRequired[list[dict[str, Any]] | None]
    pixel_values: NotRequired[list[Any] | None]
    image_grid_thw: NotRequired[list[Any] | None]


class InferenceEngineInput(TypedDict, total=False):
    prompts: list[ConversationType] | None
    prompt_token_ids: list[list[int]] | None
    sampling_params: dict[str, Any] | None
    session_ids: list[Hashable] | None
    mm_features: list[Any] | None
    cache_salt: str | None


class InferenceEngineOutput(TypedDict, total=False):
    responses: list[str]
    response_ids: list[list[int]]
    stop_reasons: list[str]
    response_logprobs: list[list[float]] | None
    prompt_logprobs: list[list[float]] | None
    rollout_expert_indices: list[Any] | None


@runtime_checkable
class InferenceClient(Protocol):
    """The part of SkyRL's ``InferenceEngineInterface`` the generator calls."""

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput: ...

    async def finish_session(self, session_id: Hashable) -> None: ...


@dataclass
class TrajectoryOutput:
    """One finished rollout (or, step-wise, one turn of it)."""

    response_ids: list[int]
    reward: list[float] | float
    stop_reason: str
    loss_mask: list[int]
    prompt_ids: list[int]
    rollout_logprobs: list[float] | None
    env_metrics: dict[str, Any]
    rollout_expert_indices: Any | None = None
    pixel_values: Any | None = None
    image_grid_thw: Any | None = None
    #: Wall-clock seconds the rollout took end to end.
    e2e_time: float | None = None
    #: Wall-clock seconds by phase: ``"llm"`` (engine calls) and ``"env"`` (``env.step``).
    time_splits: dict[str, float] | None = None


@dataclass
class StepWiseOutput:
    """One rollout returned turn by turn, for step-wise training."""

    step_outputs: list[TrajectoryOutput] = field(default_factory=list)
    e2e_time: float | None = None
    time_splits: dict[str, float] | None = None
