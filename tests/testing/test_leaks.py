"""LeakTracker: each kind of leak is seen, named and cleared; a clean generate() run is clean."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import skyrl_gym
from tqdm import tqdm
from tqdm._monitor import TMonitor

from skyrl_structured._runtime.wakers import LoopWaker
from skyrl_structured.envs import EnvThreadPool
from skyrl_structured.envs._threads import EnvCall
from skyrl_structured.testing import SCRIPTED_ENV, ChaosPolicy, LeakTracker, ScriptedEngine, register_chaos_env
from skyrl_structured.testing._census import thread_states
from skyrl_structured.testing._runners import CaseTracker

from ._helpers import batch, generator


@pytest.mark.anyio
async def test_clean_generate_run_is_clean(tokenizer, anyio_backend):
    tracker = LeakTracker()
    engine = tracker.track_engine(ScriptedEngine.from_replies(tokenizer, "#### 7", "#### 8"))
    env_id = tracker.track_env(SCRIPTED_ENV)
    script = [{"observation": "again", "reward": 0.5}, {"reward": 1.0, "done": True}]
    try:
        async with tracker:
            out = await generator(tokenizer, engine, workers=2).generate(
                batch(env_id, 4, script=script), disable_tqdm=True
            )
        assert out["stop_reasons"] == ["stop"] * 4
        assert tracker.checked
        assert tracker.ledger.opened == 4
        assert tracker.sessions_started == {f"t{i}_0": 2 for i in range(4)}  # two turns each
        assert tracker.sessions_finished == {f"t{i}_0": 1 for i in range(4)}
    finally:
        tracker.close()
    assert env_id not in skyrl_gym.registry


def test_environments_never_closed_or_closed_twice_are_reported():
    tracker = LeakTracker()
    env_id = tracker.track_env("gsm8k")
    extras = {"reward_spec": {"ground_truth": "8"}}
    skyrl_gym.make(env_id, extras=extras)  # never closed
    twice = skyrl_gym.make(env_id, extras=extras)
    twice.close()
    twice.close()
    once = skyrl_gym.make(env_id, extras=extras)
    once.close()
    leaks = tracker.leaks()
    assert leaks == [
        "1 of 3 environments were never closed",
        "1 environments were closed more than once ([2] times)",
    ]
    with pytest.raises(AssertionError, match=r"leaks found:\n  - 1 of 3 environments were never closed\n  - 1 env"):
        tracker.assert_clean()
    tracker.close()


@pytest.mark.anyio
async def test_unfinished_sessions_are_reported_and_retries_must_finish_again(tokenizer, anyio_backend):
    tracker = LeakTracker()
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8", weight_version=5)
    engine = tracker.track_engine(scripted)
    assert engine.weight_version == 5  # everything else is the wrapped engine's
    request = {"prompt_token_ids": [[1], [2]], "session_ids": ["a", "b"], "sampling_params": None}
    await engine.generate(request)
    await engine.finish_session("b")
    assert tracker.open_sessions() == ["a"]
    assert tracker.leaks() == ["1 inference sessions were never finished: 'a'"]
    await engine.finish_session("a")
    assert tracker.leaks() == []
    await engine.generate({"prompt_token_ids": [[1]], "session_ids": ["a"], "sampling_params": None})  # a retry
    assert tracker.open_sessions() == ["a"]
    await engine.finish_session("a")
    assert tracker.sessions_finished == {"a": 2, "b": 1}
    await tracker.assert_clean_async()


@pytest.mark.anyio
async def test_a_task_left_in_a_task_group_is_reported(anyio_backend, anyio_backend_name):
    tracker = LeakTracker()

    async def lingering() -> None:
        await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(lingering)
        await anyio.lowlevel.checkpoint()
        leaks = tracker.task_leaks()
        assert len(leaks) == 1
        assert "lingering" in leaks[0]
        assert leaks[0].startswith(f"task left running: {anyio_backend_name} task")
        group.cancel_scope.cancel()
    assert tracker.task_leaks() == []


@pytest.mark.anyio
async def test_a_detached_task_is_reported(anyio_backend, anyio_backend_name):
    tracker = LeakTracker()
    stop = anyio.Event()

    async def detached() -> None:
        await stop.wait()

    if anyio_backend_name == "asyncio":
        task = asyncio.get_running_loop().create_task(detached())
    else:
        import trio

        trio.lowlevel.spawn_system_task(detached)
    await anyio.lowlevel.checkpoint()
    with pytest.raises(AssertionError, match=r"task left running: .* task .*detached"):
        await tracker.assert_clean_async(grace_s=0)
    stop.set()
    with anyio.fail_after(30):  # only a hang takes this long
        while tracker.task_leaks():  # noqa: ASYNC110 - polling the census is what is under test
            await anyio.sleep(0.01)
    if anyio_backend_name == "asyncio":
        assert task.done()
    await tracker.assert_clean_async()


@pytest.mark.anyio
async def test_async_with_checks_on_exit_unless_the_body_raised(anyio_backend):
    tracker = LeakTracker()
    thread_stop = threading.Event()
    thread = threading.Thread(target=thread_stop.wait, args=(10,), name="leaky-worker")
    with pytest.raises(AssertionError, match=r"thread left running: thread 'leaky-worker' at .*threading.py"):
        async with tracker:
            thread.start()
    with pytest.raises(KeyError):  # the body's own error wins; no leak report on top of it
        async with tracker:
            raise KeyError("body")
    thread_stop.set()
    thread.join(10)
    await tracker.assert_clean_async()


def test_extra_threads_are_reported_idle_pool_workers_are_not():
    stop = threading.Event()
    tracker = LeakTracker()
    ignoring = LeakTracker(ignore_thread=lambda t: t.name == "known-helper")

    async def use_pool() -> None:
        for _ in range(3):
            await anyio.to_thread.run_sync(sum, [1, 2])
        # Idle workers stay for reuse: not leaks. A worker may still be handing its result back
        # (trio's wake-up socket) for a moment after run_sync returned, so the verdict may take a
        # moment; one that stays reported is the bug this catches.
        with anyio.fail_after(30):  # only a hang takes this long
            while tracker.thread_leaks():  # noqa: ASYNC110 - a thread's stack has no event to await
                await anyio.sleep(0.01)

    anyio.run(use_pool, backend="trio")
    daemon = threading.Thread(target=stop.wait, args=(10,), name="leaky-daemon", daemon=True)
    daemon.start()
    helper = threading.Thread(target=stop.wait, args=(10,), name="known-helper")
    helper.start()
    try:
        assert [line.split(" at ")[0] for line in tracker.thread_leaks()] == [
            "thread left running: daemon thread 'leaky-daemon'",
            "thread left running: thread 'known-helper'",
        ]
        assert [line.split(" at ")[0] for line in ignoring.thread_leaks()] == [
            "thread left running: daemon thread 'leaky-daemon'"
        ]
    finally:
        stop.set()
        daemon.join(10)
        helper.join(10)
    tracker.assert_clean()


def test_tqdm_monitor_thread_is_never_a_leak():
    tracker = LeakTracker()
    monitor = TMonitor(tqdm, 10)
    try:
        assert tracker.thread_leaks() == []
    finally:
        monitor.exit()


@pytest.mark.anyio
async def test_thread_states_tell_idle_from_busy_pool_workers(anyio_backend, anyio_backend_name):
    release = threading.Event()
    entered = anyio.Event()

    def blocking() -> None:
        anyio.from_thread.run_sync(entered.set)
        release.wait(10)

    pool = "anyio" if anyio_backend_name == "asyncio" else "trio"
    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, blocking)
        await entered.wait()
        busy = [s for s in thread_states() if s.busy]
        assert len(busy) == 1
        assert busy[0].pool == pool
        # The innermost frame of the code it runs, not the pool's plumbing.
        assert busy[0].where.endswith("in test_thread_states_tell_idle_from_busy_pool_workers.<locals>.blocking")
        release.set()
    with anyio.fail_after(30):  # only a hang takes this long
        while any(s.busy for s in thread_states()):  # noqa: ASYNC110 - a thread's stack has no event to await
            await anyio.sleep(0.01)
    assert any(s.pool == pool and not s.busy for s in thread_states())


@pytest.mark.anyio
async def test_thread_states_know_the_env_thread_pool(anyio_backend):
    """The census names the project's own env workers (it finds their loop by file and name)."""
    release = threading.Event()
    started = threading.Event()

    def blocking() -> None:
        started.set()
        release.wait(10)

    pool = EnvThreadPool(1, name="tests-census-env")
    call = EnvCall(blocking)
    pool.submit(call)
    try:
        await anyio.to_thread.run_sync(started.wait, 10)
        mine = [s for s in thread_states() if s.thread.name.startswith("tests-census-env")]
        assert {s.pool for s in mine} == {"skyrl-structured env"}  # idle ones of an earlier run included
        busy = [s for s in mine if s.busy]
        assert len(busy) == 1
        assert busy[0].where.endswith("in test_thread_states_know_the_env_thread_pool.<locals>.blocking")
    finally:
        release.set()
    with anyio.fail_after(10):
        await call.wait()


