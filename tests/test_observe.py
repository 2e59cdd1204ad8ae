"""Observers hear every step of every rollout, in order, and can never change a batch's outcome."""

from __future__ import annotations

import io
import logging
from collections.abc import Collection
from typing import Any

import anyio
import pytest

from skyrl_structured import RolloutObserver, RolloutRef
from skyrl_structured.progress import Progress
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, turn_replies

pytestmark = pytest.mark.anyio


class Recorder(RolloutObserver):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def batch_started(self, size):
        self.events.append(("batch_started", size))

    def attempt_started(self, rollout: RolloutRef):
        self.events.append(("attempt_started", rollout.index, rollout.attempt))

    def env_opened(self, rollout):
        self.events.append(("env_opened", rollout.index, rollout.attempt))

    def attempt_finished(self, rollout, elapsed):
        assert elapsed >= 0
        self.events.append(("attempt_finished", rollout.index, rollout.attempt))

    def attempt_failed(self, rollout, error, elapsed, *, timed_out, will_retry):
        self.events.append(
            ("attempt_failed", rollout.index, rollout.attempt, type(error).__name__, timed_out, will_retry)
        )

    def attempt_cancelled(self, rollout):
        self.events.append(("attempt_cancelled", rollout.index, rollout.attempt))

    def cleanup_finished(self, rollout, kind, outcome, error):
        self.events.append(("cleanup", rollout.index, rollout.attempt, kind, outcome, rollout.session_id))

    def rollout_finished(self, rollout, *, failed):
        self.events.append(("rollout_finished", rollout.index, failed))

    def batch_finished(self, size, failed):
        self.events.append(("batch_finished", size, failed))

    def of(self, index: int) -> list[tuple[Any, ...]]:
        return [
            e for e in self.events if len(e) > 1 and e[0] not in ("batch_started", "batch_finished") and e[1] == index
        ]


def _engine(tokenizer, fail_first: Collection[str] = frozenset()):
    calls: dict[str, int] = {}

    def handler(call):
        calls[call.session_id] = calls.get(call.session_id, 0) + 1
        if call.session_id in fail_first and calls[call.session_id] == 1:
            raise ConnectionError(f"blip for {call.session_id}")
        return "an answer #### 7"

    return ScriptedEngine(tokenizer, handler)


async def test_events_of_a_clean_rollout_in_order(tokenizer, anyio_backend):
    recorder = Recorder()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, turn_replies("a #### 7", "b #### 8")))
    gen.observers.append(recorder)
    await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert recorder.events[0] == ("batch_started", 2)
    assert recorder.events[-1] == ("batch_finished", 2, 0)
    assert recorder.of(1) == [
        ("attempt_started", 1, 1),
        ("env_opened", 1, 1),
        ("cleanup", 1, 1, "env_close", "ok", "q0_1"),
        ("cleanup", 1, 1, "finish_session", "ok", "q0_1"),
        ("attempt_finished", 1, 1),
        ("rollout_finished", 1, False),
    ]


async def test_events_of_a_retried_and_a_failed_rollout(tokenizer, anyio_backend):
    recorder = Recorder()
    engine = _engine(tokenizer, fail_first={"q0_0"})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True, max_rollout_retries=1, rollout_retry_backoff_s=0)
    gen.observers.append(recorder)
    batch = make_batch(2, EnvLedger(), extras={1: {"fail": "init"}})
    out = await gen.generate(batch, disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "rollout_error"]
    assert recorder.of(0) == [
        ("attempt_started", 0, 1),
        ("env_opened", 0, 1),
        ("cleanup", 0, 1, "env_close", "ok", "q0_0"),
        ("cleanup", 0, 1, "finish_session", "ok", "q0_0"),
        ("attempt_failed", 0, 1, "ConnectionError", False, True),
        ("attempt_started", 0, 2),
        ("env_opened", 0, 2),
        ("cleanup", 0, 2, "env_close", "ok", "q0_0"),
        ("cleanup", 0, 2, "finish_session", "ok", "q0_0"),
        ("attempt_finished", 0, 2),
        ("rollout_finished", 0, False),
    ]
    failed_attempts = [e for e in recorder.of(1) if e[0] == "attempt_failed"]
    assert failed_attempts == [
        ("attempt_failed", 1, 1, "RuntimeError", False, True),
        ("attempt_failed", 1, 2, "RuntimeError", False, False),
    ]
    assert recorder.of(1)[-1] == ("rollout_finished", 1, True)
    assert recorder.events[-1] == ("batch_finished", 2, 1)


async def test_a_timed_out_attempt_is_reported_as_such(tokenizer, anyio_backend):
    recorder = Recorder()

    async def slow(call):
        await anyio.sleep_forever()

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, slow), skip_failed_rollouts=True, rollout_timeout_s=0.05)
    gen.observers.append(recorder)
    with pytest.raises(RuntimeError, match="All 1 rollouts failed"):
        await gen.generate(make_batch(1, EnvLedger()), disable_tqdm=True)
    assert ("attempt_failed", 0, 1, "TimeoutError", True, False) in recorder.events


async def test_cancelled_attempts_are_reported_and_no_batch_finished(tokenizer, anyio_backend):
    recorder = Recorder()
    started = anyio.Event()

    async def hang(call):
        started.set()
        await anyio.sleep_forever()

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, hang))
    gen.observers.append(recorder)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(2, EnvLedger()), True)
            await started.wait()
            scope.cancel()
    cancelled = sorted(e for e in recorder.events if e[0] == "attempt_cancelled")
    assert cancelled == [("attempt_cancelled", 0, 1), ("attempt_cancelled", 1, 1)]
    assert not any(e[0] in ("batch_finished", "rollout_finished") for e in recorder.events)


