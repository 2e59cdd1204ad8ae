"""Cancelling generate() from outside: every rollout stops, every env is closed once, every session
finished, nothing is left running, and the cancellation (never a placeholder) reaches the caller."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from skyrl_structured.envs import active_env_thread_calls, wait_env_thread_calls
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from tests._hooked_env import hooked_batch

from .helpers import make_batch, make_generator, other_tasks, turn_replies


async def wait_thread_calls_drained() -> None:
    assert await anyio.to_thread.run_sync(wait_env_thread_calls, 10)


async def cancel_when(started: anyio.Event, gen, batch, *, after_cancel: Callable[[], object] | None = None) -> bool:
    """Run generate() in a cancel scope cancelled once ``started`` is set; True if it was cancelled.

    ``after_cancel`` runs right after the cancellation is requested, before generate() can see it:
    what it releases (a blocked step, a slow cleanup) is released strictly after the cancel landed.
    """
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def canceller() -> None:
                await started.wait()
                scope.cancel()
                if after_cancel is not None:
                    after_cancel()

            tg.start_soon(canceller)
            await gen.generate(batch, disable_tqdm=True)
            pytest.fail("generate() returned although it was cancelled")
    return scope.cancelled_caught


@pytest.mark.anyio
@pytest.mark.parametrize("skip", [False, True])
async def test_cancel_while_engine_calls_are_in_flight(tokenizer, anyio_backend, skip):
    ledger = EnvLedger()
    in_flight = 0
    all_waiting = anyio.Event()
    never = anyio.Event()

    async def handler(call):
        nonlocal in_flight
        in_flight += 1
        if in_flight == 4:
            all_waiting.set()
        await never.wait()

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=skip)
    before = other_tasks()
    assert await cancel_when(all_waiting, gen, make_batch(4, ledger))
    assert other_tasks() == before
    ledger.assert_all_closed_once()
    assert ledger.opened == 4
    assert sorted(engine.finished_sessions, key=str) == ["q0_0", "q0_1", "q1_0", "q1_1"]


@pytest.mark.anyio
async def test_cancel_while_a_worker_thread_runs_step_waits_for_it_before_close(tokenizer, anyio_backend):
    ledger = EnvLedger()
    entered = threading.Event()
    release = threading.Event()
    started = anyio.Event()

    def on_step(turn: int) -> None:
        entered.set()
        release.wait(10)

    async def watcher() -> None:
        await anyio.to_thread.run_sync(entered.wait, 10)
        started.set()

    gen = make_generator(tokenizer, workers=2, env_cleanup_timeout_s=10)
    batch = make_batch(1, ledger, extras={0: {"on_step": on_step}})
    async with anyio.create_task_group() as outer:
        outer.start_soon(watcher)
        # The cancellation lands while step is blocked; only then may step finish.
        assert await cancel_when(started, gen, batch, after_cancel=release.set)
    assert release.is_set()
    ledger.assert_all_closed_once()  # includes: close never overlapped the running step
    assert ledger.steps[ledger.created[0]] == 1
    await wait_thread_calls_drained()


@pytest.mark.anyio
async def test_cancel_while_init_runs_in_a_thread(tokenizer, anyio_backend):
    ledger = EnvLedger()
    entered = threading.Event()
    release = threading.Event()
    started = anyio.Event()

    def on_init() -> None:
        entered.set()
        release.wait(10)  # still initialising when the cancellation lands

    async def watcher() -> None:
        await anyio.to_thread.run_sync(entered.wait, 10)
        started.set()

    gen = make_generator(tokenizer, workers=2)
    async with anyio.create_task_group() as outer:
        outer.start_soon(watcher)
        assert await cancel_when(started, gen, hooked_batch(2, ledger, on_init=on_init), after_cancel=release.set)
    ledger.assert_all_closed_once()
    await wait_thread_calls_drained()


@pytest.mark.anyio
async def test_cleanup_finishes_sessions_even_when_cancelled_during_cleanup(tokenizer, anyio_backend):
    ledger = EnvLedger()
    finishing = anyio.Event()
    cancelled = anyio.Event()
    finished = []

    class SlowFinish(ScriptedEngine):
        async def finish_session(self, session_id):
            finishing.set()
            await cancelled.wait()  # shielded: the outer cancellation must not cut this short
            finished.append(session_id)

    engine = SlowFinish(tokenizer, turn_replies("a #### 7", "b #### 8"))
    gen = make_generator(tokenizer, engine)
    assert await cancel_when(finishing, gen, make_batch(2, ledger), after_cancel=cancelled.set)
    assert finished  # the session being finished when the cancel arrived completed its finish
    ledger.assert_all_closed_once()


@pytest.mark.anyio
async def test_hung_close_is_abandoned_after_the_cleanup_timeout(tokenizer, anyio_backend, caplog):
    ledger = EnvLedger()
    release = threading.Event()
    gen = make_generator(tokenizer, workers=2, env_cleanup_timeout_s=0.2)
    out = await gen.generate(hooked_batch(2, ledger, on_close=lambda: release.wait(10)), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]  # finished trajectories are kept
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/env_cleanup_timeouts"] == 2
    assert metrics["generate/num_envs_opened"] == 2
    assert metrics["generate/num_envs_closed"] == 0
    assert sum("did not finish within env_cleanup_timeout_s=0.2s" in r.getMessage() for r in caplog.records) == 2
    release.set()
    await wait_thread_calls_drained()


@pytest.mark.anyio
async def test_close_error_is_noted_on_the_rollout_error(tokenizer, anyio_backend):
    ledger = EnvLedger()

    def handler(call):
        raise ConnectionError("engine down")

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler))
    batch = make_batch(1, ledger, extras={0: {"fail": "close"}})
    with pytest.raises(ConnectionError, match="engine down") as info:
        await gen.generate(batch, disable_tqdm=True)
    (note,) = getattr(info.value, "__notes__", [])
    assert re.fullmatch(
        r"while cleaning up, closing environment 'skyrl_structured_scripted' also failed: RuntimeError: "
        r"scripted env \d+: failing in close \(turn 0\)",
        note,
    )
    ledger.assert_all_closed_once()


@pytest.mark.anyio
async def test_close_error_never_drops_a_finished_trajectory(tokenizer, anyio_backend):
    ledger = EnvLedger()
    gen = make_generator(tokenizer)
    out = await gen.generate(make_batch(2, ledger, extras={1: {"fail": "close"}}), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/env_close_errors"] == 1
    assert out["rollout_metrics"]["generate/num_envs_closed"] == 2


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_during_a_threaded_step_raises_keyboard_interrupt_after_cleanup(tokenizer, backend):
    ledger = EnvLedger()

    def on_step(turn: int) -> None:
        # A real SIGINT, as Ctrl-C delivers it: asyncio's runner cancels the main task, trio raises
        # KeyboardInterrupt in it. Either way every rollout must be cancelled and cleaned up.
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.05)

    engine = ScriptedEngine(tokenizer, turn_replies("a #### 7", "b #### 8"))
    gen = make_generator(tokenizer, engine, workers=2)
    batch = make_batch(3, ledger, extras={1: {"on_step": on_step}})
    # Python's own Ctrl-C handler, whatever the runner inherited (a shell's background job ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            anyio.run(lambda: gen.generate(batch, disable_tqdm=True), backend=backend)
    finally:
        signal.signal(signal.SIGINT, previous)
    ledger.assert_all_closed_once()
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions)) == 3
    assert active_env_thread_calls() == 0


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupt_raised_inside_a_rollout_propagates_bare_on_trio(tokenizer, exc_type):
    # (On asyncio a BaseException raised inside a task escapes the event loop itself; Ctrl-C there is
    # covered by the SIGINT test above.)
    ledger = EnvLedger()

    def on_step(turn: int) -> None:
        raise exc_type()

    gen = make_generator(tokenizer, workers=0)
    batch = make_batch(3, ledger, extras={1: {"on_step": on_step}})
    with pytest.raises(exc_type):
        anyio.run(lambda: gen.generate(batch, disable_tqdm=True), backend="trio")
    ledger.assert_all_closed_once()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_task_cancel_and_wait_for(tokenizer, anyio_backend):
    never = asyncio.Event()
    three_waiting = asyncio.Event()

    async def handler(call):
        if len(engine.calls) == 3:
            three_waiting.set()
        await never.wait()

    for how in ("cancel", "wait_for"):
        ledger = EnvLedger()
        three_waiting.clear()
        engine = ScriptedEngine(tokenizer, handler)
        gen = make_generator(tokenizer, engine)
        task = asyncio.ensure_future(gen.generate(make_batch(3, ledger), disable_tqdm=True))
        if how == "cancel":
            await three_waiting.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(gen.generate(make_batch(3, ledger), disable_tqdm=True), timeout=0.05)
        ledger.assert_all_closed_once()
        assert len(engine.finished_sessions) == len(set(engine.finished_sessions))


def _trio_autojump() -> Any:
    import trio.testing

    return pytest.param(("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-autojump")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [_trio_autojump()])
async def test_trio_cancel_scope(tokenizer, anyio_backend):
    import trio

    ledger = EnvLedger()
    never = trio.Event()

    async def handler(call):
        await never.wait()

    engine = ScriptedEngine(tokenizer, handler)
    # Inline env calls: virtual time moves only once every rollout waits on the engine.
    gen = make_generator(tokenizer, engine, workers=0)
    started = trio.current_time()
    with trio.move_on_after(600) as scope:
        await gen.generate(make_batch(3, ledger), disable_tqdm=True)
    assert scope.cancelled_caught
    assert trio.current_time() - started == pytest.approx(600)
    ledger.assert_all_closed_once()
    assert sorted(engine.finished_sessions, key=str) == ["q0_0", "q0_1", "q1_0"]
    assert trio.lowlevel.current_task().child_nurseries == []


@pytest.mark.anyio
async def test_env_whose_cleanup_was_abandoned_is_closed_when_its_stuck_step_returns(tokenizer, anyio_backend, caplog):
    ledger = EnvLedger()
    release = threading.Event()

    def on_step(turn: int) -> None:
        release.wait(30)

    gen = make_generator(
        tokenizer, workers=2, skip_failed_rollouts=True, rollout_timeout_s=3, env_cleanup_timeout_s=0.2
    )
    out = await gen.generate(make_batch(2, ledger, extras={1: {"on_step": on_step}}), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "rollout_error"]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/env_cleanup_timeouts"] == 1
    # The stuck env is still open: its step is running, and closing now would race it.
    assert len(ledger.never_closed()) == 1
    release.set()
    await wait_thread_calls_drained()
    ledger.assert_all_closed_once()
    assert any("closed an environment after its cleanup was abandoned" in r.getMessage() for r in caplog.records)
