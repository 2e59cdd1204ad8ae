"""The supervisor under attack: interrupts, self-raised cancellation, GeneratorExit, abandoned cleanups, bounds.

Each case is a way real systems break a batch (an env that calls ``sys.exit`` in its worker thread, a
client that raises ``CancelledError`` itself, a close that hangs); every one runs on asyncio and trio.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest
import skyrl_gym

from skyrl_structured import GeneratorInput, RolloutCancelledError, TrajectoryOutput
from skyrl_structured.envs import wait_env_thread_calls
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger, ScriptedEnv

from .helpers import make_batch, make_generator, other_tasks, turn_replies

pytestmark = pytest.mark.anyio


def _engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))


def _raiser(exc: BaseException, *, on_turn: int = 1):
    def hook(turn: int | None = None) -> None:
        if turn is None or turn == on_turn:
            raise exc

    return hook


async def _drain_threads(ledger: EnvLedger | None = None) -> None:
    """Wait for env calls still running in threads and, given a ledger, for every close (queued ones too)."""
    # Both are fed by worker threads: wait on their conditions in a thread.
    if ledger is not None:
        assert await anyio.to_thread.run_sync(ledger.wait_for, lambda: not ledger.never_closed(), 10)
    assert await anyio.to_thread.run_sync(wait_env_thread_calls, 10)


def _sessions_finished(engine: ScriptedEngine) -> None:
    assert engine.started_sessions <= set(engine.finished_sessions)
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions))


# ---------------------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("workers", [0, 4])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["step", "close"])
async def test_interrupt_inside_a_rollout_closes_everything_then_is_reraised_bare(
    tokenizer, anyio_backend, workers, interrupt, where
):
    ledger = EnvLedger()
    engine = _engine(tokenizer)
    gen = make_generator(tokenizer, engine, workers=workers, skip_failed_rollouts=True)
    hook = {"on_step": _raiser(interrupt("boom"))} if where == "step" else {"on_close": _raiser(interrupt("boom"))}
    batch = make_batch(16, ledger, extras={5: hook})
    before = other_tasks()
    with pytest.raises(interrupt) as caught:
        await gen.generate(batch, disable_tqdm=True)
    assert type(caught.value) is interrupt  # bare, never inside an exception group
    await _drain_threads(ledger)
    ledger.assert_all_closed_once()
    _sessions_finished(engine)
    assert other_tasks() == before


# ------------------------------------------------------------------ cancellation nobody of ours caused


class SelfCancellingEngine(ScriptedEngine):
    """Aborts the request of some sessions by raising asyncio's CancelledError itself."""

    def __init__(self, tokenizer, doomed: set[str]) -> None:
        super().__init__(tokenizer, turn_replies("first #### 7", "second #### 8"))
        self.doomed = doomed

    async def generate(self, input_batch, model=None):
        session = input_batch["session_ids"][0]
        if session in self.doomed:
            self.started_sessions.add(session)
            raise asyncio.CancelledError("request aborted by the engine")
        return await super().generate(input_batch, model=model)


async def test_self_raised_cancellation_is_that_rollouts_failure(tokenizer, anyio_backend):
    ledger = EnvLedger()
    engine = SelfCancellingEngine(tokenizer, {"q1_0"})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    before = other_tasks()
    out = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop", "rollout_error", "stop"]
    pad = tokenizer.pad_token_id
    assert out["response_ids"][2] == [pad]
    assert all(out["response_ids"][i] != [pad] for i in (0, 1, 3))
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/failures/RolloutCancelledError"] == 1
    ledger.assert_all_closed_once()
    _sessions_finished(engine)
    assert other_tasks() == before


async def test_self_raised_cancellation_without_skip_raises_a_rollout_error(tokenizer, anyio_backend):
    ledger = EnvLedger()
    engine = SelfCancellingEngine(tokenizer, {"q0_1"})
    gen = make_generator(tokenizer, engine)
    with pytest.raises(RolloutCancelledError, match=r"rollout 1 \(q0_1\) raised CancelledError") as caught:
        await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    ledger.assert_all_closed_once()
    _sessions_finished(engine)


