"""The pause clock on its own: ``PauseClock``, ``PausableDeadline``, ``PausedBlock``, ``use_clock``.

tests/test_pauses.py shows pauses through whole batches; this module pins the pieces. What a
trainer relies on: a pause stops every deadline's clock and resume restarts it with exactly the
budget that was left; pauses nest, and the clock runs only once the last is released; a deadline
entered during a pause starts counting at resume; a pause never resumed is reported once.

Exact instants are asserted on ``trio-autojump`` (virtual time); on ``asyncio`` the same tests run
on the real clock and assert only lower bounds (a deadline never fires early) and that nothing
fires during a pause, which no machine speed can break.
"""

from __future__ import annotations

import logging

import anyio
import pytest

from skyrl_structured._runtime.pauses import PausableDeadline, PauseClock, PausedBlock, current_clock, use_clock

from ._virtual_time import EARLY, hang_bound, on_virtual_time, preempted, real_and_virtual_time, seconds

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches.
GENEROUS_S = 60.0


def test_pauses_nest_and_a_resume_without_its_pause_is_refused():
    clock = PauseClock()
    assert (clock.paused, clock.depth) == (False, 0)
    clock.pause()
    clock.pause()
    assert (clock.paused, clock.depth) == (True, 2)
    clock.resume()
    assert (clock.paused, clock.depth) == (True, 1)
    clock.resume()
    assert (clock.paused, clock.depth) == (False, 0)
    assert clock.paused_for() == 0.0
    with pytest.raises(RuntimeError, match=r"^resume\(\) without a matching pause\(\): the generator is not paused$"):
        clock.resume()
    assert clock.depth == 0  # the refused resume did not count


class Work:
    """A task that runs under ``clock.deadline(budget)`` until the deadline cuts it, noting when."""

    def __init__(self, clock: PauseClock | None, budget: float | None) -> None:
        self.clock = clock
        self.budget = budget
        self.entered = anyio.Event()
        self.cut = anyio.Event()
        self.began = 0.0
        self.ended = 0.0

    async def run(self) -> None:
        self.began = anyio.current_time()
        with PausableDeadline(self.clock, self.budget) as scope:
            self.entered.set()
            await anyio.sleep_forever()
        self.ended = anyio.current_time()
        assert scope.cancelled_caught
        self.cut.set()


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_pause_stops_every_deadline_and_resume_restarts_each_with_the_budget_it_had_left(anyio_backend):
    budget = seconds(virtual=600.0, real=0.5)
    clock = PauseClock()
    short, long = Work(clock, budget), Work(clock, 2 * budget)
    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(short.run)
            group.start_soon(long.run)
            await short.entered.wait()
            await long.entered.wait()
            if on_virtual_time():
                await anyio.sleep(budget / 4)  # some work counted before the pause
            clock.pause()
            paused_at = anyio.current_time()
            await anyio.sleep(3 * budget)  # longer than either deadline: both would have fired
            assert not short.cut.is_set()
            assert not long.cut.is_set()
            resumed_at = anyio.current_time()  # before the resume restarts the deadlines
            clock.resume()
            preempted()  # where a busy machine may stall the test
            await short.cut.wait()
            await long.cut.wait()
    for work in (short, long):
        assert work.budget is not None
        before = paused_at - work.began  # counted before the pause
        after = work.ended - resumed_at  # counted after it
        if on_virtual_time():
            assert before == pytest.approx(budget / 4)
            assert after == pytest.approx(work.budget - before)  # exactly what was left, no more, no less
        else:
            assert after >= work.budget - before - EARLY  # never before its budget of work was spent


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_overlapping_pauses_hold_the_clock_until_the_last_is_released(anyio_backend):
    budget = seconds(virtual=600.0, real=0.5)
    clock = PauseClock()
    work = Work(clock, budget)
    sync_holds, sync_may_end = anyio.Event(), anyio.Event()

    async def weight_sync() -> None:
        async with PausedBlock(clock):
            sync_holds.set()
            await sync_may_end.wait()

    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(work.run)
            await work.entered.wait()
            clock.pause()  # a user's pause ...
            group.start_soon(weight_sync)  # ... and a weight sync overlapping it
            await sync_holds.wait()
            assert clock.depth == 2
            clock.resume()  # the user's pause is released; the sync's is still held
            await anyio.sleep(3 * budget)
            assert not work.cut.is_set()
            sync_may_end.set()
            await work.cut.wait()
            released_at = anyio.current_time()
    assert clock.depth == 0
    if on_virtual_time():
        # All of the budget was left: the clock stopped at once and ran again only at the last release.
        assert work.ended - work.began == pytest.approx(3 * budget + budget)
        assert released_at == pytest.approx(work.ended)
    else:
        assert work.ended - work.began >= 3 * budget + budget - EARLY


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_deadline_entered_during_a_pause_starts_counting_at_resume(anyio_backend):
    budget = seconds(virtual=600.0, real=0.5)
    clock = PauseClock()
    clock.pause()
    work = Work(clock, budget)
    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(work.run)
            await work.entered.wait()
            await anyio.sleep(3 * budget)
            assert not work.cut.is_set()
            resumed_at = anyio.current_time()  # before the resume restarts the deadlines
            clock.resume()
            preempted()  # where a busy machine may stall the test
            await work.cut.wait()
    if on_virtual_time():
        assert work.ended - resumed_at == pytest.approx(budget)  # the whole budget, from the resume
    else:
        assert work.ended - resumed_at >= budget - EARLY


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_deadline_without_a_clock_is_a_plain_deadline(anyio_backend):
    budget = seconds(virtual=600.0, real=0.5)
    work = Work(None, budget)
    with hang_bound():
        await work.run()
    if on_virtual_time():
        assert work.ended - work.began == pytest.approx(budget)
    else:
        assert work.ended - work.began >= budget - EARLY


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_deadline_of_none_never_fires_across_pauses(anyio_backend):
    clock = PauseClock()
    with anyio.move_on_after(seconds(virtual=3600.0, real=0.3)) as outer, clock.deadline(None) as scope:
        clock.pause()
        clock.resume()
        await anyio.sleep_forever()
    assert outer.cancelled_caught  # the bound around it ran out first
    assert not scope.cancelled_caught


