"""The straggler cutoff: once enough of a batch (or of a prompt group) is final, the rest get a grace, then are cut.

A rollout is *final* once it succeeded, or failed after its retries. With
``generator.straggler_cutoff=f``, a scope (the whole batch, or one prompt group: the rollouts
sharing ``trajectory_ids[i].instance_id``) whose final share reaches ``f`` gives its other
rollouts ``generator.straggler_grace_s`` more seconds (a grace that stops while the generator is
paused), then cancels each one's own cancel scope. A cut rollout cleans up like any cancelled one
(environment closed, session finished, engine request aborted) and becomes a failure carrying a
:class:`StragglerCutError`: a placeholder under ``failed_rollout_policy``, counted in
``generate/num_cut_rollouts``. It is never retried.

The threshold of a scope of ``n`` rollouts is ``ceil(f * n)`` (at least 1); with ``f = 1.0`` nothing
is ever cut. The grace task of a scope ends as soon as every rollout of the scope is final, so a
batch never waits for a grace it no longer needs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc

from ..failures import StragglerCutError, as_written
from .pauses import PauseClock

__all__ = ["StragglerCutError", "StragglerCutoff", "cutoff_threshold"]

logger = logging.getLogger(__name__)


def cutoff_threshold(fraction: float, size: int) -> int:
    """How many of ``size`` rollouts must be final before the rest are given their grace."""
    # Exact: 0.9 * 10 is 9.000000000000002 in floating point, and the cuts (size minus this) must
    # stay within a failure budget of 1 - fraction compared exactly too.
    return max(1, math.ceil(as_written(fraction) * size))


@dataclass
class _Scope:
    """One batch or one prompt group: its rollouts, how many are final, its grace."""

    name: str
    members: list[int]
    threshold: int
    final: int = 0
    grace: anyio.CancelScope | None = None
    cut: int = 0


class StragglerCutoff:
    """The cutoff of one ``generate()`` call.

    Args:
        fraction: ``generator.straggler_cutoff``.
        grace_s: ``generator.straggler_grace_s``.
        groups: one key per rollout; rollouts with the same key form one scope (one key for the
            whole batch in ``batch`` scope).
        clock: the generator's pause clock (the grace stops while it is paused).
    """

    def __init__(
        self, fraction: float, grace_s: float, groups: Sequence[Hashable], clock: PauseClock | None = None
    ) -> None:
        self.fraction = fraction
        self.grace_s = grace_s
        self._clock = clock
        members: dict[Hashable, list[int]] = {}
        for index, key in enumerate(groups):
            members.setdefault(key, []).append(index)
        scopes = {
            key: _Scope(str(key), indices, cutoff_threshold(fraction, len(indices))) for key, indices in members.items()
        }
        self._scope_of = [scopes[key] for key in groups]
        #: One INFO line per cut in batch scope; per-group cuts (many per batch) are logged at DEBUG.
        self._level = logging.INFO if len(scopes) == 1 else logging.DEBUG
        self._cancel = [anyio.CancelScope() for _ in groups]
        #: With carry-over: asks rollout ``i`` to park; True where it will (its engine call is cancelled
        #: instead of the rollout), False where it must be cut (the supervisor's).
        self.park: Callable[[int], bool] | None = None
        self._final = [False] * len(groups)
        self._cut = [False] * len(groups)
        #: Whether :meth:`cut_now` was called (the cuts are the group stop's, not the share's).
        self._stopped = False

    def scope(self, index: int) -> anyio.CancelScope:
        """The cancel scope rollout ``index`` runs in (all its attempts, its slot wait, its backoffs)."""
        return self._cancel[index]

    def was_cut(self, index: int) -> bool:
        """Whether the cutoff cancelled rollout ``index``."""
        return self._cut[index]

    def describe(self, index: int) -> str:
        """Why rollout ``index`` was cut, for its :class:`StragglerCutError`."""
        if self._stopped:
            return "the call had the informative groups it needed (InformativeBatches)"
        scope = self._scope_of[index]
        return (
            f"{scope.threshold} of the {len(scope.members)} rollouts of its scope were final "
            f"(generator.straggler_cutoff={self.fraction:g}) and generator.straggler_grace_s={self.grace_s:g}s "
            "had passed"
        )

    def finished(self, index: int, group: anyio.abc.TaskGroup) -> None:
        """Rollout ``index`` is final: maybe start its scope's grace, or end a grace no longer needed."""
        if self._final[index]:
            return
        self._final[index] = True
        scope = self._scope_of[index]
        scope.final += 1
        if scope.final == len(scope.members):
            if scope.grace is not None:
                scope.grace.cancel()
            return
        if scope.grace is None and scope.final >= scope.threshold:
            # Made here, not in the task: a scope whose last rollout finishes before the task runs
            # cancels it all the same.
            scope.grace = anyio.CancelScope()
            group.start_soon(self._grace_then_cut, scope)

    def _cut_members(self, scope: _Scope) -> None:
        for index in scope.members:
            if not self._final[index] and not self._cut[index]:
                self._cut[index] = True
                scope.cut += 1
                if self.park is None or not self.park(index):
                    self._cancel[index].cancel()

    def cut_now(self) -> int:
        """Cut every rollout not final yet, in every scope, at once (no grace); returns how many.

        What :class:`~skyrl_structured._runtime.group_stop.GroupStop` asks for once the call has enough.
        """
        before = sum(self._cut)
        self._stopped = True
        for scope in {id(s): s for s in self._scope_of}.values():
            if scope.grace is not None:
                scope.grace.cancel()
            self._cut_members(scope)
        return sum(self._cut) - before

    async def _grace_then_cut(self, scope: _Scope) -> None:
        assert scope.grace is not None
        with scope.grace:
            if self._clock is not None:
                await self._clock.sleep(self.grace_s)
            else:
                await anyio.sleep(self.grace_s)
            self._cut_members(scope)
            logger.log(
                self._level,
                "straggler cutoff: cut %d of the %d rollouts of %s after %d were final",
                scope.cut,
                len(scope.members),
                scope.name,
                scope.final,
            )
