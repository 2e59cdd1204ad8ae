"""The trainer's side of sessions served by endpoint worker processes (:mod:`._workers`).

A :class:`Attachment` is one :func:`~._serve.serve_capture` block on a pool (``generate()``'s, or
``serving()``'s): the task group the trainer's engine calls run in, and the event loop the workers'
frames are handed to. :func:`pooled_session` is :meth:`~._server.CaptureServer.session` on a pool:
the session is placed on a worker, opened there before it is yielded (``open``, awaited ``opened``),
and closed exactly once however it ends: its engine calls cancelled (their requests answer 499),
then ``close`` and an awaited ``closed`` carrying what the worker captured, from which the rows are
built as in-loop. Each ``call`` frame runs :meth:`~._server.CaptureServer.engine_sample`, the
in-loop endpoint's own engine call (seeds, pause clock, observers), in a scope the session's close
or the worker's ``cancel`` cancels. A worker's death fails its sessions' rollouts with
:class:`~skyrl_structured.errors.CaptureWorkerError`. The attachment's :class:`~._readings.WorkersWatch`
tells the observers of the calls it serves how its workers fare.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from .._runtime.cleanup import run_cleanups
from .._runtime.contexts import RolloutContext
from .._runtime.sessions import SessionEnd
from .._runtime.wakers import current_waker
from ..errors import CaptureWorkerError
from ..observe import RolloutObserver
from ._capture import Capture, restore_capture
from ._frames import Frame, error_fields
from ._readings import WorkersWatch
from ._routes import closed_in_flight
from ._session import CaptureSession
from ._wire import APIError

if TYPE_CHECKING:
    from ._server import CaptureServer
    from ._worker_link import CaptureWorker
    from ._workers import CaptureWorkers

__all__ = ["Attachment", "pooled_session"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    """An open pooled session: where its worker's frames for it go."""

    session: CaptureSession
    attachment: Attachment

    def lose(self, error: CaptureWorkerError) -> None:
        """Its worker died (from the worker's reader thread): fail the session's rollout on its loop."""
        self.attachment.hand(lambda: self.session.lose(error))


