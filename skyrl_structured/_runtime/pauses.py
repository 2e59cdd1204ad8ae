"""Deadlines that stop while the generator is paused (a weight sync), on asyncio and trio alike.

A :class:`PauseClock` counts pauses: :meth:`~PauseClock.pause` and :meth:`~PauseClock.resume` nest,
so two overlapping pausers (a weight sync and a user's own pause) each hold the clock until they
resume, and the clock runs again only when the last one has. A :class:`PausableDeadline` is a
cancel scope registered with a clock: when the clock stops, the scope's deadline is set to
infinity and its remaining budget kept; when the clock runs again, the deadline is set to now plus
that remainder. So a deadline measures work, not the pause (docs/failures.md, "Pauses: weight
syncs do not count"), without an extra task per deadline. Nothing else is stopped: environment
and engine calls in flight go on.

A pause that is never resumed would leave every deadline stopped for good. :meth:`PauseClock.watch`
(the supervisor runs it while a batch runs) logs a WARNING once a pause has lasted
``warn_after_s``, once per pause.

The clock and its deadlines belong to the event loop's thread: call ``pause``/``resume`` from it
(``anyio.from_thread.run_sync`` from another thread). The supervisor makes its generator's clock
the current one for the rollouts of a batch (:func:`current_clock`), which is how an engine
(``HTTPEngine``) finds it for its own request timeout.
"""

from __future__ import annotations

import logging
import math
import time
from contextvars import ContextVar, Token
from types import TracebackType

import anyio

__all__ = [
    "Pausable",
    "PausableDeadline",
    "PauseClock",
    "PausedBlock",
    "current_clock",
    "off_the_rollout_clock",
    "use_clock",
    "use_rollout_deadline",
]

logger = logging.getLogger(__name__)

#: The default of :attr:`PauseClock.warn_after_s`: longer than a large model's weight sync takes.
DEFAULT_WARN_AFTER_S = 600.0


class PauseClock:
    """A count of pauses and the deadlines that stop while it is above zero.

    Args:
        warn_after_s: how long one pause may last before :meth:`watch` logs a WARNING.
    """

    def __init__(self, *, warn_after_s: float = DEFAULT_WARN_AFTER_S) -> None:
        self.warn_after_s = warn_after_s
        self._depth = 0
        self._deadlines: set[PausableDeadline] = set()
        #: Pause number (1, 2, ...) and when the current one began (``time.monotonic``, and the event
        #: loop's clock where one runs: :meth:`watch` waits on that clock, which a test may mock).
        self._pauses = 0
        self._since: float | None = None
        self._since_on_loop: float | None = None
        self._warned = 0
        #: Events set on every change (pause or resume), for :meth:`watch`.
        self._watchers: set[anyio.Event] = set()

    @property
    def paused(self) -> bool:
        """Whether at least one pause is held."""
        return self._depth > 0

    @property
    def depth(self) -> int:
        """How many pauses are held (nested or overlapping)."""
        return self._depth

    def pause(self) -> None:
        """Stop the clock, or hold it stopped one more time (pauses nest)."""
        self._depth += 1
        if self._depth > 1:
            return
        self._pauses += 1
        self._since = time.monotonic()
        self._since_on_loop = _loop_time()
        if self._deadlines:
            now = anyio.current_time()
            for deadline in self._deadlines:
                deadline.stop(now)
        self._changed()

    def resume(self) -> None:
        """Release one pause; the clock runs again once every pause is released.

        Raises:
            RuntimeError: no pause is held (a ``resume`` without its ``pause``).
        """
        if self._depth == 0:
            raise RuntimeError("resume() without a matching pause(): the generator is not paused")
        self._depth -= 1
        if self._depth > 0:
            return
        self._since = self._since_on_loop = None
        if self._deadlines:
            now = anyio.current_time()
            for deadline in self._deadlines:
                deadline.start(now)
        self._changed()

    def paused_for(self) -> float:
        """Seconds the current pause has lasted (0.0 when running)."""
        return 0.0 if self._since is None else time.monotonic() - self._since

    def _paused_on_loop(self) -> float:
        """:meth:`paused_for` on the event loop's clock (the one :meth:`watch` sleeps on)."""
        if self._since_on_loop is None:  # paused from outside any event loop: real time
            return self.paused_for()
        return anyio.current_time() - self._since_on_loop

    def deadline(self, seconds: float | None) -> PausableDeadline:
        """A cancel scope that is cancelled once ``seconds`` of unpaused time have passed (None: never)."""
        return PausableDeadline(self, seconds)

    async def sleep(self, seconds: float) -> None:
        """Sleep for ``seconds`` of unpaused time."""
        with self.deadline(seconds):
            await anyio.sleep_forever()

    def _changed(self) -> None:
        for event in self._watchers:
            event.set()
        self._watchers.clear()

    async def watch(self) -> None:
        """Run until cancelled; log a WARNING when a pause outlasts :attr:`warn_after_s` (once per pause)."""
        while True:
            changed = anyio.Event()
            self._watchers.add(changed)
            try:
                if not self.paused or self._warned == self._pauses:
                    await changed.wait()
                    continue
                with anyio.move_on_after(max(self.warn_after_s - self._paused_on_loop(), 0.0)):
                    await changed.wait()
                    continue
            finally:
                self._watchers.discard(changed)
            if self.paused and self._warned != self._pauses:
                self._warned = self._pauses
                logger.warning(
                    "the generator has been paused for %.0fs (%d pause(s) held) and not resumed: rollout deadlines, "
                    "HTTPEngine request timeouts and the straggler grace stay stopped until resume() is called "
                    "as often as pause() was",
                    self._paused_on_loop(),
                    self._depth,
                )


