"""A pool of killable env workers (processes or Ray actors), and the one-shot replies their calls wait on.

A :class:`WorkerPool` holds at most ``max_env_workers`` workers, started on demand (or
``env_workers_warm`` ahead). Placement: a new env goes to a fresh worker while the pool is below its
bound and every worker already hosts one, otherwise to the worker hosting the fewest live envs. So
envs spread evenly, and a killed worker takes about ``live envs / workers`` of them with it (the
collateral-kill trade-off, docs/envs.md). A worker runs its calls one at a time, in order: the bound
on running env calls is the worker count, as with threads.

A :class:`Transport` is one worker seen from the generator; :mod:`~skyrl_structured.envs._process`
and :mod:`~skyrl_structured.envs._ray` implement it. A :class:`Reply` comes back on a transport's
own thread and wakes the event loop through the coalescing waker of
:mod:`~skyrl_structured._runtime.wakers`.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from .._runtime.cleanup import CleanupStats
from .._runtime.completion import Completion
from .._runtime.pauses import off_the_rollout_clock
from .._runtime.wakers import LoopWaker
from ._executors import EnvWorkerError
from ._worker import WorkerOp

__all__ = ["Reply", "Transport", "WorkerPool"]

logger = logging.getLogger(__name__)


class Reply(Completion[Any]):
    """One request's answer, set from any thread, awaited on the event loop (asyncio or trio)."""

    __slots__ = ("call_id", "what")

    def __init__(self, what: str, waker: LoopWaker | None) -> None:
        super().__init__(waker)
        #: The transport's id for the request (to skip it), once submitted.
        self.call_id: int = 0
        #: ``"step of 'env'"``: names the call in a worker's death message.
        self.what = what

    def resolve(self, ok: bool, value: Any) -> None:
        """Set the answer once (later calls are ignored): ``value``, or the error ``value`` when not ``ok``."""
        if ok:
            self.settle(value)
        else:
            self.settle(None, value)

    @property
    def ok(self) -> bool:
        """True once answered with a value (not an error)."""
        return self._done and self._error is None

    @property
    def value(self) -> Any:
        """The answer: the value, or the error (None before it is done)."""
        return self._value if self._error is None else self._error


