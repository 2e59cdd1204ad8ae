"""Tasks of one task group kept to run short jobs handed to the loop, instead of one new task per job.

The capture endpoint's trainer side (:mod:`skyrl_structured.agents._pooled`) runs one engine call per
agent request. Spawning an anyio task for each costs 20-40 µs of the loop's CPU (anyio 4.16: a task
handle with its own cancel scope and event, then the task's first step); waking an idle runner
with the loop's own primitive (:mod:`.native`) costs 1-2.5 µs (20,000 jobs over 1,000 runners,
``process_time``, asyncio and trio). A job is an async callable without arguments that handles its
own errors: one that raises fails the group, as a task of it would.

Runners are tasks of the group, so they end with it; one is added whenever a job comes and none is
idle, and none is ever taken away before the group ends (their number is the most jobs that ran
at once, each an idle coroutine while it waits).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from .native import loop_waiter
from .wakers import current_waker

__all__ = ["Job", "Runners"]

#: One job: run by a runner, awaited to its end before the runner takes the next.
Job = Callable[[], Awaitable[None]]


class _Runner:
    """One runner's hand-over slot: the job it was given, and how to wake it."""

    __slots__ = ("job", "wake")

    def __init__(self) -> None:
        self.job: Job | None = None
        self.wake: Callable[[], None] = _nothing


def _nothing() -> None:
    pass


class Runners:
    """Runs jobs on idle runner tasks of ``group``, adding a runner when none is idle (see the module).

    Make it in a task of the group's loop; :meth:`submit` may then be called from the loop's thread
    anywhere, a plain callback included (where no task can be spawned on asyncio).
    """

    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self._group = group
        waker = current_waker()
        self._loop = waker.loop
        self._event_class = waker.event_class
        self._idle: list[_Runner] = []
        #: Jobs that found no idle runner, each to start a new runner (by :meth:`spawn`, a task of the group).
        self._backlog: list[Job] = []
        self._wanted = anyio.Event()

    def submit(self, job: Job) -> None:
        """Run ``job`` soon: on an idle runner, else on a new one (in the loop's thread)."""
        if self._idle:
            runner = self._idle.pop()
            runner.job = job
            runner.wake()
        else:
            self._backlog.append(job)
            self._wanted.set()

    async def spawn(self) -> None:
        """Start a runner for each job that found none idle (a task of the group, until it is cancelled)."""
        while True:
            await self._wanted.wait()
            self._wanted = anyio.Event()
            jobs, self._backlog = self._backlog, []
            for job in jobs:
                self._group.start_soon(self._run, job)

    async def _run(self, job: Job) -> None:
        runner = _Runner()
        while True:
            await job()
            job = await self._park(runner)

    async def _park(self, runner: _Runner) -> Job:
        """Wait, idle, until :meth:`submit` hands ``runner`` a job; that job."""
        runner.job = None
        try:
            if self._loop is not None:
                runner.wake, woken = loop_waiter(self._loop)
                self._idle.append(runner)
                await woken
            else:
                event: Any = self._event_class()
                runner.wake = event.set
                self._idle.append(runner)
                await event.wait()
        except BaseException:  # the group's cancellation: no job may be handed to this runner any more
            if runner in self._idle:
                self._idle.remove(runner)
            raise
        assert runner.job is not None  # only :meth:`submit` wakes a runner, with a job
        return runner.job
