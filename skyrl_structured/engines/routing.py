"""Which server a session's requests go to: group-affine and least-loaded, or round robin; with failover.

A rollout's turns share a prefix, so they should land on the server that already holds it in its
prefix cache: a session is assigned a server the first time it is seen and keeps it until
``release``. Two policies choose that server (``HTTPEngine(routing=...)``, ``engine.routing``):

``group_least_loaded`` (:class:`GroupRouter`, the default; design rule 26)
    The sessions of one prompt group (the n samples of a GRPO prompt, which start from the same
    prompt) go to the server the group already uses, so the group's prompt is prefilled once per
    server that serves it, unless that server is past its load bound (its last ``/metrics``
    reading shows requests waiting, or its KV cache at least :data:`KV_BOUND` full): then to
    another server the group uses that is not, else to the least-loaded one, which the group then
    uses too. A new group goes to the least-loaded server. A server's load is the requests at it
    in its last reading (``running + waiting``) plus the sessions placed on it since that reading,
    so that a burst of new sessions between two readings spreads instead of piling onto the server
    that read lightest; a server with no reading (no ``/metrics``, or it could not be read) counts
    its open sessions instead. Ties go round robin. A group's servers are remembered after its
    sessions end (its prompt may still be cached there), the :data:`GROUPS_KEPT` most recent groups.
``round_robin`` (:class:`StickyRouter`)
    A new session takes the next server in turn, whatever its group or load.

Failover is the same under both: a server that could not be reached is tried last for
``cooldown_s`` seconds by new and existing sessions alike, a session that failed over stays on the
server that answered, and an existing session never moves otherwise (its history is cached where
it is). A server that is read again (:meth:`observe`) or answers is up again at once, and takes new
groups again as its load says.

A session's group comes from its id (:func:`session_group`: the generator names a rollout's session
``"<instance_id>_<repetition_id>"``; an agent's capture session appends ``"~<token>"``); the
caller may pass another (``HTTPEngine`` falls back to the session's first prompt).

Not thread-safe; it is used from one event loop, with no ``await`` inside any method.
:meth:`routes` may be read from another thread (a metrics scrape): it copies before it reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from .load import EngineLoad

__all__ = [
    "GROUPS_KEPT",
    "KV_BOUND",
    "ROUTING_POLICIES",
    "GroupRouter",
    "Router",
    "RoutingPolicy",
    "ServerRoute",
    "StickyRouter",
    "check_routing",
    "make_router",
    "session_group",
]

#: The routing policies, the default first.
RoutingPolicy = Literal["group_least_loaded", "round_robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("group_least_loaded", "round_robin")

#: A server whose last reading shows its KV cache at least this full is past its load bound.
KV_BOUND = 0.9

#: How many prompt groups' servers are remembered (the most recently placed).
GROUPS_KEPT = 65_536

#: How many placements since a server's last reading are counted, at most.
_PLACED_KEPT = 65_536


def check_routing(policy: object, *, name: str = "routing") -> RoutingPolicy:
    """``policy`` if it is one of :data:`ROUTING_POLICIES`.

    Raises:
        ValueError: it is not (one line naming the choices).
    """
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"{name} must be one of {', '.join(ROUTING_POLICIES)}; got {policy!r}")
    return policy


def session_group(session_id: Hashable | None) -> str | None:
    """The prompt group a session id names, or None when it names none.

    ``"<instance_id>_<repetition_id>"`` (the generator's session of a rollout with a trajectory id;
    the repetition is digits) names ``instance_id``; an alphanumeric ``"~<token>"`` after it (an
    agent's capture session) is ignored. Anything else (a uuid, an id without that form) names none.
    """
    if not isinstance(session_id, str):
        return None
    text = session_id
    head, tilde, tail = text.rpartition("~")
    if tilde and head and tail.isalnum():
        text = head
    base, underscore, repetition = text.rpartition("_")
    if underscore and base and repetition.isdigit():
        return base
    return None


@dataclass(frozen=True, slots=True)
class ServerRoute:
    """What the router knows of one server now (:meth:`Router.routes`)."""

    server: str
    #: Not in its failover cooldown.
    up: bool
    #: Sessions bound to it now.
    sessions: int
    #: Prompt groups that use it (remembered ones; ``round_robin`` keeps none).
    groups: int
    #: Sessions placed on it so far (a session that failed over to it counts again).
    placed_total: int
    #: What placement compares: requests at it in its last reading plus sessions placed since, or
    #: its open sessions when ``read`` is False.
    load: float
    #: Whether ``load`` comes from a ``/metrics`` reading.
    read: bool
    #: Past its load bound (requests waiting, or its KV cache at least ``KV_BOUND`` full).
    past_bound: bool


class Router:
    """Sticky sessions and failover over ``urls``; a subclass says where a new session goes (:meth:`_place`).

    Args:
        urls: the servers, at least one.
        cooldown_s: how long a server that failed to connect is tried last.
        clock: seconds, monotonic, the clock of the readings' ``at`` (injectable for tests).
    """

    policy: RoutingPolicy

    def __init__(
        self, urls: Sequence[str], *, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls: tuple[str, ...] = tuple(urls)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._index = {url: i for i, url in enumerate(self.urls)}
        self._sessions: dict[Hashable, int] = {}
        self._down_until: dict[int, float] = {}
        self._open = [0] * len(self.urls)
        self._placed_total = [0] * len(self.urls)
        #: When each session placed on a server since its last reading was placed.
        #: (Bounded: a client whose load is never read again keeps no more than that.)
        self._placed_since: list[deque[float]] = [deque(maxlen=_PLACED_KEPT) for _ in self.urls]
        self._readings: list[EngineLoad | None] = [None] * len(self.urls)
        self._next = 0

    # ------------------------------------------------------------------ what a subclass decides

    def _place(self, group: Hashable | None, up: list[int]) -> int:
        raise NotImplementedError

    def _fallbacks(self, start: int) -> list[int]:
        """The servers to fail over to from ``start``, in order: the least loaded first."""
        return sorted((i for i in range(len(self.urls)) if i != start), key=self.load_of)

    def _groups_on(self) -> list[int]:
        return [0] * len(self.urls)

    # ------------------------------------------------------------------ load

    def _is_down(self, index: int, now: float) -> bool:
        return self._down_until.get(index, 0.0) > now

    def load_of(self, index: int) -> float:
        """Server ``index``'s load as placement compares it (see the module's docstring)."""
        reading = self._readings[index]
        if reading is None:
            return float(self._open[index])
        return float(reading.requests_running + reading.requests_waiting + len(self._placed_since[index]))

    def past_bound(self, index: int) -> bool:
        """Whether server ``index``'s last reading shows it past its load bound (never, without a reading)."""
        reading = self._readings[index]
        return reading is not None and (reading.requests_waiting > 0 or reading.kv_cache_usage >= KV_BOUND)

    def _least_loaded(self, among: Sequence[int]) -> int:
        """The least-loaded of ``among``; ties go to the next in round robin order."""
        n = len(self.urls)
        best = min(among, key=lambda i: (self.load_of(i), (i - self._next) % n))
        self._next = (best + 1) % n
        return best

    def observe(self, readings: Sequence[EngineLoad]) -> None:
        """A new reading of the servers' load (one per server read; a server left out has none now).

        Sessions placed on a server before its reading was taken are in it; a server read is up.
        """
        fresh: list[EngineLoad | None] = [None] * len(self.urls)
        for reading in readings:
            index = self._index.get(reading.server)
            if index is not None:
                fresh[index] = reading
        for index, new in enumerate(fresh):
            self._readings[index] = new
            placed = self._placed_since[index]
            if new is None:
                placed.clear()  # no reading: its load is its open sessions, which count these
                continue
            self._down_until.pop(index, None)  # it answered: it is back
            while placed and placed[0] <= new.at:
                placed.popleft()

    # ------------------------------------------------------------------ sessions

    def is_placed(self, session_id: Hashable | None) -> bool:
        """Whether a request of ``session_id`` goes where the session already is (no placement to decide)."""
        return session_id is not None and session_id in self._sessions

    def _bind(self, session_id: Hashable, index: int) -> None:
        before = self._sessions.get(session_id)
        if before == index:
            return
        if before is not None:
            self._open[before] -= 1
        self._sessions[session_id] = index
        self._open[index] += 1
        self._count_placement(index)

    def _count_placement(self, index: int) -> None:
        self._placed_total[index] += 1
        if self._readings[index] is not None:
            self._placed_since[index].append(self._clock())

    def candidates(self, session_id: Hashable | None, group: Hashable | None = None) -> list[str]:
        """Servers to try in order: the session's own first (placing it if new), reachable ones before down ones.

        ``group`` is the session's prompt group (used only when placing it).
        """
        now = self._clock()
        start = self._sessions.get(session_id, -1) if session_id is not None else -1
        if start < 0:
            up = [i for i in range(len(self.urls)) if not self._is_down(i, now)]
            start = self._place(group, up or list(range(len(self.urls))))
            if session_id is not None:
                self._bind(session_id, start)
            else:
                self._count_placement(start)
        order = [start, *self._fallbacks(start)]
        return [self.urls[i] for i in order if not self._is_down(i, now)] + [
            self.urls[i] for i in order if self._is_down(i, now)
        ]

    def succeeded(self, session_id: Hashable | None, url: str, group: Hashable | None = None) -> None:
        """``url`` answered: it is up, and the session (and its group) sticks to it."""
        index = self._index[url]
        self._down_until.pop(index, None)
        if session_id is not None:
            self._bind(session_id, index)

    def failed(self, url: str) -> None:
        """``url`` could not be reached: try it last for ``cooldown_s``."""
        self._down_until[self._index[url]] = self._clock() + self.cooldown_s

    def server_of(self, session_id: Hashable) -> str | None:
        """The server a session is bound to, if any."""
        index = self._sessions.get(session_id)
        return None if index is None else self.urls[index]

    def release(self, session_id: Hashable) -> None:
        """Forget the session (its rollout finished)."""
        index = self._sessions.pop(session_id, None)
        if index is not None:
            self._open[index] -= 1

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def routes(self) -> list[ServerRoute]:
        """Each server's sessions, groups and load now, in ``urls`` order."""
        now = self._clock()
        groups = self._groups_on()
        return [
            ServerRoute(
                server=url,
                up=not self._is_down(i, now),
                sessions=self._open[i],
                groups=groups[i],
                placed_total=self._placed_total[i],
                load=self.load_of(i),
                read=self._readings[i] is not None,
                past_bound=self.past_bound(i),
            )
            for i, url in enumerate(self.urls)
        ]