def _loop_time() -> float | None:
    """The running event loop's clock, or None outside one (``pause()`` from a synchronous caller)."""
    try:
        return anyio.current_time()
    except RuntimeError:  # sniffio: no async library is running here
        return None


class PausedBlock:
    """``async with generator.paused():``: one pause of ``clock`` held for the block."""

    __slots__ = ("_clock",)

    def __init__(self, clock: PauseClock) -> None:
        self._clock = clock

    async def __aenter__(self) -> None:
        self._clock.pause()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._clock.resume()


class Pausable:
    """A generator's pause methods over its :class:`PauseClock`, ``pauses`` (one home for every generator).

    SkyRL's weight-sync hook (``integrations/_weight_sync.py``) and users call them around a sync.
    """

    pauses: PauseClock

    def pause(self) -> None:
        """Stop the clocks of ``rollout_timeout_s``, ``HTTPEngine``'s request timeout and the straggler grace.

        Rollouts keep running (env, agent and engine calls in flight go on); only their deadlines
        stop. Pauses nest: the clocks run again once :meth:`resume` has been called as often. Call it
        from the event loop's thread.
        """
        self.pauses.pause()

    def resume(self) -> None:
        """Release one :meth:`pause`.

        Raises:
            RuntimeError: the generator is not paused.
        """
        self.pauses.resume()

    def paused(self) -> PausedBlock:
        """``async with generator.paused():`` holds one pause for the block."""
        return PausedBlock(self.pauses)