async def test_self_raised_cancellation_is_retried_like_any_failure(tokenizer, anyio_backend):
    engine = SelfCancellingEngine(tokenizer, {"q0_0"})
    original = engine.generate

    async def cancel_once(input_batch, model=None):
        try:
            return await original(input_batch, model=model)
        finally:
            engine.doomed = set()  # the retry's request goes through

    engine.generate = cancel_once  # type: ignore[method-assign]
    ledger = EnvLedger()
    gen = make_generator(tokenizer, engine, max_rollout_retries=1, rollout_retry_backoff_s=0)
    out = await gen.generate(make_batch(1, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/num_rollout_retries"] == 1
    assert ledger.opened == 2
    ledger.assert_all_closed_once()


async def test_real_cancellation_still_propagates(tokenizer, anyio_backend):
    ledger = EnvLedger()
    reached = anyio.Event()

    async def slow(call):
        reached.set()
        await anyio.sleep_forever()

    engine = ScriptedEngine(tokenizer, slow)
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(4, ledger), True)
            await reached.wait()
            scope.cancel()
    assert scope.cancelled_caught
    ledger.assert_all_closed_once()


# ---------------------------------------------------------------------------------------- GeneratorExit


@pytest.mark.parametrize("workers", [0, 4])
async def test_generator_exit_from_close_counts_as_a_close_error(tokenizer, anyio_backend, workers):
    ledger = EnvLedger()
    gen = make_generator(tokenizer, _engine(tokenizer), workers=workers)
    out = await gen.generate(make_batch(4, ledger, extras={2: {"on_close": _raiser(GeneratorExit())}}), True)
    assert out["stop_reasons"] == ["stop"] * 4
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/env_close_errors"] == 1
    assert metrics["generate/num_envs_closed"] == 4
    ledger.assert_all_closed_once()


async def test_generator_exit_from_a_step_is_that_rollouts_failure(tokenizer, anyio_backend):
    ledger = EnvLedger()
    gen = make_generator(tokenizer, _engine(tokenizer), skip_failed_rollouts=True)
    out = await gen.generate(make_batch(4, ledger, extras={3: {"on_step": _raiser(GeneratorExit())}}), True)
    assert out["stop_reasons"] == ["stop", "stop", "stop", "rollout_error"]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/failures/RolloutCancelledError"] == 1
    ledger.assert_all_closed_once()


# ------------------------------------------------------------------------------------ abandoned work


class AsyncStepSyncCloseEnv(ScriptedEnv):
    """Async init/step (an async-style env) but a plain, blocking close."""

    async def init(self, prompt: Any) -> Any:  # type: ignore[override]
        return super().init(prompt)

    async def step(self, action: str) -> Any:  # type: ignore[override]
        return super().step(action)


class LiveCountingEnv(ScriptedEnv):
    """Counts environments alive at once (created, close not yet returned) across the process."""

    lock = threading.Lock()
    live = 0
    peak = 0

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__(env_config, extras)
        with LiveCountingEnv.lock:
            LiveCountingEnv.live += 1
            LiveCountingEnv.peak = max(LiveCountingEnv.peak, LiveCountingEnv.live)

    def close(self) -> None:
        try:
            super().close()
        finally:
            with LiveCountingEnv.lock:
                LiveCountingEnv.live -= 1


class ThreadCountingEnv(ScriptedEnv):
    """Counts env calls running at once in any thread."""

    lock = threading.Lock()
    running = 0
    peak = 0

    def _enter(self) -> None:
        with ThreadCountingEnv.lock:
            ThreadCountingEnv.running += 1
            ThreadCountingEnv.peak = max(ThreadCountingEnv.peak, ThreadCountingEnv.running)

    def _leave(self) -> None:
        with ThreadCountingEnv.lock:
            ThreadCountingEnv.running -= 1

    def step(self, action: str) -> Any:
        self._enter()
        try:
            return super().step(action)
        finally:
            self._leave()

    def close(self) -> None:
        self._enter()
        try:
            super().close()
        finally:
            self._leave()


for _name, _cls in (
    ("tests_async_step_sync_close", AsyncStepSyncCloseEnv),
    ("tests_live_counting", LiveCountingEnv),
    ("tests_thread_counting", ThreadCountingEnv),
):
    if _name not in skyrl_gym.registry:
        skyrl_gym.register(id=_name, entry_point=_cls)


def _with_env(batch: GeneratorInput, env_class: str) -> GeneratorInput:
    batch["env_classes"] = [env_class] * len(batch["prompts"])
    return batch


def _release_later(event: threading.Event, after_s: float) -> threading.Timer:
    # A safety net: a test against a broken generator fails instead of hanging.
    timer = threading.Timer(after_s, event.set)
    timer.daemon = True
    timer.start()
    return timer


async def test_sync_close_of_an_async_env_runs_in_a_thread_and_is_bounded(tokenizer, anyio_backend):
    ledger = EnvLedger()
    release = threading.Event()
    safety = _release_later(release, 20)
    loop_thread = threading.get_ident()
    close_threads: list[int] = []

    def blocking_close() -> None:
        close_threads.append(threading.get_ident())
        release.wait()

    gen = make_generator(tokenizer, _engine(tokenizer), workers=4, env_cleanup_timeout_s=0.2)
    batch = _with_env(
        make_batch(4, ledger, extras={i: {"on_close": blocking_close} for i in range(4)}), "tests_async_step_sync_close"
    )
    out = await gen.generate(batch, disable_tqdm=True)
    freed_by_safety_net = release.is_set()
    release.set()
    safety.cancel()
    assert not freed_by_safety_net, "the event loop was blocked by a synchronous close"
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/env_cleanup_timeouts"] == 4
    assert loop_thread not in close_threads
    await _drain_threads(ledger)
    ledger.assert_all_closed_once()


async def test_close_queued_behind_a_hung_call_still_runs(tokenizer, anyio_backend):
    # One worker thread, held by rollout 0's hung step. generate() is cancelled: every other
    # rollout's close is queued behind that step when its cleanup deadline passes. Each queued close
    # must still run, once, when the thread frees (before, the queued ones were dropped).
    ledger = EnvLedger()
    release = threading.Event()
    safety = _release_later(release, 30)
    held = threading.Event()

    def hang(turn: int) -> None:
        held.set()
        release.wait()

    gen = make_generator(tokenizer, _engine(tokenizer), workers=1, env_cleanup_timeout_s=0.2)
    batch = make_batch(6, ledger, extras={0: {"on_step": hang}})
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, batch, True)
            await anyio.to_thread.run_sync(held.wait)
            scope.cancel()
    assert scope.cancelled_caught
    assert not release.is_set(), "the cancellation waited for the hung step instead of abandoning it"
    assert ledger.opened == 6
    assert ledger.closed < 6  # the thread is still held: the queued closes have not run yet
    release.set()
    safety.cancel()
    await _drain_threads(ledger)
    ledger.assert_all_closed_once()


