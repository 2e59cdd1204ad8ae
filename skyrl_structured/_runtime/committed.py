"""The context each admitted rollout holds at the engines: ``max_concurrent_rollouts="auto"``'s committed KV.

vLLM's KV-cache usage counts the blocks of requests at the engine only: a multi-turn rollout whose
environment is stepping has none there, yet its next turn will ask for its whole history again.
So admission also counts what it has committed (:mod:`~skyrl_structured._runtime.admission`): each
admitted attempt's context, its latest engine call's prompt plus that call's response, in tokens.

Each ``generate()`` call with ``max_concurrent_rollouts="auto"`` keeps one :class:`CommittedContexts`:
the supervisor adds an attempt when it gets its slot and removes it when the attempt ends, on every
path (success, failure, cancellation, a cut: the attempt's ``finally``), and every engine call
(:mod:`~skyrl_structured._episode.calls`, the agents' capture sessions included) keeps the attempt's
latest context on its ``RolloutContext``. The admission driver sums the calls running at each reading
(:func:`committed_tokens`); a call's set goes with the call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

__all__ = ["CommittedContexts", "HoldsContext", "committed_tokens"]


class HoldsContext(Protocol):
    """An admitted attempt (a ``RolloutContext``): the tokens its latest engine call holds, None before its first."""

    @property
    def engine_context_tokens(self) -> int | None: ...


class CommittedContexts:
    """The admitted attempts of one ``generate()`` call, by identity (an attempt's context is not hashable)."""

    __slots__ = ("_admitted",)

    def __init__(self) -> None:
        # Keyed by id(): the value keeps the object alive, so its id is not reused while it is here.
        self._admitted: dict[int, HoldsContext] = {}

    def __len__(self) -> int:
        return len(self._admitted)

    def __iter__(self) -> Iterator[HoldsContext]:
        """The attempts admitted now."""
        return iter(list(self._admitted.values()))

    def admit(self, attempt: HoldsContext) -> None:
        """``attempt`` got its slot."""
        self._admitted[id(attempt)] = attempt

    def release(self, attempt: HoldsContext) -> None:
        """``attempt`` ended (whatever way); releasing one not admitted does nothing."""
        self._admitted.pop(id(attempt), None)

    def tally(self) -> tuple[int, int, int]:
        """(tokens held by the attempts that made an engine call, how many did, how many did not yet)."""
        tokens = called = 0
        for attempt in self._admitted.values():
            held = attempt.engine_context_tokens
            if held is not None:
                tokens += held
                called += 1
        return tokens, called, len(self._admitted) - called


def committed_tokens(calls: Iterable[CommittedContexts]) -> float | None:
    """The context the admitted attempts of ``calls`` hold, in tokens.

    An attempt without an engine call yet counts as the mean of those with one. 0.0 when none is
    admitted; None when some are and none has made a call (nothing measured yet).
    """
    tokens = called = waiting = 0
    for call in calls:
        held, with_call, without = call.tally()
        tokens += held
        called += with_call
        waiting += without
    if called == 0:
        return None if waiting else 0.0
    return tokens + waiting * tokens / called
