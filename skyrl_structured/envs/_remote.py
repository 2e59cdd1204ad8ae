"""Environments living in killable workers (processes or Ray actors), reached through async handles.

A :class:`WorkerPool` holds at most ``max_env_workers`` workers, started on demand. Placement: a new
env goes to a fresh worker while the pool is below its bound and every worker already hosts one,
otherwise to the worker hosting the fewest live envs. So envs spread evenly, and a killed worker
takes about ``live envs / workers`` of them with it (the collateral-kill trade-off, docs/envs.md).
A worker runs its calls one at a time, in order: the bound on running env calls is the worker count,
as with threads.

A :class:`WorkerEnv` is the env's handle in the generator: ``init``/``step``/``close`` are requests to
its worker, ``get_metrics`` reads what the worker sent with the last reply. The abandoned-work rules
are :mod:`~skyrl_structured.envs._executors`'s; here is how they apply:

- a call cancelled by a bound of its own that has passed (the rollout's ``rollout_timeout_s``, which
  the supervisor hands to the handle, or cleanup's ``env_cleanup_timeout_s``) while it runs kills
  the worker at once; the log line names that bound and its value;
- a call cancelled otherwise (``generate()`` cancelled, or a deadline of the caller's own scopes
  around it, a sibling's failure) is waited for by the env's close, inside cleanup's bound; the
  close follows it; past the bound the worker is killed;
- a dead worker fails every call of its envs with :class:`~skyrl_structured.EnvWorkerError`; their
  closes cannot run and are counted (``generate/envs_lost_with_worker``), as are the kill
  (``generate/env_workers_killed``, in the batch whose call overran) or the crash
  (``generate/env_worker_crashes``, in the batch that first saw it).

What crosses the boundary is pickled per call (:func:`~skyrl_structured.envs._worker.serve` in the
worker, :func:`decode` here): a value that cannot be pickled or unpickled fails its own call with
:class:`~skyrl_structured.EnvBoundaryError`, and the metrics sent with a reply fail only ``get_metrics``.

A :class:`Transport` is one worker seen from the generator; :mod:`~skyrl_structured.envs._process`
and :mod:`~skyrl_structured.envs._ray` implement it. Replies come back on a transport's own thread
and wake the event loop through the coalescing waker of :mod:`~skyrl_structured.envs._threads`.
"""

from __future__ import annotations

import abc
import asyncio
import io
import itertools
import logging
import math
import pickle
import threading
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

import anyio

from .._runtime.cleanup import CleanupStats
from .._runtime.pauses import PausableDeadline, off_the_rollout_clock
from .._runtime.wakers import LoopWaker, current_waker, resolve_future
from ..types import ConversationType, EnvStepOutput, SkyRLConfig
from ._executors import EnvBoundaryError, EnvWorkerError
from ._worker import Dumps, Uncrossed, culprit, one_line

__all__ = ["Reply", "Transport", "WorkerEnv", "WorkerPool", "decode", "encode_request"]

logger = logging.getLogger(__name__)

_keys = itertools.count(1)


class _NamingUnpickler(pickle.Unpickler):
    """Records the last class or function it looked up: what was being rebuilt when a load failed."""

    last = ""

    def find_class(self, module: str, name: str) -> Any:
        self.last = f"{module}.{name}"
        return super().find_class(module, name)


def _unpickle_failure(data: bytes) -> str:
    """Why ``data`` cannot be unpickled here, naming what was being rebuilt (run after a load failed)."""
    unpickler = _NamingUnpickler(io.BytesIO(data))
    try:
        unpickler.load()
    except BaseException as exc:
        where = f"rebuilding {unpickler.last}" if unpickler.last else "unpickling it"
        return f"{where} failed in the generator ({one_line(exc)})"
    return "unpickling it failed once in the generator, then worked"  # pragma: no cover - a flaky reconstructor