async def test_max_concurrent_rollouts_counts_environments_whose_close_was_abandoned(tokenizer, anyio_backend):
    ledger = EnvLedger()
    release = threading.Event()
    safety = _release_later(release, 20)
    LiveCountingEnv.live = LiveCountingEnv.peak = 0
    gen = make_generator(tokenizer, _engine(tokenizer), workers=4, max_concurrent_rollouts=2, env_cleanup_timeout_s=0.1)
    hung = {i: {"on_close": release.wait} for i in (0, 1)}
    batch = _with_env(make_batch(6, ledger, extras=hung), "tests_live_counting")

    async def free_after_a_while() -> None:
        await anyio.sleep(0.5)
        release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(free_after_a_while)
        out = await gen.generate(batch, disable_tqdm=True)
    safety.cancel()
    assert out["stop_reasons"] == ["stop"] * 6
    assert LiveCountingEnv.peak <= 2
    await _drain_threads(ledger)
    ledger.assert_all_closed_once()


async def test_max_env_workers_counts_calls_abandoned_in_their_threads(tokenizer, anyio_backend):
    # Batch 1 fails fast while two steps hang in both worker threads; their cleanup is abandoned.
    # Batch 2 then runs while those calls still hold the threads: it must wait for them, never
    # run a third env call at once.
    ledger = EnvLedger()
    release = threading.Event()
    safety = _release_later(release, 20)
    ThreadCountingEnv.running = ThreadCountingEnv.peak = 0
    held = threading.Semaphore(0)

    def hang(turn: int) -> None:
        held.release()
        release.wait()

    gen = make_generator(tokenizer, _engine(tokenizer), workers=2, env_cleanup_timeout_s=0.1)
    # The failing rollout is the first: its init is queued before any step, so the two hanging steps
    # (rollouts 1 and 2) can never take both threads while it still waits for one.
    first = _with_env(
        make_batch(3, ledger, extras={1: {"on_step": hang}, 2: {"on_step": hang}}), "tests_thread_counting"
    )

    async def fail_once_both_are_held() -> None:
        for _ in range(2):
            await anyio.to_thread.run_sync(held.acquire)
        raise ValueError("a sibling failed")

    failing = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    original = failing.generate

    async def generate(input_batch, model=None):
        if input_batch["session_ids"][0] == "q0_0":
            await fail_once_both_are_held()
        return await original(input_batch, model=model)

    failing.generate = generate  # type: ignore[method-assign]
    gen.inference_engine_client = failing
    with pytest.raises(ValueError, match="a sibling failed"):
        await gen.generate(first, disable_tqdm=True)
    assert ThreadCountingEnv.running == 2  # both abandoned steps still hold their threads

    async def free_after_a_while() -> None:
        await anyio.sleep(0.5)
        release.set()

    gen.inference_engine_client = _engine(tokenizer)
    async with anyio.create_task_group() as tg:
        tg.start_soon(free_after_a_while)
        out = await gen.generate(_with_env(make_batch(4, ledger), "tests_thread_counting"), disable_tqdm=True)
    safety.cancel()
    assert out["stop_reasons"] == ["stop"] * 4
    assert ThreadCountingEnv.peak <= 2
    await _drain_threads(ledger)
    ledger.assert_all_closed_once()