class PausableDeadline:
    """``with clock.deadline(s) as scope:`` an anyio cancel scope whose deadline skips the clock's pauses.

    After the block, ``scope.cancelled_caught`` says whether the deadline cut it short.
    ``clock=None`` makes it a plain deadline.
    """

    __slots__ = ("_clock", "_holds", "_remaining", "_seconds", "scope")

    def __init__(self, clock: PauseClock | None, seconds: float | None) -> None:
        self._clock = clock
        self._seconds = math.inf if seconds is None else float(seconds)
        #: Budget left while the clock is stopped; None while it runs.
        self._remaining: float | None = None
        #: Holds of this deadline alone (:meth:`hold`): it stays stopped while any is held.
        self._holds = 0
        self.scope = anyio.CancelScope()

    @property
    def seconds(self) -> float:
        """The budget, in seconds of unpaused time (``inf``: none)."""
        return self._seconds

    @property
    def expired(self) -> bool:
        """Whether the budget has run out (the scope is cancelled, or is about to be at its next check).

        Read by whoever must tell this deadline apart from a cancellation by some other scope (an env
        worker is killed for its rollout's own ``rollout_timeout_s``, never for a caller's deadline).
        """
        if self.scope.cancel_called:
            return True
        return self._remaining is None and anyio.current_time() >= self.scope.deadline

    def stop(self, now: float) -> None:
        if self._remaining is None:
            self._remaining = max(self.scope.deadline - now, 0.0)
            self.scope.deadline = math.inf

    def start(self, now: float) -> None:
        if self._remaining is not None and not self._holds:
            remaining, self._remaining = self._remaining, None
            self.scope.deadline = now + remaining

    def hold(self) -> None:
        """Stop this deadline alone (nests), e.g. while its rollout waits for the pool's worker to start."""
        self._holds += 1
        if self._holds == 1:
            self.stop(anyio.current_time())

    def release(self) -> None:
        """Release one :meth:`hold`; the deadline runs again once none is held and the clock runs."""
        self._holds -= 1
        if not self._holds and not (self._clock is not None and self._clock.paused):
            self.start(anyio.current_time())

    def __enter__(self) -> anyio.CancelScope:
        clock = self._clock
        if clock is not None and clock.paused:
            self._remaining = self._seconds
        else:
            self.scope.deadline = anyio.current_time() + self._seconds
        if clock is not None:
            clock._deadlines.add(self)
        return self.scope.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._clock is not None:
            self._clock._deadlines.discard(self)
        return bool(self.scope.__exit__(exc_type, exc, tb))


_CURRENT: ContextVar[PauseClock | None] = ContextVar("skyrl_structured_pause_clock", default=None)


def current_clock() -> PauseClock | None:
    """The pause clock of the generator whose rollout is running here, if any."""
    return _CURRENT.get()


class _UsingClock:
    """``with use_clock(clock):`` (a class: an exception leaving the block is not thrown into a generator)."""

    __slots__ = ("_clock", "_token")

    def __init__(self, clock: PauseClock | None) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        self._token: Token[PauseClock | None] = _CURRENT.set(self._clock)

    def __exit__(self, *exc_info: object) -> None:
        _CURRENT.reset(self._token)


def use_clock(clock: PauseClock | None) -> _UsingClock:
    """Make ``clock`` the :func:`current_clock` for the block (and the tasks started in it)."""
    return _UsingClock(clock)


_ROLLOUT: ContextVar[PausableDeadline | None] = ContextVar("skyrl_structured_rollout_deadline", default=None)


def use_rollout_deadline(deadline: PausableDeadline) -> _UsingRolloutDeadline:
    """Make ``deadline`` the one :func:`off_the_rollout_clock` stops, for the block (the rollout's task)."""
    return _UsingRolloutDeadline(deadline)


class _UsingRolloutDeadline:
    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: PausableDeadline) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token: Token[PausableDeadline | None] = _ROLLOUT.set(self._deadline)

    def __exit__(self, *exc_info: object) -> None:
        _ROLLOUT.reset(self._token)


def off_the_rollout_clock() -> _OffTheClock:
    """Time spent in the block does not count against the current rollout's ``rollout_timeout_s``.

    For waits that are the generator's, not the rollout's: an env worker process or Ray actor still
    starting (``env_worker_start_timeout_s`` bounds those). Other scopes (a caller's deadline) still apply.
    """
    return _OffTheClock()


class _OffTheClock:
    __slots__ = ("_deadline",)

    def __enter__(self) -> None:
        self._deadline = _ROLLOUT.get()
        if self._deadline is not None:
            self._deadline.hold()

    def __exit__(self, *exc_info: object) -> None:
        if self._deadline is not None:
            self._deadline.release()