async def test_a_finished_deadline_is_no_longer_moved_by_pauses(anyio_backend):
    clock = PauseClock()
    with clock.deadline(GENEROUS_S) as scope:
        await anyio.lowlevel.checkpoint()
    deadline = scope.deadline
    clock.pause()
    assert scope.deadline == deadline  # a registered deadline would have been set to infinity
    clock.resume()
    assert scope.deadline == deadline


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_clock_sleep_counts_only_unpaused_time(anyio_backend):
    length = seconds(virtual=600.0, real=0.5)
    clock = PauseClock()
    began, woke = anyio.Event(), anyio.Event()
    times: dict[str, float] = {}

    async def sleeper() -> None:
        times["began"] = anyio.current_time()
        began.set()
        await clock.sleep(length)
        times["woke"] = anyio.current_time()
        woke.set()

    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(sleeper)
            await began.wait()
            clock.pause()
            paused_at = anyio.current_time()
            await anyio.sleep(3 * length)
            assert not woke.is_set()
            resumed_at = anyio.current_time()  # before the resume restarts the deadlines
            clock.resume()
            preempted()  # where a busy machine may stall the test
            await woke.wait()
    slept = (paused_at - times["began"]) + (times["woke"] - resumed_at)
    if on_virtual_time():
        assert slept == pytest.approx(length)
    else:
        assert slept >= length - EARLY


async def test_a_paused_block_holds_one_pause_and_releases_it_when_the_block_raises(anyio_backend):
    clock = PauseClock()
    clock.pause()
    depths: list[int] = []

    async def weight_sync() -> None:
        async with PausedBlock(clock):
            depths.append(clock.depth)
            raise KeyError("inside the block")

    with pytest.raises(KeyError, match="inside the block"):
        await weight_sync()
    assert depths == [2]
    assert clock.depth == 1
    clock.resume()
    assert not clock.paused


class Warnings(logging.Handler):
    """The pause clock's warnings, each setting an event (the watch logs on the loop's thread)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.arrived = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.arrived.set()

    async def next(self) -> str:
        await self.arrived.wait()
        self.arrived = anyio.Event()
        return self.messages[-1]


@pytest.fixture
def pause_warnings():
    handler = Warnings()
    logger = logging.getLogger("skyrl_structured._runtime.pauses")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_pause_that_outlasts_warn_after_s_is_reported_once_per_pause(anyio_backend, pause_warnings):
    warn_after = seconds(virtual=600.0, real=0.2)
    clock = PauseClock(warn_after_s=warn_after)
    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(clock.watch)
            for pause in (1, 2):
                clock.pause()
                paused_at = anyio.current_time()
                message = await pause_warnings.next()
                if on_virtual_time():
                    assert anyio.current_time() - paused_at == pytest.approx(warn_after)
                else:
                    assert anyio.current_time() - paused_at >= warn_after - EARLY
                assert message.startswith("the generator has been paused for ")
                assert "(1 pause(s) held) and not resumed" in message
                assert "until resume() is called as often as pause() was" in message
                await anyio.sleep(3 * warn_after)  # however long the pause lasts: one warning
                assert len(pause_warnings.messages) == pause
                clock.resume()
            group.cancel_scope.cancel()  # the supervisor stops the watch with its batch


@pytest.mark.parametrize("anyio_backend", [real_and_virtual_time()[1]])
async def test_a_pause_resumed_within_warn_after_s_is_not_reported(anyio_backend, pause_warnings):
    clock = PauseClock(warn_after_s=600.0)
    async with anyio.create_task_group() as group:
        group.start_soon(clock.watch)
        clock.pause()
        await anyio.sleep(599.0)
        clock.resume()
        await anyio.sleep(3600.0)
        clock.pause()
        clock.pause()  # nested: still one pause
        await anyio.sleep(599.0)
        clock.resume()
        clock.resume()
        await anyio.sleep(3600.0)
        group.cancel_scope.cancel()
    assert pause_warnings.messages == []


async def test_use_clock_makes_the_clock_current_for_the_block_and_the_tasks_it_starts(anyio_backend):
    clock, other = PauseClock(), PauseClock()
    seen: list[PauseClock | None] = []

    async def rollout() -> None:
        seen.append(current_clock())

    assert current_clock() is None
    with use_clock(clock):
        assert current_clock() is clock
        async with anyio.create_task_group() as group:
            group.start_soon(rollout)
        with use_clock(other):
            assert current_clock() is other
        with use_clock(None):
            assert current_clock() is None
        assert current_clock() is clock
    assert current_clock() is None
    assert seen == [clock]
