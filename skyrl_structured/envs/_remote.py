"""An environment living in a killable worker (a process or a Ray actor), reached through an async handle.

A :class:`WorkerEnv` is the env's handle in the generator: ``init``/``step``/``close`` are requests to
its worker (placed by the :class:`~skyrl_structured.envs._pool.WorkerPool`), ``get_metrics`` reads
what the worker sent with the last reply. The abandoned-work rules are
:mod:`~skyrl_structured.envs._executors`'s, and the close follows the one policy of
:mod:`~skyrl_structured.envs._abandon` with its :class:`~skyrl_structured.envs._abandon.KillWorker`
strategy; here is how they apply:

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

What crosses the boundary is pickled per call (:mod:`~skyrl_structured.envs._crossing`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable
from functools import partial
from types import TracebackType
from typing import Any

from .._runtime.cleanup import Cleanup, CleanupStats, run_cleanups
from .._runtime.pauses import PausableDeadline
from .._runtime.wakers import LoopWaker, current_waker
from ..observe import CleanupOutcome
from ..types import ConversationType, EnvStepOutput
from ._abandon import KillWorker, close_after_in_flight, kill_worker
from ._executors import EnvWorkerError
from ._pool import Reply, Transport, WorkerPool
from ._worker import MakePayload, WorkerOp

__all__ = ["WorkerEnv"]

logger = logging.getLogger(__name__)

_keys = itertools.count(1)


class WorkerEnv:
    """One environment living in a worker: the async env protocol, over requests to that worker."""

    def __init__(
        self,
        pool: WorkerPool,
        env_class: str,
        make: MakePayload,
        stats: CleanupStats,
        deadline: PausableDeadline | None = None,
    ) -> None:
        self.env_class = env_class
        #: The rollout's own ``rollout_timeout_s``: the only deadline a running call kills its worker for.
        self._deadline = deadline
        self._pool = pool
        #: Sent with the ``make`` request, then dropped (None) once the env exists.
        self._make: MakePayload | None = make
        self._stats = stats
        self._key = next(_keys)
        self._worker: Transport | None = None
        self._waker: LoopWaker | None = None
        self._in_flight: Reply | None = None
        self._metrics: tuple[bool, Any] = (True, {})
        self._closed = False

    def rebind(self, stats: CleanupStats, deadline: PausableDeadline | None) -> None:
        """A parked env adopted by a later rollout: its counters and its kill deadline are that rollout's."""
        self._stats = stats
        self._deadline = deadline

    # ------------------------------------------------------------------ the async env protocol

    async def __aenter__(self) -> WorkerEnv:
        make = self._make
        if make is None:
            raise RuntimeError(f"environment {self.env_class!r} in a worker is entered once only")
        worker = self._worker = self._pool.place()
        try:
            # The worker's start is the pool's time, not the rollout's (env_worker_start_timeout_s bounds it).
            await self._pool.prepared(worker, needs_main=make[0][1].startswith("__main__:"))
        except BaseException as exc:
            self._release()
            if isinstance(exc, EnvWorkerError) and worker.claim_crash():
                self._stats.env_worker_crashes += 1
            raise
        reply = self._submit(worker, "make", make)
        try:
            await self._await(worker, reply)
        except BaseException as exc:
            if not worker.dead and (not reply.done or reply.ok):
                # Cancelled while (or just after) it was built: it exists, or will, so close it (requests
                # run in order) as any cleanup: shielded and bounded by the cleanup engine.
                step = _UnenteredClose(self, worker)
                await run_cleanups([step], limit_s=self._pool.cleanup_timeout_s, error=exc)
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
            # Cancelled mid-call: the close waits for it (within cleanup's bound) so it never races it.
            await self.close_on(worker, self._in_flight)
        finally:
            self._release()

    async def close_on(self, worker: Transport, in_flight: Reply | None, *, entered: bool = True) -> None:
        """The env's close, after the call in flight, by the one abandoned-work policy (kill past the bound).

        A close that cannot run because the worker died is counted (``envs_lost_with_worker``) for an
        entered env; one whose start was cancelled was never the rollout's, so it is only dropped.
        """
        start = partial(self._start_close, worker, entered)
        reply = await close_after_in_flight(
            in_flight, KillWorker(worker, start, self._stats, self._pool.cleanup_timeout_s)
        )
        if reply is None:
            return
        if not reply.ok and isinstance(reply.value, EnvWorkerError):
            if entered:
                self._lost(worker)
            return
        reply.result()

    def _start_close(self, worker: Transport, entered: bool) -> Reply | None:
        if worker.dead:
            if entered:
                self._lost(worker)
            return None
        return self._submit(worker, "close", None)

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

    def _submit(self, worker: Transport, op: WorkerOp, payload: Any) -> Reply:
        if self._waker is None:
            self._waker = current_waker()
        reply = Reply(f"`{op}` of env {self.env_class!r}", self._waker)
        if worker.death is not None:
            reply.resolve(False, worker.death)
        else:
            worker.submit(op, self._key, payload, reply)
        return reply

    async def _call(self, op: WorkerOp, payload: Any) -> Any:
        worker = self._worker
        assert worker is not None
        reply = self._submit(worker, op, payload)
        await self._await(worker, reply)
        if not reply.ok:
            error = reply.value
            if isinstance(error, EnvWorkerError) and worker.claim_crash():
                self._stats.env_worker_crashes += 1
            raise error
        if op in ("init", "step"):
            value, self._metrics = reply.value
            return value
        return reply.value

    async def _await(self, worker: Transport, reply: Reply) -> None:
        """Wait for ``reply``; cancelled while it runs, kill the worker if its rollout's own deadline passed.

        That is the rollout's ``rollout_timeout_s``, when it passed while this call ran. Any other
        cancellation (the caller's deadline or cancel around ``generate()``) leaves the call to the
        env's close, which waits for it within ``env_cleanup_timeout_s`` (:mod:`._abandon`).
        """
        own = self._deadline
        expired_before = own is not None and own.expired  # sent after it passed: the close settles it
        try:
            await reply.wait()
        except BaseException:
            if not reply.done:
                if own is not None and not expired_before and own.expired:
                    kill_worker(worker, reply.what, f"its rollout's rollout_timeout_s={own.seconds:g}s", self._stats)
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


class _UnenteredClose(Cleanup):
    """The close of an env whose start was cancelled once it was built (or about to be), as a cleanup step."""

    __slots__ = ("_env", "_worker")

    def __init__(self, env: WorkerEnv, worker: Transport) -> None:
        super().__init__()
        self._env = env
        self._worker = worker

    def describe(self) -> str:
        return f"closing environment {self._env.env_class!r} after a cancelled start"

    def run(self) -> Awaitable[None]:
        return self._env.close_on(self._worker, None, entered=False)

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        """Logged by the engine; not counted (the env was never entered, so never opened for the rollout)."""
