"""Partial replies: what an engine had sampled for a request when its caller stopped it.

With ``generator.carry_over_cut_rollouts`` a rollout cut by the straggler cutoff is parked and
resumed later; the tokens its in-flight request had sampled are kept, not sampled again, when the
engine hands them back. The caller opens a sink around one ``generate`` call of one prompt
(:func:`collecting_partial`); an engine that can tell what it has sampled so far calls
:func:`offer_partial` when the request is cancelled (or as it streams; the last offer wins). An
engine that never offers is still correct: the rollout then resumes from its last finished turn.

``VLLMEngine`` offers on cancellation (vLLM's cumulative output at the abort) and so does the
:class:`~skyrl_structured.testing.ScriptedEngine` handler that calls :func:`offer_partial`.
``HTTPEngine`` streams its completion while a sink is open: it lets the sink read what has arrived
so far (:func:`follow_partial`, nothing copied until read) and fixes it at the cut. SkyRL's clients
offer nothing yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = [
    "PartialReply",
    "PartialSink",
    "collecting_partial",
    "follow_partial",
    "offer_partial",
    "partial_wanted",
    "withdraw_partial",
]


@dataclass(frozen=True)
class PartialReply:
    """The tokens a stopped request had sampled, with their logprobs (None where not asked) and text."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    text: str = ""


class PartialSink:
    """Where one request's partial reply lands: ``reply`` is the last one offered (None: none was).

    While an engine streams, ``reply`` may be a live view (:func:`follow_partial`): each read tells
    what has arrived so far.
    """

    __slots__ = ("_live", "_reply")

    def __init__(self) -> None:
        self._reply: PartialReply | None = None
        self._live: Callable[[], PartialReply | None] | None = None

    @property
    def reply(self) -> PartialReply | None:
        return self._live() if self._live is not None else self._reply

    @reply.setter
    def reply(self, value: PartialReply | None) -> None:
        self._reply, self._live = value, None


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


def follow_partial(view: Callable[[], PartialReply | None]) -> None:
    """Let the caller read this request's reply so far through ``view`` while it streams; a no-op where nobody asked.

    ``view`` is called only when the sink is read, so following a stream costs nothing per token. The
    engine ends it with :func:`offer_partial` (at a cut: the reply fixed as it was) or
    :func:`withdraw_partial` (the request finished: there is nothing partial to keep).
    """
    sink = _SINK.get()
    if sink is not None:
        sink._reply, sink._live = None, view


def withdraw_partial() -> None:
    """Nothing partial to hand back (the request finished); a no-op where nobody asked."""
    sink = _SINK.get()
    if sink is not None:
        sink.reply = None