async def test_an_observer_that_raises_is_skipped_and_changes_nothing(tokenizer, anyio_backend, caplog):
    class Broken(RolloutObserver):
        calls = 0

        def attempt_started(self, rollout):
            Broken.calls += 1
            raise ValueError("observer bug")

    recorder = Recorder()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, turn_replies("a #### 7", "b #### 8")))
    gen.observers.extend([Broken(), recorder])
    with caplog.at_level(logging.ERROR, logger="skyrl_structured.observe"):
        out = await gen.generate(make_batch(3, EnvLedger()), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3
    assert Broken.calls == 1
    assert len([r for r in caplog.records if "observer" in r.getMessage()]) == 1
    assert len([e for e in recorder.events if e[0] == "attempt_started"]) == 3


async def test_the_trajectory_comes_before_the_outcome_and_an_aborted_batch_says_so(tokenizer, anyio_backend):
    events: list[tuple[str, int, Any]] = []

    class Ends(RolloutObserver):
        def trajectory_finished(self, rollout, trajectory):
            events.append(("trajectory_finished", rollout.index, trajectory.failed))

        def rollout_finished(self, rollout, *, failed):
            events.append(("rollout_finished", rollout.index, failed))

        def batch_finished(self, size, failed):
            events.append(("batch_finished", size, failed))

        def batch_aborted(self, size, error):
            events.append(("batch_aborted", size, type(error).__name__))

    engine = _engine(tokenizer, fail_first={"q0_1"})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    gen.observers.append(Ends())
    await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert sorted(events[:4]) == [
        ("rollout_finished", 0, False),
        ("rollout_finished", 1, True),
        ("trajectory_finished", 0, False),
        ("trajectory_finished", 1, True),
    ]
    for index in (0, 1):
        mine = [e[0] for e in events if e[1] == index and e[0] != "batch_finished"]
        assert mine == ["trajectory_finished", "rollout_finished"]
    assert events[-1] == ("batch_finished", 2, 1)

    events.clear()
    strict = make_generator(tokenizer, _engine(tokenizer, fail_first={"q0_0"}))
    strict.observers.append(Ends())
    with pytest.raises(ConnectionError):
        await strict.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    aborted = [e for e in events if e[0] == "batch_aborted"]
    assert aborted == [("batch_aborted", 2, "ConnectionError")]
    assert not any(e[0] == "batch_finished" for e in events)


async def test_the_progress_bar_shows_the_attempts_in_flight(tokenizer, anyio_backend):
    all_started = anyio.Event()
    seen: list[int] = []
    text = io.StringIO()
    progress = Progress(3, disable=False, file=text)

    async def handler(call):
        seen.append(progress.in_flight)
        if len(seen) == 3:
            all_started.set()
        await all_started.wait()
        return "an answer #### 7"

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler))
    gen.observers.append(progress)
    await gen.generate(make_batch(3, EnvLedger()), disable_tqdm=True)
    assert progress.postfix() == f"in_flight=0, calls={len(seen)}"
    assert max(seen) == 3  # all three attempts were running at once
    progress.close()
    assert "3/3" in text.getvalue()
    assert "in_flight=0" in text.getvalue()


async def test_the_progress_bar_counts_calls_before_any_rollout_finishes(tokenizer, anyio_backend):
    # An agent's rollout makes several long calls: the bar must move before the first rollout ends.
    text = io.StringIO()
    progress = Progress(2, disable=False, file=text)
    gen = make_generator(tokenizer)
    gen.observers.append(progress)
    await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    progress.close()
    renders = text.getvalue().split("\r")
    # The first call that came back is drawn at once, while no rollout has finished: whatever the speed.
    assert any("0/2" in render and "calls=1" in render for render in renders), renders
    assert progress.calls == 4  # two turns per rollout
    assert "2/2" in renders[-1]


async def test_an_attempt_cancelled_before_its_slot_is_never_in_flight(tokenizer, anyio_backend):
    started = anyio.Event()

    async def hang(call):
        started.set()
        await anyio.sleep_forever()

    progress = Progress(3, disable=True)
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, hang), max_concurrent_rollouts=1)
    gen.observers.append(progress)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(3, EnvLedger()), True)
            await started.wait()
            assert progress.in_flight == 1
            scope.cancel()
    assert progress.in_flight == 0


@pytest.mark.parametrize("event", ["batch_started", "attempt_started"])
async def test_an_observer_raising_cancelled_error_is_an_observer_bug_not_a_hole(
    tokenizer, anyio_backend, caplog, event
):
    """A sync method cannot be cancelled by a scope: its CancelledError is logged and skipped (issue 27).

    It once escaped into the loop-lag sampler's task group on asyncio, which swallowed it, and
    ``generate()`` raised ``IndexError``; on trio it came out of ``generate()`` bare.
    """
    import asyncio

    class Cancelling(RolloutObserver):
        calls = 0

        def _cancel(self, *args: Any) -> None:
            Cancelling.calls += 1
            raise asyncio.CancelledError

    setattr(Cancelling, event, Cancelling._cancel)
    recorder = Recorder()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, turn_replies("a #### 7", "b #### 8")))
    gen.observers.extend([Cancelling(), recorder])
    with caplog.at_level(logging.ERROR, logger="skyrl_structured.observe"):
        out = await gen.generate(make_batch(3, EnvLedger()), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3
    assert Cancelling.calls == 1
    assert [r.getMessage() for r in caplog.records if "observer" in r.getMessage()] == [
        f"observer {gen.observers[0]!r} raised in {event}; it is skipped for the rest of this generate() call"
    ]
    assert ("batch_finished", 3, 0) in recorder.events