async def test_env_code_can_call_back_into_the_loop_with_a_token(tokenizer, anyio_backend):
    ledger = EnvLedger()
    token = anyio.lowlevel.current_token()
    seen: list[int] = []

    def on_step(turn: int) -> None:
        anyio.from_thread.run_sync(lambda: seen.append(threading.get_ident()), token=token)

    gen = make_generator(tokenizer, _engine(tokenizer), workers=2)
    await gen.generate(make_batch(2, ledger, extras={0: {"on_step": on_step}}), disable_tqdm=True)
    assert seen
    assert set(seen) == {threading.get_ident()}
    ledger.assert_all_closed_once()


async def test_env_code_without_a_token_gets_anyios_own_error(tokenizer, anyio_backend):
    # Our env threads are not anyio's worker threads and claim nothing private of anyio's (issue 21):
    # env code passes the loop's token, as the test above does.
    ledger = EnvLedger()

    def on_step(turn: int) -> None:
        anyio.from_thread.run_sync(lambda: None)

    gen = make_generator(tokenizer, _engine(tokenizer), workers=2)
    with pytest.raises(RuntimeError, match="no event loop token was provided"):
        await gen.generate(make_batch(2, ledger, extras={0: {"on_step": on_step}}), disable_tqdm=True)
    ledger.assert_all_closed_once()


# ------------------------------------------------------------------------- the supervisor on its own


def _batch_context() -> Any:
    from skyrl_structured._runtime.contexts import BatchContext

    return BatchContext(generator=None, client=ScriptedEngine.from_replies(None, "never asked"), default_params={})


