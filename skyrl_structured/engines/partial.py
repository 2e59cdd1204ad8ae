"""Partial replies: what an engine had sampled for a request when its caller stopped it.

With ``generator.carry_over_cut_rollouts`` a rollout cut by the straggler cutoff is parked and
resumed later; the tokens its in-flight request had sampled are kept, not sampled again, when the
engine hands them back. The caller opens a sink around one ``generate`` call of one prompt
(:func:`collecting_partial`); an engine that can tell what it has sampled so far calls
:func:`offer_partial` when the request is cancelled (or as it streams; the last offer wins). An
engine that never offers is still correct: the rollout then resumes from its last finished turn.

``VLLMEngine`` offers on cancellation (vLLM's cumulative output at the abort) and so does the
:class:`~skyrl_structured.testing.ScriptedEngine` handler that calls :func:`offer_partial`.
``HTTPEngine`` (non-streaming completions) and SkyRL's clients offer nothing yet.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["PartialReply", "PartialSink", "collecting_partial", "offer_partial", "partial_wanted"]


@dataclass(frozen=True)
class PartialReply:
    """The tokens a stopped request had sampled, with their logprobs (None where not asked) and text."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    text: str = ""


class PartialSink:
    """Where one request's partial reply lands: ``reply`` is the last one offered (None: none was)."""

    __slots__ = ("reply",)

    def __init__(self) -> None:
        self.reply: PartialReply | None = None


_SINK: ContextVar[PartialSink | None] = ContextVar("skyrl_structured_partial_sink", default=None)


@contextmanager
def collecting_partial() -> Iterator[PartialSink]:
    """Open a sink for the ``generate`` call made inside the block (one prompt); read it after."""
    sink = PartialSink()
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def partial_wanted() -> bool:
    """Whether the caller keeps a partial reply (an engine may then stream what it would not otherwise)."""
    return _SINK.get() is not None


def offer_partial(token_ids: Sequence[int], logprobs: Sequence[float] | None = None, text: str = "") -> None:
    """Hand the caller what this request has sampled so far; a no-op where nobody asked.

    Call it from inside the engine's ``generate`` (the caller's context), e.g. in the handler of
    the request's cancellation, before re-raising it.
    """
    sink = _SINK.get()
    if sink is not None:
        sink.reply = PartialReply(list(token_ids), list(logprobs) if logprobs is not None else None, text)
