"""Runners: kept tasks of one task group that run jobs handed to the loop (the endpoint workers' engine calls)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import anyio
import pytest

from skyrl_structured._runtime.runners import Runners
from skyrl_structured._runtime.wakers import current_waker

pytestmark = pytest.mark.anyio


async def test_jobs_run_on_as_many_runners_as_ran_at_once_and_idle_ones_are_reused() -> None:
    ran: list[int] = []
    release = anyio.Event()
    started: list[int] = []
    task_names: set[str] = set()

    def job(i: int, *, hold: bool) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            started.append(i)
            task_names.add(repr(anyio.get_current_task().id))
            if hold:
                await release.wait()
            ran.append(i)

        return run

    async with anyio.create_task_group() as group:
        runners = Runners(group)
        group.start_soon(runners.spawn)
        for i in range(5):  # five at once: five runners
            runners.submit(job(i, hold=True))
        while len(started) < 5:  # noqa: ASYNC110 - the jobs' own progress
            await anyio.sleep(0.001)
        release.set()
        while len(ran) < 5:  # noqa: ASYNC110
            await anyio.sleep(0.001)
        assert len(task_names) == 5
        for i in range(5, 25):  # one by one afterwards: the idle runners take them, none is added
            runners.submit(job(i, hold=False))
            while len(ran) < i + 1:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        assert sorted(ran) == list(range(25))
        assert len(task_names) == 5
        group.cancel_scope.cancel()


async def test_a_job_handed_from_another_thread_through_the_loops_waker_runs() -> None:
    """The endpoint's case: a reader thread hands a callback to the loop, which submits from that callback."""
    done = anyio.Event()
    async with anyio.create_task_group() as group:
        runners = Runners(group)
        group.start_soon(runners.spawn)
        waker = current_waker()

        async def job() -> None:
            done.set()

        thread = threading.Thread(target=lambda: waker(lambda: runners.submit(job)))
        thread.start()
        await done.wait()  # a hang here, not a wrong verdict, if the hand-over were lost
        await anyio.to_thread.run_sync(thread.join)
        group.cancel_scope.cancel()


async def test_the_groups_cancellation_ends_every_runner_busy_or_idle_and_no_job_reaches_a_dead_runner() -> None:
    cancelled: list[int] = []
    release = anyio.Event()

    def busy(i: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            try:
                await release.wait()
            except anyio.get_cancelled_exc_class():
                cancelled.append(i)
                raise

        return run

    async def quick() -> None:
        pass

    async with anyio.create_task_group() as group:
        runners = Runners(group)
        group.start_soon(runners.spawn)
        runners.submit(quick)
        runners.submit(busy(1))
        runners.submit(busy(2))
        await anyio.wait_all_tasks_blocked()
        group.cancel_scope.cancel()
    assert sorted(cancelled) == [1, 2]
    assert runners._idle == []  # the idle runner left its place as it was cancelled


async def test_a_job_that_raises_fails_the_group_as_a_task_of_it_would() -> None:
    async def broken() -> None:
        raise ValueError("job failed")

    async def run() -> None:
        async with anyio.create_task_group() as group:
            runners = Runners(group)
            group.start_soon(runners.spawn)
            runners.submit(broken)
            await anyio.sleep_forever()

    with pytest.raises(ExceptionGroup) as caught:
        await run()
    assert [type(e) for e in caught.value.exceptions] == [ValueError]
