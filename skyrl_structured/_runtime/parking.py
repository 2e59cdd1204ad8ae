"""Parked rollouts: a cut rollout kept as state between ``generate()`` calls, never as a task.

With ``generator.carry_over_cut_rollouts`` the straggler cutoff asks a rollout to park
(:class:`ParkRequest`) instead of cancelling it. A rollout whose engine request is in flight has
that request cancelled (the engine may hand back what it had sampled: ``engines/partial.py``); its
episode raises :class:`RolloutParked` with its state, the environment's exit hands its open
environment over instead of closing it, and the supervisor records the row as cut and puts a
:class:`Parked` into the generator's :class:`ParkingLot`. A rollout in an environment call at the
cut is cut as without carry-over: its step's effects are not known until it returns.

The generator owns every parked environment (DESIGN rule 25) and closes it exactly once: when the
resumed rollout ends, when it is dropped (stale, or claimed by a row whose env class, prompt or
sampling differ), on ``aclose()``, on a ``generate()`` that raised or was cancelled, and at
interpreter exit (:func:`close_parked_without_loop`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..observe import CleanupOutcome
from ..types import InferenceClient
from .cleanup import Cleanup, CleanupStats

if TYPE_CHECKING:
    from .contexts import RolloutContext

__all__ = [
    "ParkRequest",
    "Parked",
    "ParkedEnv",
    "ParkedEpisode",
    "ParkingLot",
    "RolloutParked",
    "close_parked",
    "close_parked_without_loop",
    "parking_key",
]

logger = logging.getLogger(__name__)

#: A parked rollout's identity: its trajectory id's (instance_id, repetition_id).
ParkingKey = tuple[str, int]


def parking_key(trajectory_id: Any) -> ParkingKey | None:
    """The key a rollout is parked under and claimed by; None without a usable trajectory id."""
    instance = getattr(trajectory_id, "instance_id", None)
    repetition = getattr(trajectory_id, "repetition_id", None)
    if instance is None or not isinstance(repetition, int) or isinstance(repetition, bool):
        return None
    return (str(instance), repetition)


class ParkedEpisode(Protocol):
    """An episode's saved state: what it sampled (kept as sampled) and how to go on from there."""

    @property
    def tokens(self) -> int:
        """Sampled tokens kept (the partial reply's included)."""
        ...

    @property
    def first_version(self) -> int | None:
        """The policy version of the oldest sampled token kept (None: none was sampled)."""
        ...

    async def resume(
        self,
        env: Any,
        *,
        context: RolloutContext,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> Any:
        """Go on in ``env`` (the same environment, still open) and return the rollout's output."""
        ...


class ParkedEnv(Protocol):
    """A parked rollout's open environment (``open_env``'s context manager, handed over at the cut)."""

    def adopt(
        self, stats: CleanupStats, rollout: RolloutContext | None, then: Cleanup | None
    ) -> AbstractAsyncContextManager[Any]:
        """The environment again, for a new owner: its exit closes it, then runs ``then``."""
        ...

    def close_without_loop(self) -> bool:
        """Close it from synchronous code (interpreter exit); False where that cannot be done."""
        ...


class RolloutParked(Exception):
    """Raised out of an episode whose rollout is parked; carries its state up to the supervisor.

    ``env`` is set by the environment's exit (which then does not close it) and ``record`` by
    ``agent_loop`` (which then does not end the session). Never reaches the caller of ``generate()``.
    """

    def __init__(self, episode: ParkedEpisode) -> None:
        super().__init__("the straggler cutoff parked this rollout (generator.carry_over_cut_rollouts)")
        self.episode = episode
        self.env: ParkedEnv | None = None
        self.record: Parked | None = None

    def keep(
        self,
        trajectory_id: Any,
        env_class: str,
        prompt: Any,
        sampling_params: dict[str, Any] | None,
        session_id: str,
        parked_at: int,
    ) -> None:
        """Record what the generator keeps (``agent_loop``, once its environment was handed over open).

        The rollout's row (``env_class``, ``prompt``, ``sampling_params``), its session and the policy
        version now. Nothing is kept without an open environment or a usable trajectory id: the
        supervisor then closes what was handed over.
        """
        key = parking_key(trajectory_id)
        if self.env is not None and key is not None:
            self.record = Parked(key, env_class, prompt, sampling_params, self.episode, self.env, session_id, parked_at)


class ParkRequest:
    """One attempt's line to the cutoff: whether it is asked to park, and the engine call it may cancel."""

    __slots__ = ("_call", "requested")

    def __init__(self) -> None:
        self.requested = False
        self._call: anyio.CancelScope | None = None

    def call_scope(self) -> anyio.CancelScope:
        """A scope for the engine call about to be made: the cut cancels it (and only it)."""
        scope = anyio.CancelScope()
        if self.requested:
            scope.cancel()
        self._call = scope
        return scope

    def call_ended(self) -> None:
        self._call = None

    def request(self) -> bool:
        """Ask to park; True where an engine call was in flight and is now cancelled (the rollout parks),
        False where the rollout is elsewhere (an environment call, waiting to start) and must be cut."""
        self.requested = True
        if self._call is None:
            return False
        self._call.cancel()
        return True


@dataclass
class Parked:
    """One parked rollout: what its row was, its saved episode, its open environment and session."""

    key: ParkingKey
    env_class: str
    prompt: Any
    sampling_params: dict[str, Any] | None
    episode: ParkedEpisode
    env: ParkedEnv
    #: Its inference session, ended when the environment is closed.
    session_id: str
    #: The policy version when it was parked.
    parked_at: int

    def matches(self, env_class: str, prompt: Any, sampling_params: dict[str, Any] | None) -> bool:
        """Whether a row asks for this same rollout (same env class, prompt and sampling)."""
        return self.env_class == env_class and self.prompt == prompt and self.sampling_params == sampling_params


@dataclass
class ParkingLot:
    """The generator's parked rollouts by key, and the counts ``rollout_metrics`` reports."""

    def __post_init__(self) -> None:
        self._parked: dict[ParkingKey, Parked] = {}
        #: Whether the one INFO line about an engine that hands back no partial reply was logged.
        self.said_no_partial = False

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, parked: Parked) -> Parked | None:
        """Keep ``parked``; returns one it displaced under the same key (to be closed), if any."""
        displaced = self._parked.pop(parked.key, None)
        self._parked[parked.key] = parked
        return displaced

    def claim(
        self, key: ParkingKey | None, env_class: str, prompt: Any, sampling_params: dict[str, Any] | None
    ) -> tuple[Parked | None, Parked | None]:
        """(the parked rollout the row resumes, or one it makes a mismatch of and drops); both taken out."""
        if key is None or key not in self._parked:
            return None, None
        parked = self._parked.pop(key)
        if parked.matches(env_class, prompt, sampling_params):
            return parked, None
        return None, parked

    def take_stale(self, version: int, max_steps: int) -> list[Parked]:
        """Take out the rollouts parked more than ``max_steps`` policy versions before ``version``."""
        stale = [p for p in self._parked.values() if version - _oldest(p) > max_steps]
        for parked in stale:
            del self._parked[parked.key]
        return stale

    def take_all(self) -> list[Parked]:
        taken = list(self._parked.values())
        self._parked.clear()
        return taken