class StickyRouter(Router):
    """``round_robin``: a new session takes the next server in turn (reachable ones first)."""

    policy: RoutingPolicy = "round_robin"

    def _place(self, group: Hashable | None, up: list[int]) -> int:
        index = self._next
        self._next = (self._next + 1) % len(self.urls)
        return index

    def _fallbacks(self, start: int) -> list[int]:
        n = len(self.urls)
        return [(start + k) % n for k in range(1, n)]


class GroupRouter(Router):
    """``group_least_loaded``: a group's sessions where the group is, new groups on the least-loaded server."""

    policy: RoutingPolicy = "group_least_loaded"

    def __init__(
        self, urls: Sequence[str], *, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(urls, cooldown_s=cooldown_s, clock=clock)
        #: Each remembered group's servers, in the order it took them; least recently placed first.
        self._groups: OrderedDict[Hashable, list[int]] = OrderedDict()

    def _place(self, group: Hashable | None, up: list[int]) -> int:
        room = [i for i in up if not self.past_bound(i)]
        if group is None:
            return self._least_loaded(room or up)
        servers = self._groups.get(group)
        if servers is None:
            servers = self._groups[group] = []
            while len(self._groups) > GROUPS_KEPT:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        home = next((i for i in servers if i in room), None)
        if home is None and not room:  # every server is past its bound: stay where the prompt is
            home = next((i for i in servers if i in up), None)
        if home is None:
            home = self._least_loaded(room or up)
            servers.append(home)
        return home

    def succeeded(self, session_id: Hashable | None, url: str, group: Hashable | None = None) -> None:
        index = self._index[url]
        placed = self._sessions.get(session_id) if session_id is not None else None
        super().succeeded(session_id, url, group)
        servers = self._groups.get(group) if group is not None else None
        if servers is None or placed is None or placed == index:
            return
        # It failed over: the group's prompt is cached where it answered, not where it was placed.
        if placed in servers:
            servers.remove(placed)
        if index not in servers:
            servers.append(index)

    def _groups_on(self) -> list[int]:
        counts = [0] * len(self.urls)
        for servers in list(self._groups.values()):
            for index in list(servers):
                counts[index] += 1
        return counts

    def servers_of_group(self, group: Hashable) -> list[str]:
        """The servers a group uses, in the order it took them (empty: unknown or forgotten)."""
        return [self.urls[i] for i in self._groups.get(group, [])]


def make_router(
    policy: RoutingPolicy, urls: Sequence[str], *, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
) -> Router:
    """The router of ``policy`` over ``urls``."""
    cls: type[Router] = GroupRouter if check_routing(policy) == "group_least_loaded" else StickyRouter
    return cls(urls, cooldown_s=cooldown_s, clock=clock)
