"""A real inference client driven by a function: deterministic replies, full session bookkeeping.

Like ``httpx.MockTransport``: :class:`ScriptedEngine` implements the client interface the
generator calls (``generate``/``finish_session``) and asks a handler, sync or async, what to
answer. Everything else a real engine does is real: token ids come from the tokenizer, EOS is
appended on ``"stop"``, logprobs are produced when requested, sessions are tracked.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Self

import anyio

from ..types import InferenceEngineInput, InferenceEngineOutput

__all__ = ["EngineCall", "Reply", "ScriptedEngine", "replies_by_turn"]


@dataclass
class Reply:
    """What the engine answers to one request.

    ``token_ids`` defaults to ``tokenizer.encode(text)`` plus EOS when ``stop_reason == "stop"``;
    ``logprobs`` defaults to a fixed, distinct value per position.
    """

    text: str
    stop_reason: str = "stop"
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    delay: float = 0.0


@dataclass
class EngineCall:
    """One request the engine received."""

    prompt_token_ids: list[int]
    session_id: Hashable | None
    sampling_params: dict[str, Any] | None
    cache_salt: str | None
    model: str | None
    #: The request's ``mm_features`` entry for this prompt (vision-language rollouts), else None.
    mm_features: Any = None


Handler = Callable[[EngineCall], "Reply | str | Awaitable[Reply | str]"]


def replies_by_turn(*replies: Reply | str) -> Handler:
    """A handler answering ``replies[k]`` to a session's (k+1)-th request; the last one repeats.

    Counting per session keeps the answers the same however concurrent rollouts interleave.

    Raises:
        ValueError: no reply given.
    """
    if not replies:
        raise ValueError("`replies` must hold at least one reply (text or Reply)")
    turns: dict[Hashable | None, int] = {}

    def handler(call: EngineCall) -> Reply | str:
        turn = turns.get(call.session_id, 0)
        turns[call.session_id] = turn + 1
        return replies[min(turn, len(replies) - 1)]

    return handler


@dataclass
class ScriptedEngine:
    """An inference client whose replies come from ``handler(call)``.

    Args:
        tokenizer: encodes reply text into token ids.
        handler: returns a :class:`Reply` (or plain text) for each request, sync or async.
        logprobs: return logprobs when the request's sampling params do not say (SkyRL's trainer
            sends ``sampling_params=None`` and lets the engine use its configured defaults).
        weight_version: exposed as ``weight_version`` (for the generator's cache salt).
    """

    tokenizer: Any
    handler: Handler
    logprobs: bool = True
    weight_version: Any = None
    calls: list[EngineCall] = field(default_factory=list)
    finished_sessions: list[Hashable] = field(default_factory=list)
    started_sessions: set[Hashable] = field(default_factory=set)

    @classmethod
    def from_replies(cls, tokenizer: Any, *replies: Reply | str, **kwargs: Any) -> Self:
        """An engine answering each session's k-th request with ``replies[k]`` (see :func:`replies_by_turn`)."""
        return cls(tokenizer, replies_by_turn(*replies), **kwargs)

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        prompts = input_batch.get("prompt_token_ids") or []
        session_ids = input_batch.get("session_ids") or [None] * len(prompts)
        params = input_batch.get("sampling_params")
        want_logprobs = self.logprobs if params is None else params.get("logprobs") is not None
        texts: list[str] = []
        ids_out: list[list[int]] = []
        reasons: list[str] = []
        logprobs_out: list[list[float]] = []
        features = input_batch.get("mm_features") or [None] * len(prompts)
        for prompt, session_id, mm in zip(prompts, session_ids, features, strict=True):
            call = EngineCall(list(prompt), session_id, params, input_batch.get("cache_salt"), model, mm)
            self.calls.append(call)
            if session_id is not None:
                self.started_sessions.add(session_id)
            answer = self.handler(call)
            if inspect.isawaitable(answer):
                answer = await answer
            reply = Reply(answer) if isinstance(answer, str) else answer
            if reply.delay:
                await anyio.sleep(reply.delay)
            ids = reply.token_ids
            if ids is None:
                ids = list(self.tokenizer.encode(reply.text, add_special_tokens=False))
                if reply.stop_reason == "stop":
                    ids.append(self.tokenizer.eos_token_id)
            texts.append(reply.text)
            ids_out.append(list(ids))
            reasons.append(reply.stop_reason)
            lp = reply.logprobs if reply.logprobs is not None else [-0.5 - 0.01 * k for k in range(len(ids))]
            logprobs_out.append(list(lp))
        return {
            "responses": texts,
            "response_ids": ids_out,
            "stop_reasons": reasons,
            "response_logprobs": logprobs_out if want_logprobs else None,
        }

    async def finish_session(self, session_id: Hashable) -> None:
        self.finished_sessions.append(session_id)
