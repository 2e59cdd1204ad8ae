"""``max_concurrent_rollouts`` on its own: the generator's slots (``RolloutSlots``) and when a slot is given back.

What a trainer relies on: one bound per generator, shared by all its concurrent ``generate()``
calls (SkyRL's fully-async trainer runs several at once), handed out first come first served; and
a rollout whose environment close was abandoned (it overran ``env_cleanup_timeout_s`` and still
runs in its worker thread) keeps its slot until that close returns, because the environment is
live until then. Order is shown with events and ``wait_all_tasks_blocked``, never with the clock.
"""

from __future__ import annotations

import logging
import threading
from functools import partial

import anyio
import anyio.abc
import pytest
import sniffio

from skyrl_structured._runtime.slots import RolloutSlots
from skyrl_structured._runtime.supervisor import _release_when_closed
from skyrl_structured.envs._threads import EnvCall

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches.
GENEROUS_S = 60.0


class Generator:
    """Stands for the generator that owns the slots (only its identity matters)."""


async def test_without_a_bound_there_is_no_limiter(anyio_backend):
    assert RolloutSlots(Generator()).current(None) is None


async def test_one_limiter_per_generator_and_loop_remade_when_the_bound_changes(anyio_backend):
    owner = Generator()
    slots = RolloutSlots(owner)
    first = slots.current(2)
    assert first is not None
    assert first.total_tokens == 2
    assert slots.current(2) is first  # a second call of the same generator shares it
    assert RolloutSlots(Generator()).current(2) is not first  # another generator has its own
    resized = slots.current(3)
    assert resized is not None
    assert resized is not first
    assert resized.total_tokens == 3
    assert slots.current(3) is resized

    backend = sniffio.current_async_library()

    def in_another_loop() -> int:
        async def there() -> int:
            limiter = slots.current(3)
            assert limiter is not None
            return id(limiter)

        return anyio.run(there, backend=backend)

    # A limiter belongs to its event loop: another loop (a thread running its own) gets its own.
    assert await anyio.to_thread.run_sync(in_another_loop) != id(resized)
    assert slots.current(3) is resized


class Rollouts:
    """Rollouts that take a slot, say they are in, and hold it until released one by one."""

    def __init__(self, slots: RolloutSlots, bound: int) -> None:
        self.slots = slots
        self.bound = bound
        self.inside: set[str] = set()
        self.most_inside = 0
        self.order: list[str] = []
        self.release: dict[str, anyio.Event] = {}

    async def rollout(self, name: str) -> None:
        limiter = self.slots.current(self.bound)
        assert limiter is not None
        self.release[name] = anyio.Event()
        async with limiter:
            self.order.append(name)
            self.inside.add(name)
            self.most_inside = max(self.most_inside, len(self.inside))
            await self.release[name].wait()
            self.inside.discard(name)

    async def queue(self, call: anyio.abc.TaskGroup, name: str) -> None:
        """Start rollout ``name`` in ``call`` (one ``generate()`` call's task group), once it waits or runs."""
        call.start_soon(self.rollout, name)
        await anyio.wait_all_tasks_blocked()  # it took a slot or queued before anything else starts


async def test_the_bound_holds_across_concurrent_calls_of_one_generator(anyio_backend):
    slots = RolloutSlots(Generator())
    rollouts = Rollouts(slots, bound=2)
    with anyio.fail_after(GENEROUS_S):
        async with anyio.create_task_group() as call_a, anyio.create_task_group() as call_b:
            for name in ["a0", "a1", "a2"]:
                await rollouts.queue(call_a, name)
            for name in ["b0", "b1"]:
                await rollouts.queue(call_b, name)
            limiter = slots.current(2)
            assert limiter is not None
            assert rollouts.inside == {"a0", "a1"}
            assert limiter.statistics().tasks_waiting == 3
            while rollouts.inside:
                rollouts.release[min(rollouts.inside)].set()
                await anyio.wait_all_tasks_blocked()
                assert len(rollouts.inside) <= 2
    assert rollouts.most_inside == 2
    assert sorted(rollouts.order) == ["a0", "a1", "a2", "b0", "b1"]


