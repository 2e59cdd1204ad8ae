"""skyrl_structured: SkyRL's gym generator on structured concurrency.

Swap ``SkyRLGymGenerator`` for :class:`StructuredGymGenerator` and get the same
``GeneratorOutput``, plus contained rollout failures, guaranteed environment cleanup and clean
cancellation on asyncio and trio.
"""

from .config import ChatTemplateConfig as ChatTemplateConfig
from .config import GeneratorConfig as GeneratorConfig
from .config import InferenceEngineConfig as InferenceEngineConfig
from .config import ResilienceSettings as ResilienceSettings
from .config import SamplingParams as SamplingParams
from .config import SkyRLGymConfig as SkyRLGymConfig
from .envs import AsyncEnvironment as AsyncEnvironment
from .envs import EnvHandle as EnvHandle
from .envs import open_env as open_env
from .errors import EnvBoundaryError as EnvBoundaryError
from .errors import EnvWorkerError as EnvWorkerError
from .errors import GeneratorOutputError as GeneratorOutputError
from .errors import MalformedEngineReplyError as MalformedEngineReplyError
from .errors import PromptTooLongError as PromptTooLongError
from .errors import RolloutCancelledError as RolloutCancelledError
from .errors import RolloutError as RolloutError
from .errors import StragglerCutError as StragglerCutError
from .errors import VisionFeatureError as VisionFeatureError
from .failures import FailedRollout as FailedRollout
from .generator import StructuredGymGenerator as StructuredGymGenerator
from .informative import InformativeBatch as InformativeBatch
from .informative import InformativeBatches as InformativeBatches
from .informative import PromptGroup as PromptGroup
from .observe import FinishedTrajectory as FinishedTrajectory
from .observe import RolloutObserver as RolloutObserver
from .observe import RolloutRef as RolloutRef
from .observe import TrajectoryStep as TrajectoryStep
from .stream import TrajectoryStream as TrajectoryStream
from .types import ROLLOUT_ERROR_STOP_REASON as ROLLOUT_ERROR_STOP_REASON
from .types import BatchMetadata as BatchMetadata
from .types import ConversationType as ConversationType
from .types import GeneratorInput as GeneratorInput
from .types import GeneratorOutput as GeneratorOutput
from .types import InferenceClient as InferenceClient
from .types import InferenceEngineInput as InferenceEngineInput
from .types import InferenceEngineOutput as InferenceEngineOutput
from .types import RenderingClient as RenderingClient
from .types import StepWiseOutput as StepWiseOutput
from .types import TrajectoryID as TrajectoryID
from .types import TrajectoryOutput as TrajectoryOutput
from .validate import validate_generator_output as validate_generator_output
from .vlm_generator import StructuredVLMGymGenerator as StructuredVLMGymGenerator

__version__ = "0.1.0"

__all__ = (
    "ROLLOUT_ERROR_STOP_REASON",
    "AsyncEnvironment",
    "BatchMetadata",
    "ChatTemplateConfig",
    "ConversationType",
    "EnvBoundaryError",
    "EnvHandle",
    "EnvWorkerError",
    "FailedRollout",
    "FinishedTrajectory",
    "GeneratorConfig",
    "GeneratorInput",
    "GeneratorOutput",
    "GeneratorOutputError",
    "InferenceClient",
    "InferenceEngineConfig",
    "InferenceEngineInput",
    "InferenceEngineOutput",
    "InformativeBatch",
    "InformativeBatches",
    "MalformedEngineReplyError",
    "PromptGroup",
    "PromptTooLongError",
    "RenderingClient",
    "ResilienceSettings",
    "RolloutCancelledError",
    "RolloutError",
    "RolloutObserver",
    "RolloutRef",
    "SamplingParams",
    "SkyRLGymConfig",
    "StepWiseOutput",
    "StragglerCutError",
    "StructuredGymGenerator",
    "StructuredVLMGymGenerator",
    "TrajectoryID",
    "TrajectoryOutput",
    "TrajectoryStep",
    "TrajectoryStream",
    "VisionFeatureError",
    "open_env",
    "validate_generator_output",
)

# Public names defined in private modules are shown as the package's own (as httpx does). Only
# classes without annotations to resolve are there, so typing.get_type_hints still works on them.
for _name in __all__:
    _obj = globals()[_name]
    if any(part.startswith("_") for part in getattr(_obj, "__module__", "").split(".")[1:]):
        _obj.__module__ = "skyrl_structured"
del _name, _obj
