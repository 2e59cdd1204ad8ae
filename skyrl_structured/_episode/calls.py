"""A rollout's engine and environment calls, each told to the observers and timed in one place.

Both episodes (:class:`~skyrl_structured._episode.episode.Episode` and
:class:`~skyrl_structured._episode.vision.VisionEpisode`) make their ``generate`` requests and their
``env.init`` / ``env.step`` calls through these two helpers, so every rollout, text or
vision-language, emits the same ``engine_call_*`` and ``env_call_*`` events (the trace recorder's
``engine`` and ``env.*`` spans) and fills the same ``llm`` / ``env`` time splits.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .._runtime.contexts import RolloutContext
from ..observe import EnvMethod, RolloutObserver
from ..types import InferenceEngineOutput
from .replies import ReplyParts, read_reply

__all__ = ["engine_call", "env_call"]

_T = TypeVar("_T")


async def engine_call(
    context: RolloutContext, turn: int, prompt_tokens: int, request: Callable[[], Awaitable[InferenceEngineOutput]]
) -> ReplyParts:
    """Send engine request ``turn`` and return its checked parts (:func:`.replies.read_reply`).

    The time in the engine counts towards the ``llm`` split on every exit, so a failed rollout's
    placeholder reports where its time went; ``engine_call_finished`` carries the error when the
    call or the reply check raised (a cancellation included), which is then re-raised.
    """
    context.emit(RolloutObserver.engine_call_started, turn, prompt_tokens)
    try:
        started = time.monotonic()
        try:
            reply = await request()
        finally:
            context.time_splits["llm"] += time.monotonic() - started
        # Checked before any use: a bad reply fails this rollout alone, never the batch.
        parts = read_reply(reply)
    except BaseException as exc:
        context.emit(RolloutObserver.engine_call_finished, turn, None, None, exc)
        raise
    context.emit(RolloutObserver.engine_call_finished, turn, len(parts[1]), parts[2], None)
    return parts


async def env_call(
    context: RolloutContext, method: EnvMethod, turn: int, call: Callable[[], Awaitable[_T]], *, timed: bool
) -> _T:
    """Run the environment's ``method`` (``init`` or ``step`` ``turn``) between its two observer events.

    ``timed`` adds the call's time to the ``env`` split (SkyRL times ``step``, not ``init``). An
    error, a cancellation included, reaches ``env_call_finished`` and is re-raised.
    """
    context.emit(RolloutObserver.env_call_started, method, turn)
    started = time.monotonic()
    try:
        result = await call()
    except BaseException as exc:
        context.emit(RolloutObserver.env_call_finished, method, turn, exc)
        raise
    finally:
        if timed:
            context.time_splits["env"] += time.monotonic() - started
    context.emit(RolloutObserver.env_call_finished, method, turn, None)
    return result