def _load(data: bytes, what: str, part: str) -> tuple[bool, Any]:
    """``data`` unpickled, or False and the :class:`EnvBoundaryError` saying why it cannot cross."""
    try:
        value = pickle.loads(data)
    except BaseException:  # whatever a reconstructor raises: this call's failure
        why = _unpickle_failure(data)
        return False, EnvBoundaryError(f"{_part(part, what)} could not cross to the generator: {why}{_FIX}")
    if isinstance(value, Uncrossed):
        if value.part == "argument":
            return False, EnvBoundaryError(
                f"the argument of {what} could not cross to its env worker: unpickling it there failed "
                f"({value.error}); pass plain values"
            )
        return False, EnvBoundaryError(
            f"{_part(value.part, what)} could not cross to the generator: {value.culprit} cannot be pickled "
            f"in the env worker ({value.error}){_FIX}"
        )
    return True, value


_FIX = "; return plain values (str, numbers, lists, dicts), or use env_executor='thread'"


def _part(part: str, what: str) -> str:
    if part == "metrics":
        return f"the metrics (get_metrics) sent with the reply to {what}"
    if part == "error":
        return f"the error raised by {what}"
    return f"the reply to {what}"


def decode(what: str, ok: bool, data: bytes, metrics: bytes | None) -> tuple[bool, Any]:
    """A worker's reply to ``what`` (``"`step` of env 'x'"``) as ``(ok, value)`` for :meth:`Reply.resolve`.

    ``init`` and ``step`` replies carry their env's metrics: the value is ``(result, (ok, metrics))``,
    and metrics that cannot cross fail only ``get_metrics``.
    """
    loaded, value = _load(data, what, "reply" if ok else "error")
    if not loaded:
        return False, value
    if metrics is None or not ok:
        return ok, value
    loaded, pair = _load(metrics, what, "metrics")
    return True, (value, pair if loaded else (False, pair))


def encode_request(what: str, payload: Any, pickle_it: Dumps) -> bytes | EnvBoundaryError:
    """``payload`` pickled for the worker, or the error that fails its call when it cannot be."""
    try:
        return pickle_it(payload)
    except BaseException as exc:  # whatever a __reduce__ raises: this call's failure
        return EnvBoundaryError(
            f"the argument of {what} could not cross to its env worker: {culprit(payload, pickle_it)} cannot be "
            f"pickled ({one_line(exc)}); pass plain values"
        )


