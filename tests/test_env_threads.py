"""The env worker pool: the bound counts live threads, closes always run, threads never pin the process."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from skyrl_structured.envs import wait_env_thread_calls
from skyrl_structured.envs._threads import EnvCall, EnvThreadPool, active_env_thread_calls

pytestmark = pytest.mark.anyio


async def _until(predicate, limit_s: float = 10.0) -> None:
    with anyio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110 - state changed by threads; nothing to wait on
            await anyio.sleep(0.005)


async def test_calls_run_in_daemon_threads_and_return_their_result(anyio_backend):
    pool = EnvThreadPool(2)
    call = EnvCall(lambda a, b: (a + b, threading.current_thread()), 2, 3)
    pool.submit(call)
    await call.wait()
    value, thread = call.result()
    assert value == 5
    assert thread is not threading.current_thread()
    assert thread.daemon


async def test_no_more_than_max_workers_calls_run_at_once(anyio_backend):
    pool = EnvThreadPool(3)
    lock = threading.Lock()
    running = peak = 0
    release = threading.Event()

    def work() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1

    calls = [EnvCall(work) for _ in range(10)]
    for call in calls:
        pool.submit(call)
    await _until(lambda: running == 3)
    assert pool.threads == 3
    release.set()
    for call in calls:
        await call.wait()
    assert peak == 3


async def test_an_exception_is_handed_back_and_the_thread_survives(anyio_backend):
    pool = EnvThreadPool(1)
    for exc in (ValueError("bad"), KeyboardInterrupt(), SystemExit(2), GeneratorExit()):

        def raise_it(exc: BaseException = exc) -> None:
            raise exc

        call = EnvCall(raise_it)
        pool.submit(call)
        await call.wait()
        with pytest.raises(type(exc)):
            call.result()
    ok = EnvCall(lambda: "still here")
    pool.submit(ok)
    await ok.wait()
    assert ok.result() == "still here"
    assert pool.threads == 1


async def test_a_pending_call_can_be_skipped_but_a_close_cannot(anyio_backend):
    pool = EnvThreadPool(1)
    release = threading.Event()
    ran: list[str] = []
    blocker = EnvCall(release.wait, 10)
    step = EnvCall(lambda: ran.append("step"))
    close = EnvCall(lambda: ran.append("close"), skippable=False)
    for call in (blocker, step, close):
        pool.submit(call)
    assert step.skip()
    assert step.done
    assert not close.skip()
    release.set()
    await close.wait()
    assert ran == ["close"]


async def test_a_waiter_cancelled_leaves_the_call_running(anyio_backend):
    pool = EnvThreadPool(1)
    release, started = threading.Event(), threading.Event()

    def work() -> bool:
        started.set()
        return release.wait(10)

    call = EnvCall(work, skippable=False)
    pool.submit(call)
    with anyio.move_on_after(0.05):
        await call.wait()
    assert await anyio.to_thread.run_sync(started.wait, 10)
    assert not call.done
    assert active_env_thread_calls() >= 1
    release.set()
    await call.wait()
    assert call.result() is True


async def test_then_runs_the_follower_in_the_same_thread_right_after(anyio_backend):
    pool = EnvThreadPool(2)
    release, started = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def first() -> None:
        threads.append(threading.current_thread())
        started.set()
        release.wait(10)

    call = EnvCall(first)
    follower = EnvCall(lambda: threads.append(threading.current_thread()), skippable=False)
    pool.submit(call)
    assert await anyio.to_thread.run_sync(started.wait, 10)
    call.then(follower, pool)
    release.set()
    await follower.wait()
    assert threads[0] is threads[1]
    # Chained after a call already done, the follower is simply submitted.
    late = EnvCall(lambda: "late", skippable=False)
    call.then(late, pool)
    await late.wait()
    assert late.result() == "late"


async def test_idle_threads_exit(anyio_backend):
    pool = EnvThreadPool(4, idle_s=0.05)
    calls = [EnvCall(time.sleep, 0.01) for _ in range(4)]
    for call in calls:
        pool.submit(call)
    for call in calls:
        await call.wait()
    await _until(lambda: pool.threads == 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_call_finishing_after_its_event_loop_ended_is_harmless(backend):
    pool = EnvThreadPool(1)
    release = threading.Event()
    box: dict[str, EnvCall[bool]] = {}

    async def main() -> None:
        call = EnvCall(release.wait, 10)
        box["call"] = call
        pool.submit(call)
        with anyio.move_on_after(0.05):
            await call.wait()

    anyio.run(main, backend=backend)
    release.set()
    deadline = time.monotonic() + 10
    while not box["call"].done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert box["call"].result() is True

    async def again() -> str:
        call = EnvCall(lambda: "next loop")
        pool.submit(call)
        await call.wait()
        return call.result()

    assert anyio.run(again, backend=backend) == "next loop"


def test_pool_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        EnvThreadPool(0)


async def test_calls_that_need_each_other_run_together_across_idle_timeouts(anyio_backend):
    # Threads timing out as idle while calls arrive must never leave a queued call with no thread
    # coming: each round needs both calls running at once (a barrier of two) to finish.
    pool = EnvThreadPool(2, idle_s=0.01)
    for round_ in range(40):
        barrier = threading.Barrier(2, timeout=10)
        calls = [EnvCall(barrier.wait) for _ in range(2)]
        for call in calls:
            pool.submit(call)
        for call in calls:
            with anyio.fail_after(20):
                await call.wait()
            call.result()  # BrokenBarrierError if the other call never ran alongside
        await anyio.sleep(0.005 * (round_ % 4))


async def test_wait_env_thread_calls_waits_for_a_running_call_and_says_whether_it_returned(anyio_backend):
    pool = EnvThreadPool(1)
    release, started = threading.Event(), threading.Event()

    def blocking() -> None:
        started.set()
        release.wait(10)

    call = EnvCall(blocking)
    pool.submit(call)
    assert await anyio.to_thread.run_sync(started.wait, 10)
    assert not await anyio.to_thread.run_sync(wait_env_thread_calls, 0.05)  # still running: timed out
    release.set()
    assert await anyio.to_thread.run_sync(wait_env_thread_calls, 10)
    assert active_env_thread_calls() == 0
    await call.wait()


async def test_a_chained_close_counts_as_running_from_the_moment_its_call_returns(anyio_backend):
    # A close chained after a stuck step runs in the same thread right after it: waiting for no env
    # call to run must not return in between (the step done, the close not yet started). A slow
    # completion hand-off of the step (a scheduler that takes 50 ms) holds that moment open.
    pool = EnvThreadPool(1)
    release, closed, started = threading.Event(), threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(10)

    step = EnvCall(stuck)
    close = EnvCall(closed.set, skippable=False)
    pool.submit(step)
    step.then(close, pool)
    assert step.add_done_callback(lambda callback: time.sleep(0.05), lambda: None)
    assert await anyio.to_thread.run_sync(started.wait, 10)
    seen: list[tuple[bool, bool]] = []

    def waiter() -> None:
        returned = wait_env_thread_calls(10)
        seen.append((returned, closed.is_set()))

    thread = threading.Thread(target=waiter)
    thread.start()
    release.set()
    await anyio.to_thread.run_sync(thread.join, 10)
    await close.wait()
    assert seen == [(True, True)]
