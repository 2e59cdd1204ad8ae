"""Finished rollouts of one ``generate()`` call as an async iterator, built on a memory object stream.

:class:`TrajectoryStream` is an observer: add it to ``generator.observers``, run ``generate()`` and
iterate over the stream in a sibling task. Each rollout arrives once, as soon as it is final (a
success, or a failure after its retries), as a :class:`~skyrl_structured.FinishedTrajectory`; the
iteration ends when the batch ends, whether ``generate()`` returns or raises. It works the same on
asyncio and trio (anyio's memory object streams)::

    stream = TrajectoryStream()
    generator.observers.append(stream)
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume, stream)      # async for trajectory in stream: ...
        output = await generator.generate(batch)
"""

from __future__ import annotations

import logging
import math
from types import TracebackType

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .observe import FinishedTrajectory, RolloutObserver, RolloutRef

__all__ = ["TrajectoryStream"]

logger = logging.getLogger(__name__)


class TrajectoryStream(RolloutObserver):
    """An async iterator of the finished rollouts of one ``generate()`` call, in completion order.

    The buffer is unbounded: observers are called synchronously and must never block the batch,
    so a slow consumer holds records in memory rather than slowing generation down (a record is
    the rollout's token ids, the size of its share of the ``GeneratorOutput``).

    One stream serves one ``generate()`` call; a second call on the same stream is refused (logged,
    and the stream is skipped for that call). Closing the stream (:meth:`aclose`, or leaving
    ``async with stream``) stops delivery without affecting the batch; a consumer that stops
    before the end should do so, as anyio warns about a receive stream dropped unclosed.
    """

    def __init__(self) -> None:
        send, receive = anyio.create_memory_object_stream[FinishedTrajectory](math.inf)
        self._send: MemoryObjectSendStream[FinishedTrajectory] = send
        self._receive: MemoryObjectReceiveStream[FinishedTrajectory] = receive
        self._started = False
        self._ended = False
        #: Records delivered to the stream so far (whether or not read yet).
        self.delivered = 0

    # ------------------------------------------------------------------ the observer side

    def batch_started(self, size: int) -> None:
        if self._started:
            raise RuntimeError(
                "a TrajectoryStream serves one generate() call; create a new TrajectoryStream for each call"
            )
        self._started = True

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        try:
            self._send.send_nowait(trajectory)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the consumer closed its side: it asked for no more
        self.delivered += 1

    def batch_finished(self, size: int, failed: int) -> None:
        self._send.close()

    def batch_aborted(self, size: int, error: BaseException) -> None:
        self._send.close()

    # ------------------------------------------------------------------ the consumer side

    def __aiter__(self) -> TrajectoryStream:
        return self

    async def __anext__(self) -> FinishedTrajectory:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def receive(self) -> FinishedTrajectory:
        """The next finished rollout; the receiving side closes itself once the last one was read.

        Raises:
            anyio.EndOfStream: the batch is over and every record has been received.
            anyio.ClosedResourceError: the stream was closed by :meth:`aclose` or ``async with``.
        """
        if self._ended:
            await anyio.lowlevel.checkpoint()
            raise anyio.EndOfStream
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            self._ended = True
            self._receive.close()
            raise

    async def aclose(self) -> None:
        """Stop listening: later records are dropped, the batch is not affected."""
        self._receive.close()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> TrajectoryStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._receive.close()