class Transport(abc.ABC):
    """One worker as the generator sees it: requests in, replies out, and a way to kill it."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: Live envs placed on this worker (the placement's load), changed on the event loop only.
        self.load = 0
        #: Set once the worker is gone; every later request fails with it.
        self.death: EnvWorkerError | None = None
        self._killed = False
        self._crash_counted = False
        #: Resolved once the worker answers its first request (``ping``): started, or failed to start.
        self.ready: Reply | None = None
        #: Resolved once the worker has imported the generator's ``__main__`` (envs defined there), if asked.
        self.main_ready: Reply | None = None
        #: Over ``env_worker_max_rss_mb``: no new env goes here; it is stopped once it hosts none.
        self.retired = False
        #: Told once the worker is gone (from the transport's thread): the pool starts its replacement.
        self.on_death: Callable[[Transport], None] | None = None

    @property
    def dead(self) -> bool:
        return self.death is not None

    @property
    def usable(self) -> bool:
        """False once dead, being killed or retired: no new env is placed on it."""
        return self.death is None and not self._killed and not self.retired

    def environ(self) -> dict[str, str] | None:
        """The environment variables the worker takes at its start (None: its own, e.g. a Ray actor's)."""
        return None

    def start_trouble(self) -> str:
        """Why a start may be slow, for the start-timeout message ('' when nothing is known)."""
        return ""

    def rss_mb(self) -> float | None:
        """The worker's resident memory in MB, None where it cannot be read (Ray actors)."""
        return None

    @abc.abstractmethod
    def start(self) -> None:
        """Start the worker without blocking the event loop (requests may be submitted at once)."""

    @abc.abstractmethod
    def submit(self, op: WorkerOp, key: int, payload: Any, reply: Reply) -> None:
        """Queue one request; ``reply`` is resolved when it is answered or the worker dies."""

    def skip(self, reply: Reply) -> None:  # noqa: B027
        """Ask the worker not to start ``reply``'s request if it has not yet (best effort; a no-op here)."""

    @abc.abstractmethod
    def _terminate(self, reason: str) -> None:
        """Stop the worker now (SIGTERM then SIGKILL, or ``ray.kill``), non-blocking."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float) -> None:
        """Blocking: ask the worker to exit, wait up to ``timeout_s``, then kill it; free everything."""

    def kill(self, reason: str) -> bool:
        """Kill the worker because ``reason``; True for the first kill of a live worker (count it)."""
        if self._killed or self.dead:
            return False
        self._killed = True
        logger.warning("killing env worker %s: %s", self.name, reason)
        self._terminate(reason)
        return True

    def mourned(self) -> None:
        """Call once ``death`` is set, from the transport's own thread: the pool hears of it."""
        hook = self.on_death
        if hook is not None:
            try:
                hook(self)
            except Exception:  # pragma: no cover - a replacement that cannot start fails later, at its use
                logger.exception("replacing env worker %s failed", self.name)

    def claim_crash(self) -> bool:
        """True once for a worker that died on its own (the first env to see it counts the crash)."""
        if self._crash_counted or self._killed or self.death is None or self.death.killed:
            return False
        self._crash_counted = True
        return True


class WorkerPool:
    """At most ``size`` workers built by ``factory(index)``, started on demand, replaced when they die.

    ``warm`` workers are started ahead of need (:meth:`warm_up`). A worker that dies or is killed
    after it had started is replaced at once, in the background (:meth:`_replace`, from the
    transport's thread), whatever ``warm`` is: the pool had grown to that size, so the next batch
    finds its workers started instead of paying a start (always off the rollout's clock, but still
    the batch's wall time). A worker that has not answered its first request within
    ``start_timeout_s`` fails the rollouts waiting on it (and is not replaced ahead: a start that
    fails would only fail again); one whose memory passed ``max_rss_mb`` is recycled once it hosts
    no env. Placement, starts and replacements share one lock: the pool never exceeds ``size``.
    """

    def __init__(
        self,
        size: int,
        factory: Callable[[int], Transport],
        *,
        cleanup_timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        warm: int = 0,
        max_rss_mb: float | None = None,
    ) -> None:
        self.size = size
        #: Bounds the close of an env whose start was cancelled (the generator's env_cleanup_timeout_s).
        self.cleanup_timeout_s = cleanup_timeout_s
        self.start_timeout_s = start_timeout_s
        self.warm = min(max(warm, 0), size)
        self.max_rss_mb = max_rss_mb
        self._factory = factory
        self._workers: list[Transport] = []
        self._started = 0
        self._lock = threading.Lock()
        self.closed = False
        #: Set by the executor when an env class lives in ``__main__``: what a worker imports for it.
        self.main_spec: dict[str, str] | None = None
        #: The modules of the env classes seen so far: a worker imports them as part of its start.
        self.env_modules: set[str] = set()

    def place(self) -> Transport:
        """The worker for a new env (see the module docstring); starts one if the rule says so."""
        if self.closed:
            raise RuntimeError("the generator's env workers were shut down (aclose() was called)")
        with self._lock:
            live = self._warm_locked()
            if len(live) < self.size and (not live or min(w.load for w in live) > 0):
                live.append(self._start_one())
            worker = min(live, key=lambda w: w.load)
            worker.load += 1
        return worker

    def warm_up(self) -> None:
        """Start workers until ``warm`` are alive (non-blocking): at each generate()."""
        with self._lock:
            if not self.closed:
                self._warm_locked()

    def _warm_locked(self) -> list[Transport]:
        """Under the lock: the usable workers, topped up to ``warm``."""
        live = self._prune()
        for _ in range(self.warm - len(live)):
            live.append(self._start_one())
        return live

    def _replace(self, dead: Transport) -> None:
        """A worker is gone (the transport's thread): start its replacement now, ahead of need.

        Also for a recycled worker, once it has stopped. Not for a worker that never started (a
        failing start would fail again, in a loop) or a pool shut down.
        """
        ready = dead.ready
        if ready is None or not ready.ok:
            return
        with self._lock:
            if self.closed:
                return
            live = self._prune()
            if len(live) < self.size:
                self._start_one()
                logger.info("env worker %s is gone; started its replacement ahead of need", dead.name)

    def _prune(self) -> list[Transport]:
        live = [w for w in self._workers if w.usable]
        if len(live) != len(self._workers):
            self._workers = [w for w in self._workers if not w.dead and not (w.retired and w.load == 0)]
        return live

    def _start_one(self) -> Transport:
        """Under the lock: start one more worker (non-blocking)."""
        self._started += 1
        worker = self._factory(self._started)
        worker.ready = Reply(f"start of env worker {worker.name}", None)
        worker.on_death = self._replace
        worker.start()
        # Its first request: answered once it runs and has imported the env classes' modules (a start's
        # cost, not a rollout's: an env module may import torch).
        ping = {"environ": worker.environ(), "modules": sorted(self.env_modules)}
        worker.submit("ping", 0, ping, worker.ready)
        self._workers.append(worker)
        if math.isfinite(self.start_timeout_s):
            timer = threading.Timer(self.start_timeout_s, self._start_overdue, (worker,))
            timer.daemon = True
            timer.start()
        return worker

    def _start_overdue(self, worker: Transport) -> None:
        """Timer thread: a worker not started within ``start_timeout_s`` fails its waiting rollouts."""
        ready = worker.ready
        if ready is None or ready.done:
            return
        reason = (
            f"could not start: not ready after {self.start_timeout_s:g}s "
            f"(environment.skyrl_gym.env_worker_start_timeout_s){worker.start_trouble()}"
        )
        ready.resolve(False, EnvWorkerError(f"env worker {worker.name} {reason}", worker=worker.name, killed=True))
        worker.kill(reason)

    async def prepared(self, worker: Transport, *, needs_main: bool) -> None:
        """Wait until ``worker`` has started (and imported ``__main__`` if ``needs_main``), off the rollout's clock.

        Raises:
            EnvWorkerError: it could not start (or died starting).
        """
        replies = [worker.ready]
        if needs_main and self.main_spec is not None:
            if worker.main_ready is None:
                worker.main_ready = Reply(f"import of __main__ in env worker {worker.name}", None)
                worker.submit("main", 0, self.main_spec, worker.main_ready)
            replies.append(worker.main_ready)
        for reply in replies:
            if reply is None:
                continue
            if not reply.done:
                with off_the_rollout_clock():
                    await reply.wait()
            reply.result()

    def released(self, worker: Transport, stats: CleanupStats) -> None:
        """An env of ``worker`` is gone: recycle the worker if it is over ``max_rss_mb`` (once it hosts none)."""
        if self.max_rss_mb is None or worker.dead or worker._killed:
            return
        if not worker.retired:
            rss = worker.rss_mb()
            if rss is None or rss <= self.max_rss_mb:
                return
            worker.retired = True
            logger.info(
                "env worker %s uses %.0f MB (environment.skyrl_gym.env_worker_max_rss_mb=%g): recycling it "
                "once it hosts no env",
                worker.name,
                rss,
                self.max_rss_mb,
            )
        if worker.load > 0:
            return
        stats.env_workers_recycled += 1
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        # Its replacement starts once it has stopped (_replace), ahead of the next env.
        threading.Thread(
            target=worker.shutdown, args=(self.cleanup_timeout_s,), name=f"{worker.name}-recycle", daemon=True
        ).start()

    @property
    def workers(self) -> list[Transport]:
        """The workers started and not known dead."""
        return [w for w in self._workers if not w.dead]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Blocking: stop every worker (at ``aclose()``, garbage collection or interpreter exit)."""
        self.closed = True
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            try:
                worker.shutdown(timeout_s)
            except Exception:  # pragma: no cover - shutting down must never raise
                logger.exception("stopping env worker %s failed", worker.name)