class Reply:
    """One request's answer, set from any thread, awaited on the event loop (asyncio or trio)."""

    __slots__ = ("_callbacks", "_lock", "_waker", "call_id", "done", "ok", "value", "what")

    def __init__(self, what: str, waker: LoopWaker | None) -> None:
        #: The transport's id for the request (to skip it), once submitted.
        self.call_id: int = 0
        #: ``"step of 'env'"``: names the call in a worker's death message.
        self.what = what
        self.done = False
        self.ok = False
        self.value: Any = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._waker = waker

    def resolve(self, ok: bool, value: Any) -> None:
        """Set the answer once (later calls are ignored) and wake whoever waits for it."""
        with self._lock:
            if self.done:
                return
            self.ok, self.value, self.done = ok, value, True
            callbacks, self._callbacks = self._callbacks, []
        waker = self._waker
        for callback in callbacks:
            if waker is not None:
                try:
                    waker(callback)
                except Exception:  # pragma: no cover - the loop is gone: nobody waits
                    logger.debug("an env worker reply arrived after its event loop closed", exc_info=True)

    async def wait(self) -> None:
        """Wait for the answer; cancellation leaves the request alone (the caller decides)."""
        waker = self._waker if self._waker is not None else current_waker()
        self._waker = waker
        if waker.loop is not None:
            future: asyncio.Future[None] = waker.loop.create_future()
            if self._add(partial(resolve_future, future)):
                await future
            return
        event = waker.event_class()
        if self._add(event.set):
            await event.wait()

    def _add(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self.done:
                return False
            self._callbacks.append(callback)
            return True

    def result(self) -> Any:
        if not self.ok:
            raise self.value
        return self.value


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
    def submit(self, op: str, key: int, payload: Any, reply: Reply) -> None:
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

    def claim_crash(self) -> bool:
        """True once for a worker that died on its own (the first env to see it counts the crash)."""
        if self._crash_counted or self._killed or self.death is None or self.death.killed:
            return False
        self._crash_counted = True
        return True


class WorkerPool:
    """At most ``size`` workers built by ``factory(index)``, started on demand, replaced when they die.

    ``warm`` workers are started ahead of need (:meth:`warm_up`, and again whenever one has died); a
    worker that has not answered its first request within ``start_timeout_s`` fails the rollouts
    waiting on it; one whose memory passed ``max_rss_mb`` is recycled once it hosts no env.
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
        live = self._prune()
        if len(live) < self.warm:
            self.warm_up()
            live = [w for w in self._workers if w.usable]
        if len(live) < self.size and (not live or min(w.load for w in live) > 0):
            live.append(self._start_one())
        worker = min(live, key=lambda w: w.load)
        worker.load += 1
        return worker

    def warm_up(self) -> None:
        """Start workers until ``warm`` are alive (non-blocking): at each generate() and after a death."""
        if self.closed:
            return
        live = self._prune()
        for _ in range(self.warm - len(live)):
            self._start_one()

    def _prune(self) -> list[Transport]:
        live = [w for w in self._workers if w.usable]
        if len(live) != len(self._workers):
            self._workers = [w for w in self._workers if not w.dead and not (w.retired and w.load == 0)]
        return live

    def _start_one(self) -> Transport:
        self._started += 1
        worker = self._factory(self._started)
        worker.ready = Reply(f"start of env worker {worker.name}", None)
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
        threading.Thread(
            target=worker.shutdown, args=(self.cleanup_timeout_s,), name=f"{worker.name}-recycle", daemon=True
        ).start()
        self.warm_up()

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


class WorkerEnv:
    """One environment living in a worker: the async env protocol, over requests to that worker."""

    def __init__(
        self,
        pool: WorkerPool,
        env_class: str,
        recipe: Any,
        env_config: SkyRLConfig,
        extras: dict[str, Any],
        stats: CleanupStats,
        deadline: PausableDeadline | None = None,
    ) -> None:
        self.env_class = env_class
        #: The rollout's own ``rollout_timeout_s``: the only deadline a running call kills its worker for.
        self._deadline = deadline
        self._pool = pool
        self._make: Any = (recipe, env_config, extras)
        self._stats = stats
        self._key = next(_keys)
        self._worker: Transport | None = None
        self._waker: LoopWaker | None = None
        self._in_flight: Reply | None = None
        self._metrics: tuple[bool, Any] = (True, {})
        self._closed = False

    # ------------------------------------------------------------------ the async env protocol

    async def __aenter__(self) -> WorkerEnv:
        worker = self._worker = self._pool.place()
        try:
            # The worker's start is the pool's time, not the rollout's (env_worker_start_timeout_s bounds it).
            await self._pool.prepared(worker, needs_main=self._make[0][1].startswith("__main__:"))
        except BaseException as exc:
            self._release()
            if isinstance(exc, EnvWorkerError) and worker.claim_crash():
                self._stats.env_worker_crashes += 1
            raise
        reply = self._submit(worker, "make", self._make)
        try:
            await self._await(worker, reply, cleanup=False)
        except BaseException:
            if not worker.dead and (not reply.done or reply.ok):
                # Cancelled while (or just after) it was built: it exists, or will, so close it (requests
                # run in order), shielded and bounded as any cleanup.
                await self._close_unentered(worker)
            self._release()
            raise
        self._make = None
        if not reply.ok:
            self._release()
            error = reply.value
            if isinstance(error, EnvWorkerError) and worker.claim_crash():
                self._stats.env_worker_crashes += 1
            raise error
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        worker = self._worker
        if worker is None or self._closed:
            return
        try:
            pending = self._in_flight
            if pending is not None and not pending.done:
                # Cancelled mid-call: let it finish (bounded by cleanup's scope) so close never races it.
                await self._await(worker, pending, cleanup=True)
            if worker.dead:
                self._lost(worker)
                return
            reply = self._submit(worker, "close", None)
            await self._await(worker, reply, cleanup=True)
            if not reply.ok and isinstance(reply.value, EnvWorkerError):
                self._lost(worker)
                return
            reply.result()
        finally:
            self._release()

    async def _close_unentered(self, worker: Transport) -> None:
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._pool.cleanup_timeout_s
            close = self._submit(worker, "close", None)
            try:
                await self._await(worker, close, cleanup=True)
            except Exception as exc:  # pragma: no cover - the close failed: it is logged, like any close error
                logger.warning("closing environment %r after a cancelled start failed: %r", self.env_class, exc)
        if close.done and not close.ok and not isinstance(close.value, EnvWorkerError):
            logger.warning("closing environment %r after a cancelled start failed: %r", self.env_class, close.value)

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        result: tuple[ConversationType, dict[str, Any]] = await self._call("init", prompt)
        return result

    async def step(self, action: str) -> EnvStepOutput:
        result: EnvStepOutput = await self._call("step", action)
        return result

    def get_metrics(self) -> dict[str, Any]:
        ok, value = self._metrics
        if not ok:
            raise value
        metrics: dict[str, Any] = value
        return metrics

    # ------------------------------------------------------------------ requests

    def _submit(self, worker: Transport, op: str, payload: Any) -> Reply:
        if self._waker is None:
            self._waker = current_waker()
        reply = Reply(f"`{op}` of env {self.env_class!r}", self._waker)
        if worker.death is not None:
            reply.resolve(False, worker.death)
        else:
            worker.submit(op, self._key, payload, reply)
        return reply

    async def _call(self, op: str, payload: Any) -> Any:
        worker = self._worker
        assert worker is not None
        reply = self._submit(worker, op, payload)
        await self._await(worker, reply, cleanup=False)
        if not reply.ok:
            error = reply.value
            if isinstance(error, EnvWorkerError) and worker.claim_crash():
                self._stats.env_worker_crashes += 1
            raise error
        if op in ("init", "step"):
            value, self._metrics = reply.value
            return value
        return reply.value

    async def _await(self, worker: Transport, reply: Reply, *, cleanup: bool) -> None:
        """Wait for ``reply``; cancelled while it runs, kill the worker if a bound of its own has passed.

        Those bounds are cleanup's (``cleanup``: the close runs shielded, so only its deadline cancels
        it) and the rollout's own ``rollout_timeout_s``, when it passed while this call ran. Any other
        cancellation (the caller's deadline or cancel around ``generate()``) leaves the call to the
        env's close, which waits for it within ``env_cleanup_timeout_s``.
        """
        own = self._deadline
        expired_before = own is not None and own.expired  # sent after it passed: the close settles it
        try:
            await reply.wait()
        except BaseException:
            if not reply.done:
                why: str | None = None
                if cleanup:
                    why = f"env_cleanup_timeout_s={self._pool.cleanup_timeout_s:g}s"
                elif own is not None and not expired_before and own.expired:
                    why = f"its rollout's rollout_timeout_s={own.seconds:g}s"
                if why is not None:
                    if worker.kill(f"{reply.what} was still running past {why}"):
                        self._stats.env_workers_killed += 1
                else:
                    worker.skip(reply)  # not started yet: it never will; started: the close waits for it
                    self._in_flight = reply
            raise
        if reply is self._in_flight:
            self._in_flight = None

    def _lost(self, worker: Transport) -> None:
        """This env's close cannot run: its worker is gone. Counted, never silently dropped."""
        self._stats.envs_lost_with_worker += 1
        if worker.claim_crash():
            self._stats.env_worker_crashes += 1
        logger.warning("environment %r was lost with its worker: %s", self.env_class, worker.death)

    def _release(self) -> None:
        if not self._closed and self._worker is not None:
            self._closed = True
            self._worker.load -= 1
            self._pool.released(self._worker, self._stats)