def _oldest(parked: Parked) -> int:
    first = parked.episode.first_version
    return parked.parked_at if first is None else first


class _FinishSession(Cleanup):
    """A dropped rollout's ``finish_session``, through the client of whoever drops it."""

    __slots__ = ("_client", "_session_id", "_stats")

    def __init__(self, client: InferenceClient, session_id: str, stats: CleanupStats) -> None:
        super().__init__()
        self._client = client
        self._session_id = session_id
        self._stats = stats

    def describe(self) -> str:
        return f"finish_session({self._session_id!r}) of a dropped parked rollout"

    def run(self) -> Awaitable[Any]:
        finishing: Awaitable[Any] = self._client.finish_session(self._session_id)
        return finishing

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        if outcome == "error":
            self._stats.finish_session_errors += 1
        elif outcome == "timeout":
            self._stats.finish_session_timeouts += 1


async def close_parked(parked: Sequence[Parked], stats: CleanupStats, client: InferenceClient) -> None:
    """Close each parked environment, then end its session, once: shielded (all of them, each close bounded
    by ``env_cleanup_timeout_s``), so a cancellation arriving meanwhile leaves none open."""
    with anyio.CancelScope(shield=True):
        for one in parked:
            async with one.env.adopt(stats, None, _FinishSession(client, one.session_id, stats)):
                pass


def close_parked_without_loop(lot: ParkingLot) -> None:
    """At interpreter exit or garbage collection: close what can be closed without an event loop.

    A synchronous env class (the thread executor's) gets its ``close()`` here; an env in a worker
    process or Ray actor goes with its worker (the executor stops them); an async env's close
    needs an event loop, so it is named in a warning (call ``await generator.aclose()``).
    """
    left = 0
    for parked in lot.take_all():
        try:
            if not parked.env.close_without_loop():
                left += 1
        except Exception as exc:  # at exit: log it and go on with the next one
            logger.warning("closing parked environment %r at exit failed: %r", parked.env_class, exc)
    if left:
        logger.warning(
            "%d parked environment(s) could not be closed without an event loop; call `await generator.aclose()` "
            "before the generator goes",
            left,
        )