class Attachment:
    """A ``serve_capture`` block on a pool: runs the workers' engine calls for its sessions (see the module)."""

    def __init__(self, server: CaptureServer, pool: CaptureWorkers, group: anyio.abc.TaskGroup) -> None:
        self.server = server
        self.pool = pool
        self._group = group
        self._waker = current_waker()
        #: Calls handed to the loop, started by :meth:`dispatch` (a task of the group) as they come.
        self._inbox: list[tuple[CaptureWorker, CaptureSession, Frame]] = []
        self._event = anyio.Event()
        #: The engine calls running, by (worker, call id): a ``cancel`` frame cancels one.
        self._calls: dict[tuple[CaptureWorker, int], anyio.CancelScope] = {}
        self.closed = False
        pool.deliver = deliver
        #: What the ``generate()`` calls served here hear of the workers (``endpoint_workers_read``).
        self.watch = WorkersWatch(pool, self.hand)

    def hand(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on this attachment's loop soon (from any thread)."""
        self._waker(callback)

    def _call(self, worker: CaptureWorker, session: CaptureSession, frame: Frame) -> None:
        if self.closed:
            return
        _running[(worker, frame[1])] = self
        self._inbox.append((worker, session, frame))
        self._event.set()

    async def dispatch(self) -> None:
        """Start each call handed to this loop in the attachment's task group (until the group is cancelled)."""
        while True:
            await self._event.wait()
            self._event = anyio.Event()
            calls, self._inbox = self._inbox, []
            for worker, session, frame in calls:
                self._group.start_soon(self._serve_call, worker, session, frame)

    def _cancel(self, worker: CaptureWorker, call_id: int) -> None:
        scope = self._calls.get((worker, call_id))
        if scope is not None:
            scope.cancel()

    async def _serve_call(self, worker: CaptureWorker, session: CaptureSession, frame: Frame) -> None:
        """Run one ``call`` frame's engine call; whatever ends it, the worker gets its ``reply`` or ``fail``."""
        _, call_id, _key, prompt_ids, params, prompt_param = frame
        answer: Frame | None = None
        try:
            with anyio.CancelScope() as scope:
                self._calls[(worker, call_id)] = scope
                try:
                    text, sampled, stop, logprobs = await self.server.engine_sample(
                        session, prompt_ids, params, prompt_param
                    )
                    answer = ("reply", call_id, text, sampled, stop, logprobs)
                except APIError as error:
                    answer = ("fail", call_id, error_fields(error))
                except Exception as exc:
                    logger.exception("capture endpoint: a call of rollout %s failed in the trainer", session.rollout)
                    failure = APIError(500, f"the capture endpoint failed: {type(exc).__name__}: {exc}")
                    answer = ("fail", call_id, error_fields(failure))
        finally:
            self._calls.pop((worker, call_id), None)
            _running.pop((worker, call_id), None)
            if answer is None:  # cancelled: by its client (a ``cancel`` frame), or with the rollout
                answer = ("fail", call_id, error_fields(_cancelled(session)))
            worker.post(answer)


def _cancelled(session: CaptureSession) -> APIError:
    if session.closed:
        return closed_in_flight(session)
    return APIError(
        499,
        f"rollout {session.rollout} was cancelled while this request was in flight; the engine request was cancelled",
    )


@asynccontextmanager
async def attached(server: CaptureServer, pool: CaptureWorkers) -> AsyncIterator[CaptureServer]:
    """``serve_capture`` on endpoint workers: ``server``'s sessions served by ``pool`` for the block."""
    server.pool = pool
    server.url, server.port = pool.urls[0], pool.workers[0].port
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            attachment = server.attachment = Attachment(server, pool, group)
            group.start_soon(attachment.dispatch)
            group.start_soon(attachment.watch.run)
            pool.attach(+1)
            try:
                yield server
            except Exception as exc:  # re-raised below as itself, not wrapped in the task group's ExceptionGroup
                failure = exc
            finally:
                attachment.closed = True
                pool.attach(-1)
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        server.attachment = None


#: How long a rollout whose worker has exited waits for the death to be seen (its reader joins the guardian).
_DEATH_SEEN_S = 15.0

#: Which attachment runs each worker's call, by (worker, call id): where a ``cancel`` frame goes.
_running: dict[tuple[CaptureWorker, int], Attachment] = {}


def deliver(worker: CaptureWorker, frame: Frame) -> None:
    """A worker's ``call`` or ``cancel`` frame (its reader thread): to the loop of the session it concerns."""
    if frame[0] == "call":
        entry = worker.sessions.get(frame[2])
        if entry is None:  # its session closed meanwhile (the worker answers 499 once it closes there)
            worker.post(("fail", frame[1], error_fields(APIError(499, "the capture session has closed"))))
            return
        owner = entry.attachment
        owner.hand(lambda: owner._call(worker, entry.session, frame))
    elif frame[0] == "cancel":
        running = _running.get((worker, frame[1]))
        if running is not None:
            running.hand(lambda: running._cancel(worker, frame[1]))


@asynccontextmanager
async def pooled_session(
    server: CaptureServer,
    rollout: str,
    *,
    sampling_params: dict[str, Any] | None,
    context: RolloutContext | None,
    cleanup_timeout_s: float,
) -> AsyncIterator[CaptureSession]:
    """:meth:`~._server.CaptureServer.session` with its HTTP served by a worker process (see the module)."""
    attachment: Attachment = server.attachment
    pool = attachment.pool
    key = secrets.token_urlsafe(24)  # 192 bits, the credential
    context = server.rollout_context(context)
    worker = pool.place(id(context.batch), context.ref.index)
    session = CaptureSession(
        id=str(context.ref.session_id),
        api_key=key,
        rollout=rollout,
        base_url=f"{worker.url}/sessions/{key}/v1",
        capture=Capture(server.tokenizer, server.chat_template_kwargs),
        sampling_params=sampling_params,
        context=context,
        _afterlife=server.afterlife,
    )
    session.worker = worker.index
    # The worker hears of the close at once: its requests in flight answer 499 as the in-loop endpoint's do.
    session.on_close = lambda reason: _begin_close(worker, session, reason, cleanup_timeout_s)
    worker.sessions[key] = _Entry(session, attachment)
    server._sessions[key] = session  # counted open here too (requests never look it up in the trainer)
    opened = worker.request(("open", key, session.id, rollout, sampling_params))
    try:
        await opened.wait()
        opened.result()
    except BaseException:
        worker.sessions.pop(key, None)
        server._sessions.pop(key, None)
        worker.post(("close", 0, key, "cancelled", 0.0))  # opened there or not: forgotten there
        raise
    context.cleanup.envs_opened += 1
    context.emit(RolloutObserver.env_opened)
    reason = "ended"
    error: BaseException | None = None
    try:
        with anyio.CancelScope() as body:
            session._body = body
            try:
                yield session
            except Exception as exc:
                await _lost_with(worker, session)
                if session.lost is not None:
                    raise session.lost from exc
                raise
        if session.lost is not None:
            raise session.lost
    except BaseException as exc:
        reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "failed"
        error = exc
        raise
    finally:
        await _close(server, worker, session, reason, cleanup_timeout_s, error)


async def _lost_with(worker: CaptureWorker, session: CaptureSession) -> None:
    """When the rollout failed as its worker died (its agent saw the connection drop before the trainer saw
    the death), wait until the death reaches the session, so the rollout fails with the worker's error."""
    if session.lost is not None or not worker.exited():
        return
    with anyio.move_on_after(_DEATH_SEEN_S):
        while session.lost is None:  # noqa: ASYNC110 - set by the worker's reader thread through the loop
            await anyio.sleep(0.005)


def _begin_close(worker: CaptureWorker, session: CaptureSession, reason: str, limit_s: float) -> None:
    """Tell the worker a session closed (from :meth:`CaptureSession.close`); :func:`_close` awaits its answer."""
    if session.lost is None:
        session.closing = worker.request(("close", session.api_key, reason, limit_s))


async def _close(
    server: CaptureServer,
    worker: CaptureWorker,
    session: CaptureSession,
    reason: str,
    limit_s: float,
    error: BaseException | None,
) -> None:
    """Close a pooled session once: its engine calls, then the worker's side; its rows' data comes back."""
    context = session.context
    context.emit(RolloutObserver.cleanup_started, "env_close")
    session.close(reason)
    drained = await session._drain(limit_s)
    closed = session.closing if session.lost is None else None
    state: Any = None
    if closed is not None:
        with anyio.move_on_after(limit_s + 1.0, shield=True):
            await closed.wait()
        try:
            state, worker_drained = closed.result() if closed.done else (None, False)
        except CaptureWorkerError:  # the worker died meanwhile
            state, worker_drained = None, False
        drained = drained and worker_drained
    worker.sessions.pop(session.api_key, None)
    server.pool.remember_ended(session.api_key, session.id, session.rollout)
    server.end_session(session.api_key)
    if state is not None:
        restore_capture(session.capture, state)
    if drained and state is not None:
        context.cleanup.envs_closed += 1
        context.emit(RolloutObserver.cleanup_finished, "env_close", "ok", None)
    else:
        context.cleanup.env_cleanup_timeouts += 1
        context.emit(RolloutObserver.cleanup_finished, "env_close", "timeout", None)
    if session.engine_requests:
        await run_cleanups([SessionEnd(context, session_id=session.id)], limit_s=limit_s, error=error)
    if state is None and error is None:
        raise session.lost or CaptureWorkerError(
            f"capture endpoint worker {worker.index} (pid {worker.pid}, port {worker.port}) did not close rollout "
            f"{session.rollout}'s session within {limit_s:g} s; its calls cannot be read back"
        )
