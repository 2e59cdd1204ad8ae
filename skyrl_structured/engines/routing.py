"""Session-sticky routing over several servers, with failover.

A rollout's turns share a prefix, so they should land on the server that already holds it in
its prefix cache: a session is assigned a server the first time it is seen (round robin over the
servers, so sessions spread evenly) and keeps it until ``release``. A server that could not be
reached is tried last for ``cooldown_s`` seconds, by new and existing sessions alike, and a
session that failed over stays on the server that answered.

Not thread-safe; it is used from one event loop, with no ``await`` inside any method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

__all__ = ["StickyRouter"]


class StickyRouter:
    """Which servers to try, in order, for a request of a given session.

    Args:
        urls: the servers, at least one.
        cooldown_s: how long a server that failed to connect is tried last.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self, urls: Sequence[str], *, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls: tuple[str, ...] = tuple(urls)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._sessions: dict[Hashable, int] = {}
        self._next = 0
        self._down_until: dict[int, float] = {}

    def _assign(self) -> int:
        index = self._next
        self._next = (self._next + 1) % len(self.urls)
        return index

    def candidates(self, session_id: Hashable | None) -> list[str]:
        """Servers to try in order: the session's own first (assigning one if new), reachable ones before down ones."""
        if session_id is None:
            start = self._assign()
        else:
            start = self._sessions.get(session_id, -1)
            if start < 0:
                start = self._sessions[session_id] = self._assign()
        order = [(start + k) % len(self.urls) for k in range(len(self.urls))]
        now = self._clock()
        up = [i for i in order if self._down_until.get(i, 0.0) <= now]
        down = [i for i in order if self._down_until.get(i, 0.0) > now]
        return [self.urls[i] for i in up + down]

    def succeeded(self, session_id: Hashable | None, url: str) -> None:
        """``url`` answered: it is up, and the session sticks to it."""
        index = self.urls.index(url)
        self._down_until.pop(index, None)
        if session_id is not None:
            self._sessions[session_id] = index

    def failed(self, url: str) -> None:
        """``url`` could not be reached: try it last for ``cooldown_s``."""
        self._down_until[self.urls.index(url)] = self._clock() + self.cooldown_s

    def server_of(self, session_id: Hashable) -> str | None:
        """The server a session is bound to, if any."""
        index = self._sessions.get(session_id)
        return None if index is None else self.urls[index]

    def release(self, session_id: Hashable) -> None:
        """Forget the session (its rollout finished)."""
        self._sessions.pop(session_id, None)

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)
