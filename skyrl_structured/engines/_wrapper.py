"""One base for inference clients that wrap another one (fault injection, leak tracking, traps)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ..types import InferenceClient

__all__ = ["EngineWrapper"]


class EngineWrapper:
    """An inference client that forwards to ``engine``.

    Subclasses override ``generate`` and/or ``finish_session`` and call ``super()`` for the real
    call. Every other attribute (``weight_version``, ``sleep``, ``wake_up``, an engine's own
    methods) is the wrapped client's, so a wrapper can stand in for the client anywhere.
    """

    def __init__(self, engine: InferenceClient) -> None:
        # A proxy: every attribute the wrapper lacks is the wrapped client's, so it holds it as Any.
        self.engine: Any = engine

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.engine.generate(input_batch, *args, **kwargs)

    async def finish_session(self, session_id: Hashable) -> None:
        await self.engine.finish_session(session_id)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks; never forward dunders or a missing `engine`
        # (copy and pickle probe both before __init__ has run).
        if name.startswith("__") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)
