"""The straggler cutoff on its own: ``StragglerCutoff`` over rollouts that finish when the test says.

tests/test_stragglers.py shows cuts through whole batches; this module pins the rule. What a
trainer relies on: once ``ceil(f * n)`` rollouts of a scope (the batch, or one prompt group) are
final, and not one earlier, the others get the grace and then exactly those still running are
cut; a grace stops while the generator is paused and ends as soon as its scope is all final.

Each rollout here waits on its own event inside its cutoff scope and reports itself final when
released, as the supervisor does. Exact instants are asserted on ``trio-autojump``; on ``asyncio``
only lower bounds, and a grace that must not run out is held open by a pause, never by speed.
A lower bound is measured from a timestamp taken before whatever starts the grace (the release of
the rollout that reaches the threshold, the resume), and the tests stall the thread right after
that act (``preempted``), where a busy machine may: a timestamp taken after it would fail then.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import anyio
import anyio.abc
import pytest

from skyrl_structured._runtime.pauses import PauseClock
from skyrl_structured._runtime.stragglers import StragglerCutoff, cutoff_threshold

from ._virtual_time import EARLY, hang_bound, on_virtual_time, preempted, real_and_virtual_time, seconds

pytestmark = pytest.mark.anyio

LOGGER = "skyrl_structured._runtime.stragglers"


class Rollouts:
    """Rollouts in their cutoff scopes: each ends when released (then it is final) or when cut."""

    def __init__(self, cutoff: StragglerCutoff, size: int) -> None:
        self.cutoff = cutoff
        self.release = [anyio.Event() for _ in range(size)]
        self.ended = [anyio.Event() for _ in range(size)]
        self.final_at: dict[int, float] = {}
        self.cut_at: dict[int, float] = {}

    async def rollout(self, index: int, group: anyio.abc.TaskGroup) -> None:
        with self.cutoff.scope(index) as scope:
            await self.release[index].wait()
        if scope.cancelled_caught:
            self.cut_at[index] = anyio.current_time()
        else:
            self.final_at[index] = anyio.current_time()
            self.cutoff.finished(index, group)
        self.ended[index].set()

    def start(self, group: anyio.abc.TaskGroup) -> None:
        for index in range(len(self.release)):
            group.start_soon(self.rollout, index, group)

    async def finish(self, *indices: int) -> None:
        """Release these rollouts one after the other; each is final (or was cut) when this returns."""
        for index in indices:
            self.release[index].set()
            await self.ended[index].wait()
            preempted()  # a grace this started has begun: a busy machine may stall the test here

    async def until_ended(self, indices: Sequence[int]) -> None:
        for index in indices:
            await self.ended[index].wait()


def assert_cut_after_grace(rollouts: Rollouts, cut: Sequence[int], grace_from: float, grace: float) -> None:
    assert sorted(rollouts.cut_at) == sorted(cut)
    for index in cut:
        assert rollouts.cutoff.was_cut(index)
        if on_virtual_time():
            assert rollouts.cut_at[index] == pytest.approx(grace_from + grace)  # at the grace's end exactly
        else:
            assert rollouts.cut_at[index] - grace_from >= grace - EARLY  # never before it
    for index in rollouts.final_at:
        assert not rollouts.cutoff.was_cut(index)


def test_the_threshold_is_the_ceiling_of_the_share_at_least_one():
    assert cutoff_threshold(0.7, 10) == 7  # 0.7 * 10 is 7.000000000000001
    assert cutoff_threshold(0.5, 3) == 2
    assert cutoff_threshold(1 / 3, 3) == 1
    assert cutoff_threshold(0.5, 1) == 1
    assert cutoff_threshold(0.0, 5) == 1  # at least one rollout must be final


@pytest.mark.parametrize(
    ("fraction", "size"),
    [(0.75, 4), (0.5, 5), (0.9, 10), (0.01, 3)],
    ids=["3-of-4", "3-of-5", "9-of-10", "1-of-3"],
)
@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_once_the_threshold_is_final_the_rest_are_cut_after_the_grace(anyio_backend, fraction, size, caplog):
    grace = seconds(virtual=600.0, real=0.2)
    threshold = cutoff_threshold(fraction, size)
    rollouts = Rollouts(StragglerCutoff(fraction, grace, ["batch"] * size), size)
    with caplog.at_level(logging.INFO, logger=LOGGER), hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            await rollouts.finish(*range(threshold - 1))
            await anyio.sleep(3 * grace)  # one short of the threshold: no grace runs, nothing is cut
            assert rollouts.cut_at == {}
            reached = anyio.current_time()  # before the grace starts: no stall can shorten what it measures
            await rollouts.finish(threshold - 1)
            await rollouts.until_ended(range(threshold, size))
    assert sorted(rollouts.final_at) == list(range(threshold))
    assert_cut_after_grace(rollouts, range(threshold, size), reached, grace)
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert [(r.levelno, r.getMessage()) for r in logged] == [
        (
            logging.INFO,  # one line per cut in batch scope
            f"straggler cutoff: cut {size - threshold} of the {size} rollouts of batch after {threshold} were final",
        )
    ]


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_the_grace_stops_while_the_generator_is_paused(anyio_backend):
    grace = seconds(virtual=600.0, real=0.2)
    clock = PauseClock()
    rollouts = Rollouts(StragglerCutoff(0.5, grace, ["batch"] * 4, clock), 4)
    with hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            clock.pause()  # a weight sync: the grace that starts now waits for the resume
            await rollouts.finish(0, 1)
            await anyio.sleep(3 * grace)
            assert rollouts.cut_at == {}
            resumed = anyio.current_time()  # before the resume restarts the grace
            clock.resume()
            preempted()
            await rollouts.until_ended([2, 3])
    assert_cut_after_grace(rollouts, [2, 3], resumed, grace)


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_rollout_final_during_the_grace_is_not_cut(anyio_backend, caplog):
    grace = seconds(virtual=600.0, real=0.2)
    clock = PauseClock()
    rollouts = Rollouts(StragglerCutoff(0.5, grace, ["batch"] * 4, clock), 4)
    with caplog.at_level(logging.INFO, logger=LOGGER), hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            clock.pause()  # holds the grace open however slow the machine is
            await rollouts.finish(0, 1)  # the threshold: the grace starts ...
            await rollouts.finish(2)  # ... and rollout 2 becomes final within it
            resumed = anyio.current_time()  # before the resume restarts the grace
            clock.resume()
            preempted()
            await rollouts.until_ended([3])
    assert sorted(rollouts.final_at) == [0, 1, 2]
    assert_cut_after_grace(rollouts, [3], resumed, grace)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "straggler cutoff: cut 1 of the 4 rollouts of batch after 3 were final"
    ]


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_each_prompt_group_has_its_own_threshold_and_grace(anyio_backend, caplog):
    grace = seconds(virtual=600.0, real=0.2)
    groups: list[Hashable] = ["a", "a", "a", "b", "b", "b"]
    cutoff = StragglerCutoff(0.6, grace, groups)  # 2 of each group of 3
    rollouts = Rollouts(cutoff, len(groups))
    with caplog.at_level(logging.DEBUG, logger=LOGGER), hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            await rollouts.finish(3)  # one of group b: short of its threshold
            a_reached = anyio.current_time()  # before group a's grace starts
            await rollouts.finish(0, 1)  # group a reaches its threshold
            await rollouts.until_ended([2])
            assert sorted(rollouts.cut_at) == [2]  # only group a's straggler
            await anyio.sleep(3 * grace)
            assert sorted(rollouts.cut_at) == [2]  # group b's grace never started
            b_reached = anyio.current_time()  # before group b's grace starts
            await rollouts.finish(4)
            await rollouts.until_ended([5])
    assert sorted(rollouts.final_at) == [0, 1, 3, 4]
    assert not any(cutoff.was_cut(index) for index in rollouts.final_at)
    for index, reached in ((2, a_reached), (5, b_reached)):
        assert cutoff.was_cut(index)
        if on_virtual_time():
            assert rollouts.cut_at[index] == pytest.approx(reached + grace)
        else:
            assert rollouts.cut_at[index] - reached >= grace - EARLY
    assert cutoff.describe(2) == (
        "2 of the 3 rollouts of its scope were final (generator.straggler_cutoff=0.6) "
        f"and generator.straggler_grace_s={grace:g}s had passed"
    )
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert [(r.levelno, r.getMessage()) for r in logged] == [
        (logging.DEBUG, "straggler cutoff: cut 1 of the 3 rollouts of a after 2 were final"),  # many per batch
        (logging.DEBUG, "straggler cutoff: cut 1 of the 3 rollouts of b after 2 were final"),
    ]


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_grace_no_longer_needed_ends_with_its_scope(anyio_backend):
    hour = 3600.0  # the batch must not wait for it: a hang bound of a minute would catch that
    rollouts = Rollouts(StragglerCutoff(0.5, hour, ["batch"] * 2), 2)
    with hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            await rollouts.finish(0)  # the threshold: an hour's grace starts
            await rollouts.finish(1)  # the last one is final: the grace is cancelled
            done = anyio.current_time()
        ended = anyio.current_time()
    assert rollouts.cut_at == {}
    if on_virtual_time():
        assert ended == done  # the task group did not wait for the grace at all
    else:
        assert ended - done < hour


async def test_a_scope_all_final_before_its_grace_task_runs_starts_no_wait(anyio_backend):
    cutoff = StragglerCutoff(0.5, 3600.0, ["batch"] * 2)
    with hang_bound():
        async with anyio.create_task_group() as group:
            cutoff.finished(0, group)  # the grace task is started ...
            cutoff.finished(1, group)  # ... and its scope is all final before it ever ran
    assert not cutoff.was_cut(0)
    assert not cutoff.was_cut(1)


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_with_a_cutoff_of_one_nothing_is_ever_cut(anyio_backend):
    grace = seconds(virtual=600.0, real=0.2)
    rollouts = Rollouts(StragglerCutoff(1.0, grace, ["batch"] * 3), 3)
    with hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            await rollouts.finish(0, 1)
            await anyio.sleep(3 * grace)
            assert rollouts.cut_at == {}
            await rollouts.finish(2)
    assert sorted(rollouts.final_at) == [0, 1, 2]


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_rollout_reported_final_twice_counts_once(anyio_backend):
    grace = seconds(virtual=600.0, real=0.2)
    rollouts = Rollouts(StragglerCutoff(0.5, grace, ["batch"] * 4), 4)
    with hang_bound():
        async with anyio.create_task_group() as group:
            rollouts.start(group)
            await rollouts.finish(0)
            rollouts.cutoff.finished(0, group)  # again: still one final of the two needed
            await anyio.sleep(3 * grace)
            assert rollouts.cut_at == {}
            reached = anyio.current_time()  # before the grace starts
            await rollouts.finish(1)
            await rollouts.until_ended([2, 3])
    assert_cut_after_grace(rollouts, [2, 3], reached, grace)