async def test_slots_go_first_come_first_served_so_a_large_call_cannot_starve_a_small_one(anyio_backend):
    slots = RolloutSlots(Generator())
    rollouts = Rollouts(slots, bound=1)
    with anyio.fail_after(GENEROUS_S):
        async with (
            anyio.create_task_group() as first,
            anyio.create_task_group() as small,
            anyio.create_task_group() as large,
        ):
            await rollouts.queue(first, "holder")
            await rollouts.queue(small, "small0")  # the small call queues first ...
            for name in ["large0", "large1", "large2"]:  # ... then the large one
                await rollouts.queue(large, name)
            for name in ["holder", "small0", "large0", "large1", "large2"]:
                assert rollouts.inside == {name}
                rollouts.release[name].set()
                await anyio.wait_all_tasks_blocked()
    assert rollouts.order == ["holder", "small0", "large0", "large1", "large2"]
    assert rollouts.most_inside == 1


class Close:
    """An environment close in a real worker thread (an ``EnvCall``) that returns only when told to."""

    def __init__(self) -> None:
        self.running = threading.Event()
        self.may_return = threading.Event()
        self.call: EnvCall[None] = EnvCall(self._close, skippable=False)
        self.thread = threading.Thread(target=self.call.run, daemon=True)
        self.thread.start()

    def _close(self) -> None:
        self.running.set()
        self.may_return.wait(GENEROUS_S)

    async def until_running(self) -> None:
        assert await anyio.to_thread.run_sync(self.running.wait, GENEROUS_S)

    async def finish(self) -> None:
        """Let the close return and wait until the loop has heard it."""
        self.may_return.set()
        with anyio.fail_after(GENEROUS_S):
            await self.call.wait()
        await anyio.to_thread.run_sync(partial(self.thread.join, GENEROUS_S))


async def next_rollout(limiter: anyio.CapacityLimiter, got: anyio.Event) -> None:
    async with limiter:
        got.set()


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_rollout_keeps_its_slot_until_its_abandoned_close_returns(anyio_backend, caplog):
    limiter = RolloutSlots(Generator()).current(1)
    assert limiter is not None
    borrower = object()
    await limiter.acquire_on_behalf_of(borrower)
    close = Close()
    await close.until_running()
    _release_when_closed(limiter, borrower, [close.call])
    got = anyio.Event()
    with anyio.fail_after(GENEROUS_S):
        async with anyio.create_task_group() as group:
            group.start_soon(next_rollout, limiter, got)
            await anyio.wait_all_tasks_blocked()
            assert not got.is_set()  # the environment is still live in its thread: its slot stays taken
            assert limiter.borrowed_tokens == 1
            await close.finish()
            await got.wait()  # the close returned: the slot went to the next rollout
    assert limiter.borrowed_tokens == 0
    assert errors(caplog) == []  # the slot was given back once (a second release would raise in the drain)


async def test_with_several_abandoned_closes_the_slot_waits_for_the_last(anyio_backend, caplog):
    limiter = RolloutSlots(Generator()).current(1)
    assert limiter is not None
    borrower = object()
    await limiter.acquire_on_behalf_of(borrower)
    first, second = Close(), Close()
    await first.until_running()
    await second.until_running()
    _release_when_closed(limiter, borrower, [first.call, second.call])
    got = anyio.Event()
    with anyio.fail_after(GENEROUS_S):
        async with anyio.create_task_group() as group:
            group.start_soon(next_rollout, limiter, got)
            await first.finish()  # heard after the slot's own callback: the drain keeps their order
            await anyio.wait_all_tasks_blocked()
            assert not got.is_set()
            assert limiter.borrowed_tokens == 1
            await second.finish()
            await got.wait()
    assert limiter.borrowed_tokens == 0
    assert errors(caplog) == []


@pytest.mark.parametrize("closes", [0, 1], ids=["no-abandoned-close", "close-already-returned"])
async def test_without_a_close_still_running_the_slot_is_given_back_at_once(anyio_backend, closes):
    limiter = RolloutSlots(Generator()).current(1)
    assert limiter is not None
    borrower = object()
    await limiter.acquire_on_behalf_of(borrower)
    abandoned = [Close() for _ in range(closes)]
    for close in abandoned:
        await close.finish()
        assert close.call.done
    _release_when_closed(limiter, borrower, [close.call for close in abandoned])
    assert limiter.borrowed_tokens == 0  # synchronously: no wake-up needed
