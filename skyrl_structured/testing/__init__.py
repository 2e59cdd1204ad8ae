"""Test kit: scripted engines and environments, chaos wrappers, a leak tracker, a concurrency check.

Everything here drives the real generator; nothing is mocked out. The pytest plugin
(``skyrl_structured.testing.pytest_plugin``, registered as the ``skyrl_structured`` entry point)
turns the pieces into fixtures. See docs/testing.md.
"""

from .chaos import ENGINE_STAGES as ENGINE_STAGES
from .chaos import STAGES as STAGES
from .chaos import ChaosEngine as ChaosEngine
from .chaos import ChaosError as ChaosError
from .chaos import ChaosEvent as ChaosEvent
from .chaos import ChaosPolicy as ChaosPolicy
from .chaos import register_chaos_env as register_chaos_env
from .check import CaseResult as CaseResult
from .check import ConcurrencyReport as ConcurrencyReport
from .check import check_structured_concurrency as check_structured_concurrency
from .engines import EngineCall as EngineCall
from .engines import Reply as Reply
from .engines import ScriptedEngine as ScriptedEngine
from .engines import replies_by_turn as replies_by_turn
from .envs import SCRIPTED_ENV as SCRIPTED_ENV
from .envs import EnvLedger as EnvLedger
from .envs import ScriptedEnv as ScriptedEnv
from .envs import Turn as Turn
from .envs import register_scripted_env as register_scripted_env
from .leaks import LeakTracker as LeakTracker
from .leaks import TrackedEngine as TrackedEngine
from .vision import RenderCall as RenderCall
from .vision import ScriptedVLMEngine as ScriptedVLMEngine
from .vision import image_part as image_part
from .vision import png_image as png_image

__all__ = (
    "ENGINE_STAGES",
    "SCRIPTED_ENV",
    "STAGES",
    "CaseResult",
    "ChaosEngine",
    "ChaosError",
    "ChaosEvent",
    "ChaosPolicy",
    "ConcurrencyReport",
    "EngineCall",
    "EnvLedger",
    "LeakTracker",
    "RenderCall",
    "Reply",
    "ScriptedEngine",
    "ScriptedEnv",
    "ScriptedVLMEngine",
    "TrackedEngine",
    "Turn",
    "check_structured_concurrency",
    "image_part",
    "png_image",
    "register_chaos_env",
    "register_scripted_env",
    "replies_by_turn",
)