@pytest.mark.anyio
async def test_an_env_worker_handing_its_result_back_is_idle_and_its_stack_is_the_censuss(anyio_backend):
    """A worker whose env call returned and that is waking the loop runs no env code: not busy.

    Under load a worker can wait there a while (for the waker's lock, or the CPU). The check used to
    count it busy and blame it on whichever concurrent case looked; here the hand-off is held open
    by holding its waker's lock. The state's ``stack`` is the census's own instant: it still shows
    the hand-off after the worker has moved on.
    """
    waker = LoopWaker(anyio.lowlevel.current_token())  # this call's alone: holding its lock blocks nothing else
    pool = EnvThreadPool(1, name="tests-census-handoff")
    call = EnvCall(lambda: 7, waker=waker)

    def handing_off() -> list[Any]:
        return [
            s
            for s in thread_states()
            if s.thread.name.startswith("tests-census-handoff")
            and any(f.f_code is LoopWaker.__call__.__code__ for f in s.stack)
        ]

    results: list[int] = []

    async def wait() -> None:
        await call.wait()
        results.append(call.result())

    with anyio.fail_after(30):  # only a hang takes this long
        async with anyio.create_task_group() as group:
            group.start_soon(wait)
            await anyio.wait_all_tasks_blocked()  # waiting: the worker will have a wake-up to deliver
            waker._lock.acquire()
            try:
                pool.submit(call)
                while not (states := handing_off()):  # noqa: ASYNC110 - a thread's stack has no event to await
                    await anyio.sleep(0.005)
                (state,) = states
                assert state.pool == "skyrl-structured env"
                assert not state.busy
                assert state.where.endswith("in LoopWaker.__call__")
            finally:
                waker._lock.release()
        assert results == [7]
        while any(f.f_code is LoopWaker.__call__.__code__ for f in current_stack(state.thread)):  # noqa: ASYNC110
            await anyio.sleep(0.005)
    # Gone from the hand-off now, and the state taken then still shows it there.
    assert any(f.f_code is LoopWaker.__call__.__code__ for f in state.stack)


