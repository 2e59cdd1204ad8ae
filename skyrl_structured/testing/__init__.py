"""Test kit: scripted engines and environments, chaos wrappers, a leak tracker, a pytest plugin."""

from .engines import EngineCall as EngineCall
from .engines import Reply as Reply
from .engines import ScriptedEngine as ScriptedEngine

__all__ = ("EngineCall", "Reply", "ScriptedEngine")