def _row(token: int) -> TrajectoryOutput:
    """A one-token trajectory that tells rollouts apart by its token."""
    return TrajectoryOutput([token], 0.0, "stop", [1], [0], None, {})


async def test_run_rollouts_keeps_input_order_and_retries_only_failed_attempts(anyio_backend):
    from skyrl_structured._runtime.contexts import BatchShape
    from skyrl_structured._runtime.supervisor import run_rollouts
    from skyrl_structured.config import ResilienceSettings

    attempts: dict[int, int] = {}

    async def rollout(i: int, context: Any) -> TrajectoryOutput:
        attempts[i] = attempts.get(i, 0) + 1
        # Each attempt is handed its own context: its rollout, its attempt number.
        assert (context.ref.index, context.ref.attempt) == (i, attempts[i])
        await anyio.sleep(0.001 * (5 - i))  # finish in reverse order
        if i == 2 and attempts[i] == 1:
            raise ConnectionError("blip")
        if i == 4:
            raise ValueError("always")
        return _row(i)

    settings = ResilienceSettings(skip_failed_rollouts=True, max_rollout_retries=1, rollout_retry_backoff_s=0)
    result = await run_rollouts(BatchShape(5), rollout, settings, _batch_context())
    assert result.results[:4] == [_row(0), _row(1), _row(2), _row(3)]
    (failure,) = result.failures
    assert result.results[4] is failure
    assert (failure.index, failure.attempts, type(failure.exception)) == (4, 2, ValueError)
    assert attempts == {0: 1, 1: 1, 2: 2, 3: 1, 4: 2}
    assert result.retries == 2


async def test_run_rollouts_without_skip_raises_the_first_error_after_cancelling_siblings(anyio_backend):
    from skyrl_structured._runtime.contexts import BatchShape
    from skyrl_structured._runtime.supervisor import run_rollouts
    from skyrl_structured.config import ResilienceSettings

    cancelled: list[int] = []

    async def rollout(i: int, _context: Any) -> TrajectoryOutput:
        if i == 0:
            raise KeyError("first")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(i)
            raise
        return _row(i)

    with pytest.raises(KeyError, match="first"):
        await run_rollouts(BatchShape(4), rollout, ResilienceSettings(), _batch_context())
    assert sorted(cancelled) == [1, 2, 3]


# ------------------------------------------------------------------- deadlines on virtual time (trio)


def _autojump() -> Any:
    import trio.testing

    return pytest.param(("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-autojump")


@pytest.mark.parametrize("anyio_backend", [_autojump()])
async def test_an_hour_long_hang_times_out_at_its_deadline_on_virtual_time(tokenizer, anyio_backend):
    async def hang(call):
        await anyio.sleep(3600)
        return "too late"

    ledger = EnvLedger()
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, hang), workers=0, skip_failed_rollouts=True, rollout_timeout_s=600
    )
    started = anyio.current_time()
    with pytest.raises(RuntimeError, match="All 2 rollouts failed") as caught:
        await gen.generate(make_batch(2, ledger), disable_tqdm=True)
    assert anyio.current_time() - started == pytest.approx(600)
    assert isinstance(caught.value.__cause__, TimeoutError)
    ledger.assert_all_closed_once()


@pytest.mark.parametrize("anyio_backend", [_autojump()])
async def test_retry_backoff_waits_within_its_bound_on_virtual_time(tokenizer, anyio_backend):
    calls: list[float] = []

    def flaky(call):
        calls.append(anyio.current_time())
        if len(calls) < 3:
            raise ConnectionError("blip")
        return "fine #### 7"

    ledger = EnvLedger()
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, flaky), workers=0, max_rollout_retries=2, rollout_retry_backoff_s=100
    )
    out = await gen.generate(make_batch(1, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"]
    first_wait, second_wait = calls[1] - calls[0], calls[2] - calls[1]
    assert 0 <= first_wait <= 100  # full jitter: uniform in [0, base]
    assert 0 <= second_wait <= 200  # then [0, 2 * base]
    ledger.assert_all_closed_once()
