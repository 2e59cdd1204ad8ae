"""Data shapes shared with SkyRL, key for key, so either side's objects flow through unchanged.

The generator only reads these structurally: SkyRL's own ``TrajectoryID``, ``GeneratorInput`` and
engine outputs work as they are, and ours can be handed to SkyRL's trainer.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, NotRequired, Protocol, TypeAlias, TypedDict, runtime_checkable

__all__ = [
    "ROLLOUT_ERROR_STOP_REASON",
    "AsyncEnvironment",
    "BatchMetadata",
    "ConversationType",
    "EnvHandle",
    "EnvStepOutput",
    "GeneratorInput",
    "GeneratorOutput",
    "InferenceClient",
    "InferenceEngineInput",
    "InferenceEngineOutput",
    "MessageType",
    "RenderingClient",
    "RolloutOutput",
    "SkyRLConfig",
    "StepWiseOutput",
    "Tokenizer",
    "TrajectoryID",
    "TrajectoryOutput",
    "prompt_group",
]

MessageType = dict[str, Any]
ConversationType = list[MessageType]

#: ``stop_reason`` of a placeholder that stands in for a failed rollout.
ROLLOUT_ERROR_STOP_REASON = "rollout_error"

TrainingPhase = Literal["train", "eval"]

SkyRLConfig: TypeAlias = Any
"""A SkyRL configuration section, left untyped on purpose (the one place this is said).

The generator takes SkyRL's own ``GeneratorConfig`` / ``SkyRLGymConfig`` (dataclasses), an OmegaConf
``DictConfig`` from a Hydra entrypoint, or this package's :class:`~skyrl_structured.GeneratorConfig`
and :class:`~skyrl_structured.SkyRLGymConfig`. It reads fields by attribute, and the knobs SkyRL
lacks with their defaults when absent (``config._get``), so no one static type covers them all;
SkyRL ships no type information for mypy to check its classes against anyway. Values read from
such a config are checked where they are read (``config.resolve_resilience``, ``validate``).
"""


@dataclass
class TrajectoryID:
    """Which dataset instance a rollout belongs to, and which sample of it."""

    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def prompt_group(trajectory_id: TrajectoryID) -> str:
    """The one group key of a rollout: its prompt, ``trajectory_id.instance_id`` as a string.

    The rollouts of one prompt (its ``n_samples_per_prompt`` repetitions) share it: the group
    policies, the straggler cutoff's ``group`` scope and the sampling seeds all group by it.
    """
    return str(trajectory_id.instance_id)


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
    trajectory_ids: NotRequired[list[TrajectoryID] | None]
    trajectory_generation_times: NotRequired[list[float] | None]
    trajectory_time_splits: NotRequired[dict[str, list[float]] | None]
    rollout_expert_indices: list[Any] | None
    is_last_step: NotRequired[list[bool] | None]
    env_metrics: NotRequired[list[dict[str, Any]] | None]
    pixel_values: NotRequired[list[Any] | None]
    image_grid_thw: NotRequired[list[Any] | None]
    #: Ours (SkyRL's trainer ignores it): the policy version that sampled each response token, -1 where none did.
    rollout_policy_versions: NotRequired[list[list[int]]]


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
    """The part of SkyRL's ``InferenceEngineInterface`` the generator calls, and nothing more.

    Structural: SkyRL's own clients (``RemoteInferenceClient``, ...), this package's engines
    (:mod:`skyrl_structured.engines`) and the scripted ones of :mod:`skyrl_structured.testing`
    satisfy it without inheriting from it. The signatures are SkyRL 0.3.0's, so a client written
    against SkyRL's interface fits: ``finish_session`` is called with the rollout's session id, a
    ``str`` (SkyRL's own type for it; an engine that accepts any ``Hashable`` fits as well).
    """

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput: ...

    async def finish_session(self, session_id: str) -> None: ...


@runtime_checkable
class RenderingClient(InferenceClient, Protocol):
    """An :class:`InferenceClient` that also renders conversations: what the vision-language generator needs.

    ``render_chat_completion({"json": {"model": ..., "messages": [...]}})`` is vLLM's render endpoint
    as SkyRL's ``InferenceEngineInterface`` exposes it: ``{"token_ids": [...], "features": {...} | None}``.
    A ``model_name`` attribute, where the client has one, is sent as the request's ``model``.
    """

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]: ...


class EnvStepOutput(TypedDict):
    """What an environment's ``step`` returns: ``skyrl_gym``'s ``BaseTextEnvStepOutput``, key for key.

    The agent loop reads ``observations``, ``reward``, ``done`` and, when set, ``postprocessed_action``;
    ``metadata`` may be left out.
    """

    observations: ConversationType
    reward: float
    done: bool
    metadata: NotRequired[dict[str, Any]]
    postprocessed_action: NotRequired[str | None]


@runtime_checkable
class EnvHandle(Protocol):
    """What the agent loop needs from an opened environment: ``async with open_env(...) as env`` gives one.

    Behind it: a synchronous ``skyrl_gym`` env run in the generator's worker threads, an env with
    async ``init``/``step``, or a handle to an env in a worker process or Ray actor (``env_executor``).
    (``isinstance`` sees only that the methods exist, not that they are async: a sync ``skyrl_gym``
    env passes it too, which is why :func:`~skyrl_structured.envs.is_async_env` decides.)
    """

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]: ...

    async def step(self, action: str) -> EnvStepOutput: ...

    def get_metrics(self) -> dict[str, Any]: ...


@runtime_checkable
class AsyncEnvironment(EnvHandle, Protocol):
    """An environment that speaks the async protocol itself, so :func:`~skyrl_structured.open_env` uses it as is.

    ``__aenter__`` returns the handle the rollout then calls (usually the env itself); ``__aexit__``
    closes it, exactly once, whatever ended the rollout.
    """

    async def __aenter__(self) -> EnvHandle: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> object: ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the generator and its episodes call on a Hugging Face tokenizer.

    Any ``transformers`` tokenizer with a chat template fits. The fast render path
    (``_episode/fast_render.py``) also reads ``transformers`` internals; it takes its tokenizer as
    ``Any`` for that reason and checks at run time what it may use.
    """

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def eos_token(self) -> str | None: ...

    chat_template: str | None

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str | list[str]: ...

    def apply_chat_template(self, conversation: ConversationType, **kwargs: Any) -> Any: ...


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
    #: The policy version that sampled each response token (-1: not sampled); None where not tracked.
    policy_versions: list[int] | None = None


@dataclass
class StepWiseOutput:
    """One rollout returned turn by turn, for step-wise training."""

    step_outputs: list[TrajectoryOutput] = field(default_factory=list)
    e2e_time: float | None = None
    time_splits: dict[str, float] | None = None


#: What a successful rollout returns (``agent_loop``'s return type): one trajectory, or its steps.
RolloutOutput: TypeAlias = TrajectoryOutput | StepWiseOutput
