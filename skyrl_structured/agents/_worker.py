"""A capture endpoint worker process: the endpoint's per-call work off the trainer's event loop (DESIGN rule 27).

Each worker runs the in-loop endpoint's own code (:class:`~._server.CaptureServer`: routing, the
sessions' captures, the wire APIs, the HTTP core) on an asyncio loop of its own, on a listening
socket the trainer bound and passed to it. Only the engine call is elsewhere: a session's sampling
sends a ``call`` frame (the prompt's token ids, the request's sampling fields) to the trainer, which
runs it as the in-loop endpoint does and answers ``reply`` or ``fail``. The call is recorded here
when its ``reply`` frame is read, in frame order, unless the session closed first. The trainer opens
and closes the sessions (``open``/``opened``, ``close``/``closed`` with what the session captured),
so an agent's first request never precedes its key, and a closed session answers 499 and then 404
``rollout_ended``, as in-loop.

The worker is the child of a guardian (:mod:`~skyrl_structured._runtime.guardian`) and exits at the
``exit`` frame, or at once when its channel to the trainer reaches EOF (the trainer died).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
from typing import Any

import anyio
import anyio.abc

from .._http import serve
from .._runtime.guardian import guarded_child
from ._capture import CallRecord, Prepared, capture_state
from ._frames import Frame, FrameBuffer, encode, error_from
from ._routes import closed_in_flight
from ._server import _MAX_BODY, CaptureServer, CaptureSession, _error_answer

__all__ = ["capture_main"]

#: How long the worker's HTTP server waits, on exit, for the answers being made.
_CLOSE_S = 1.0
_CHUNK = 1 << 18


def capture_main(
    channel: socket.socket,
    lifeline: Any,
    listener: socket.socket,
    spec: bytes,
    index: int,
    ended: list[tuple[str, str, str]],
) -> None:
    """A worker process's whole life (started by :class:`~._workers.CaptureWorker`): serve until ``exit``.

    ``ended`` are the sessions a replaced worker's port answers ``rollout_ended`` for: ``(key, id, rollout)``.
    """
    guarded_child(lifeline)
    # The worker is in its own session; a SIGINT sent to it anyway is ignored: the trainer decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    anyio.run(_serve, channel, listener, spec, index, ended, backend="asyncio")


async def _serve(
    channel: socket.socket, listener: socket.socket, spec: bytes, index: int, ended: list[tuple[str, str, str]]
) -> None:
    settings: dict[str, Any] = pickle.loads(spec)
    server = CaptureServer(
        None,  # type: ignore[arg-type]  # the engine is the trainer's: every call goes through the channel
        settings["tokenizer"],
        model=settings["model"],
        chat_template_kwargs=settings["chat_template_kwargs"],
        context_length=settings["context_length"],
    )
    for key, session_id, rollout in ended:
        server.remember_ended(key, session_id, rollout)
    stream = await anyio.abc.UNIXSocketStream.from_socket(channel)
    link = _Link(stream, server)
    server.sampler = link.sample
    listeners = [await anyio.abc.SocketListener.from_socket(listener)]
    async with anyio.create_task_group() as group:
        link.group = group
        group.start_soon(link.write_forever)
        async with serve(
            server._route,
            _error_answer,
            what=f"capture endpoint worker {index}",
            max_body=_MAX_BODY,
            listeners=listeners,
            close_timeout_s=_CLOSE_S,
        ):
            link.post(("ready", os.getpid()))
            await link.read_forever()
        await link.flush()
        group.cancel_scope.cancel()


class _Answer:
    """The trainer's answer to one call: its record, or the error to raise in the handler (set once)."""

    __slots__ = ("_error", "_event", "_record")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._record: CallRecord | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def settle(self, record: CallRecord | None = None, *, error: BaseException | None = None) -> None:
        self._record, self._error = record, error
        self._event.set()

    async def result(self) -> CallRecord:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record


class _Link:
    """The worker's end of its channel: frames in (dispatched at once), frames out (sent by one task)."""

    def __init__(self, stream: anyio.abc.SocketStream, server: CaptureServer) -> None:
        self._stream = stream
        self._server = server
        self._out: list[bytes] = []
        self._wake = anyio.Event()
        self._ids = 0
        #: Calls sent to the trainer and not answered: their session, prepared call and waiting handler.
        self._calls: dict[int, tuple[CaptureSession, Prepared, _Answer]] = {}
        self.group: anyio.abc.TaskGroup | None = None

    def post(self, frame: Frame) -> None:
        self._out.append(encode(frame))
        self._wake.set()

    async def write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self.flush()

    async def flush(self) -> None:
        if self._out:
            data, self._out = b"".join(self._out), []
            await self._stream.send(data)

    async def read_forever(self) -> None:
        """Dispatch the trainer's frames until ``exit``; at EOF (the trainer is gone) exit the process now."""
        buffer = FrameBuffer()
        while True:
            try:
                data = await self._stream.receive(_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                os._exit(0)
            for frame in buffer.feed(data):
                if frame[0] == "exit":
                    return
                self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        kind, server = frame[0], self._server
        if kind == "open":
            _, seq, key, session_id, rollout, sampling_params = frame
            server.open_session(key, session_id, rollout, sampling_params)
            self.post(("opened", seq))
        elif kind == "close":
            assert self.group is not None
            self.group.start_soon(self._close, *frame[1:])
        elif kind == "reply":
            self._replied(*frame[1:])
        elif kind == "fail":
            entry = self._calls.pop(frame[1], None)
            if entry is not None and not entry[2].done():
                entry[2].settle(error=error_from(frame[2]))
        elif kind in ("attached", "detached"):
            server.detached = kind == "detached"
        elif kind == "ended":
            for key, session_id, rollout in frame[1]:
                server.remember_ended(key, session_id, rollout)

    async def _close(self, seq: int, key: str, reason: str, limit_s: float) -> None:
        """Close a session as the in-loop endpoint does (its requests answered 499), then send what it captured."""
        session = self._server._sessions.get(key)
        if session is None:
            self.post(("closed", seq, None, True))
            return
        session.close(reason)
        drained = await session._drain(limit_s)
        self._server.end_session(key)
        self.post(("closed", seq, capture_state(session.capture), drained))

    def _replied(self, call_id: int, text: str, sampled: list[int], stop: str, logprobs: list[float] | None) -> None:
        entry = self._calls.pop(call_id, None)
        if entry is None:
            return  # its handler has gone (its client left): not recorded, as in-loop
        session, prepared, answer = entry
        if answer.done():
            return
        if session.closed:
            answer.settle(error=closed_in_flight(session))
            return
        answer.settle(session.capture.record(prepared, sampled, logprobs, stop, text))

    async def sample(
        self, session: CaptureSession, prepared: Prepared, params: dict[str, Any], prompt_param: str
    ) -> CallRecord:
        """The sampler of a worker's sessions: the call goes to the trainer's engine; recorded as it comes back."""
        self._ids += 1
        call_id = self._ids
        answer = _Answer()
        self._calls[call_id] = (session, prepared, answer)
        with anyio.CancelScope() as scope:
            session._inflight.add(scope)
            try:
                self.post(("call", call_id, session.api_key, prepared.prompt_ids, params, prompt_param))
                return await answer.result()
            finally:
                session._request_ended(scope)
                if self._calls.pop(call_id, None) is not None:  # left before its answer: the engine call stops
                    self.post(("cancel", call_id))
        raise closed_in_flight(session)