@pytest.mark.anyio
async def test_an_env_worker_handing_off_a_step_with_a_close_chained_after_it_is_busy(anyio_backend):
    """Cleanup gave up on a stuck step and chained the env's close after it: the hand-off is not idle.

    The close runs in that thread next, and until it has the env is open. Counted idle, a check that
    shares its process with other cases (``jobs>1``) found no busy worker and no running call of its
    own in that instant, and reported the env "never closed" (a CI failure: a trio hang-at-step case).
    """
    waker = LoopWaker(anyio.lowlevel.current_token())
    pool = EnvThreadPool(1, name="tests-census-chained")
    release = threading.Event()
    step = EnvCall(release.wait, 30, waker=waker)
    closed: list[str] = []
    close = EnvCall(closed.append, "closed", skippable=False, waker=waker)
    tracker = CaseTracker(shared=True)

    def handing_off() -> list[Any]:
        return [
            s
            for s in thread_states()
            if s.thread.name.startswith("tests-census-chained")
            and any(f.f_code is LoopWaker.__call__.__code__ for f in s.stack)
        ]

    def in_step() -> bool:
        return any(s.busy for s in thread_states() if s.thread.name.startswith("tests-census-chained"))

    with anyio.fail_after(30):  # only a hang takes this long
        async with anyio.create_task_group() as group:
            group.start_soon(step.wait)
            await anyio.wait_all_tasks_blocked()  # waiting: the hand-off will have a wake-up to deliver
            pool.submit(step)
            while not in_step():  # noqa: ASYNC110 - a thread's stack has no event to await
                await anyio.sleep(0.005)
            step.then(close, pool)  # what ChainClose.abandon does when env_cleanup_timeout_s runs out
            waker._lock.acquire()
            try:
                release.set()
                while not (states := handing_off()):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
                (state,) = states
                assert state.busy
                assert closed == []
                assert [line for line in tracker.thread_leaks() if "tests-census-chained" in line] == [
                    f"thread still busy: skyrl-structured env pool worker {state.thread.name!r} at {state.where}"
                ]
            finally:
                waker._lock.release()
        await close.wait()
    assert closed == ["closed"]
    assert step.result() is True


def current_stack(thread: threading.Thread) -> list[Any]:
    frames = []
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


@pytest.mark.anyio
async def test_abandoned_close_shows_as_a_running_env_call_and_a_busy_worker(tokenizer, anyio_backend):
    policy = ChaosPolicy(hang_rate=1.0, stage="close", sync_hang_s=30)
    tracker = LeakTracker()
    env_id = tracker.track_env(register_chaos_env(SCRIPTED_ENV, policy))
    engine = tracker.track_engine(ScriptedEngine.from_replies(tokenizer, "#### 8"))
    try:
        gen = generator(tokenizer, engine, workers=2, env_cleanup_timeout_s=0.1)
        out = await gen.generate(batch(env_id, 2), disable_tqdm=True)
        assert out["rollout_metrics"] is not None
        assert out["rollout_metrics"]["generate/env_cleanup_timeouts"] == 2
        leaks = await tracker.leaks_async(grace_s=0.05)
        assert leaks[0] == "2 environment calls are still running in worker threads"
        busy = [line for line in leaks[1:] if line.startswith("thread still busy:")]
        assert len(busy) == 2
        assert all("chaos.py" in line and "ChaosPolicy.inject" in line for line in busy)
        policy.release_hangs()
        await tracker.assert_clean_async(grace_s=30)
    finally:
        policy.release_hangs()
        tracker.close()
