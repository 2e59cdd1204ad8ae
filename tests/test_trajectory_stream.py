"""Finished rollouts reach observers and ``TrajectoryStream`` as they land: each once, failures included."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import pytest
import sniffio

from skyrl_structured import (
    ROLLOUT_ERROR_STOP_REASON,
    FinishedTrajectory,
    GeneratorOutput,
    RolloutObserver,
    TrajectoryStream,
)
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

from .helpers import make_batch, make_generator

pytestmark = pytest.mark.anyio

#: Where an observer's failure is logged; a test about it counts this logger's records and no others.
OBSERVE_LOGGER = "skyrl_structured.observe"


def _as_on_a_slow_machine() -> None:
    """On asyncio (debug mode), log every loop step as slow, as a busy machine makes asyncio do.

    asyncio's debug mode logs "Executing <Task ...> took 0.112 seconds" at WARNING for a step
    slower than ``slow_callback_duration`` (0.1 s); on a loaded machine any step may be. With the
    threshold at 0 every step logs it here, so a test that counted all of ``caplog.records``
    fails on every run rather than on a busy machine only.
    """
    if sniffio.current_async_library() == "asyncio":
        asyncio.get_running_loop().slow_callback_duration = 0.0


def _records_of(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    """The captured records of logger ``name`` (and its children): not asyncio's, not anyone else's."""
    return [r for r in caplog.records if r.name == name or r.name.startswith(name + ".")]


def _assert_matches_output(record: FinishedTrajectory, output: GeneratorOutput) -> None:
    """A successful record carries exactly the row ``generate()`` returned for its rollout."""
    i = record.index
    (step,) = record.steps
    assert list(step.prompt_ids) == output["prompt_token_ids"][i]
    assert list(step.response_ids) == output["response_ids"][i]
    assert list(step.loss_mask) == output["loss_masks"][i]
    reward = output["rewards"][i]
    assert step.reward == (tuple(reward) if isinstance(reward, list) else reward)
    assert step.stop_reason == record.stop_reason == (output["stop_reasons"] or [])[i]
    logprobs = output["rollout_logprobs"]
    assert step.logprobs == (tuple(logprobs[i]) if logprobs is not None else None)


async def test_every_rollout_arrives_once_while_the_batch_still_runs(tokenizer, anyio_backend):
    # Rollout 0's only engine call waits until the consumer has received rollout 2's record:
    # the stream must hand over finished rollouts before the batch is over, or this never ends.
    seen_two = anyio.Event()
    calls: dict[Any, int] = {}

    async def handler(call: EngineCall) -> str:
        calls[call.session_id] = calls.get(call.session_id, 0) + 1
        if call.session_id == "q0_0":
            await seen_two.wait()
        if call.session_id == "q0_1" and calls["q0_1"] == 1:
            raise ConnectionError("blip")  # retried once, then fine
        if call.session_id == "q1_1":
            raise ConnectionError("sandbox lost")  # fails on every attempt: a failed record
        return "an answer #### 7"

    generator = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        skip_failed_rollouts=True,
        max_rollout_retries=1,
        rollout_retry_backoff_s=0,
        failed_rollout_policy="placeholder",
    )
    stream = TrajectoryStream()
    generator.observers.append(stream)
    batch = make_batch(4, EnvLedger())
    received: list[FinishedTrajectory] = []
    output: list[GeneratorOutput] = []

    async def consume() -> None:
        async for record in stream:
            received.append(record)
            if record.index == 2:
                seen_two.set()

    async def produce() -> None:
        output.append(await generator.generate(batch, disable_tqdm=True))

    with anyio.fail_after(120):  # a guard against a hang, not a timing assertion
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(produce)

    (out,) = output
    assert sorted(r.index for r in received) == [0, 1, 2, 3]
    assert received.index(next(r for r in received if r.index == 2)) < [r.index for r in received].index(0)
    assert stream.delivered == 4
    by_index = {r.index: r for r in received}
    ids = batch.get("trajectory_ids")
    assert ids is not None
    for i, record in by_index.items():
        assert record.trajectory_id == ids[i]
        assert record.env_class == SCRIPTED_ENV
        assert record.elapsed >= 0
    for i in (0, 1, 2):
        assert not by_index[i].failed
        _assert_matches_output(by_index[i], out)
    assert by_index[1].attempts == 2
    assert [by_index[i].attempts for i in (0, 2)] == [1, 1]
    failed = by_index[3]
    assert failed.failed
    assert failed.error == "ConnectionError: sandbox lost"
    assert failed.steps == ()
    assert failed.attempts == 2
    assert (failed.reward, failed.stop_reason) == (0.0, ROLLOUT_ERROR_STOP_REASON)
    assert out["stop_reasons"] == ["stop", "stop", "stop", ROLLOUT_ERROR_STOP_REASON]


async def test_a_stream_read_after_the_batch_holds_every_record_then_ends(tokenizer, anyio_backend):
    generator = make_generator(tokenizer)
    stream = TrajectoryStream()
    generator.observers.append(stream)
    out = await generator.generate(make_batch(3, EnvLedger()), disable_tqdm=True)
    records = [record async for record in stream]
    assert sorted(r.index for r in records) == [0, 1, 2]
    for record in records:
        _assert_matches_output(record, out)
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()


async def test_the_iteration_ends_when_a_failure_stops_the_batch(tokenizer, anyio_backend):
    # Without skip_failed_rollouts the first failure cancels the rest and generate() raises it;
    # the iteration still ends, after the rollouts that finished before.
    first_done = anyio.Event()

    async def handler(call: EngineCall) -> str:
        if call.session_id == "q0_1":
            await first_done.wait()
            raise ConnectionError("engine gone")
        if call.session_id != "q0_0":
            await anyio.sleep_forever()
        return "an answer #### 7"

    class Ends(RolloutObserver):
        def __init__(self) -> None:
            self.aborted: list[str] = []

        def trajectory_finished(self, rollout, trajectory):
            if trajectory.index == 0:
                first_done.set()

        def batch_aborted(self, size, error):
            self.aborted.append(f"{size} {type(error).__name__}")

    ledger = EnvLedger()
    generator = make_generator(tokenizer, ScriptedEngine(tokenizer, handler))
    stream = TrajectoryStream()
    ends = Ends()
    generator.observers.extend([stream, ends])
    received: list[FinishedTrajectory] = []

    async def consume() -> None:
        async for record in stream:
            received.append(record)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with pytest.raises(ConnectionError, match="engine gone"):
                await generator.generate(make_batch(4, ledger), disable_tqdm=True)

    # The failed rollout is recorded too: it is final (no retries) before the batch stops.
    assert sorted((r.index, r.failed) for r in received) == [(0, False), (1, True)]
    assert ends.aborted == ["4 ConnectionError"]
    assert all(count == 1 for count in ledger.closes.values())


async def test_cancelling_the_consumer_and_the_batch_propagates_and_closes_every_env(tokenizer, anyio_backend):
    async def handler(call: EngineCall) -> str:
        if call.session_id in ("q0_0", "q0_1"):
            return "an answer #### 7"
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    ledger = EnvLedger()
    generator = make_generator(tokenizer, ScriptedEngine(tokenizer, handler), skip_failed_rollouts=True)
    stream = TrajectoryStream()
    generator.observers.append(stream)
    received: list[FinishedTrajectory] = []
    reached: list[str] = []

    async def consume(scope: anyio.CancelScope) -> None:
        async for record in stream:
            received.append(record)
            if len(received) == 2:
                scope.cancel()  # e.g. the trainer has what it needs
        reached.append("consumer loop ended without cancellation")

    async def produce() -> None:
        await generator.generate(make_batch(4, ledger), disable_tqdm=True)
        reached.append("generate returned")

    with anyio.fail_after(120):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, scope)
                tg.start_soon(produce)
    assert scope.cancelled_caught
    assert reached == []  # both sides were cancelled: neither finished normally
    assert sorted(r.index for r in received) == [0, 1]
    assert len(ledger.created) == 4
    assert all(count == 1 for count in ledger.closes.values())
    # The batch was aborted: the stream is closed for writing, what is left reads as its end.
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()


async def test_a_consumer_that_stops_listening_changes_nothing(tokenizer, anyio_backend, caplog):
    generator = make_generator(tokenizer)
    stream = TrajectoryStream()
    generator.observers.append(stream)
    async with stream:
        pass  # closed before any rollout finished
    _as_on_a_slow_machine()
    with caplog.at_level(logging.ERROR, logger=OBSERVE_LOGGER):
        out = await generator.generate(make_batch(3, EnvLedger()), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3
    assert stream.delivered == 0
    assert not _records_of(caplog, OBSERVE_LOGGER)


async def test_one_stream_serves_one_call(tokenizer, anyio_backend, caplog):
    _as_on_a_slow_machine()
    generator = make_generator(tokenizer)
    stream = TrajectoryStream()
    generator.observers.append(stream)
    await generator.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    with caplog.at_level(logging.ERROR, logger=OBSERVE_LOGGER):
        out = await generator.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]
    (logged,) = _records_of(caplog, OBSERVE_LOGGER)
    assert "batch_started" in logged.getMessage()
    assert logged.exc_info is not None
    assert "create a new TrajectoryStream for each call" in str(logged.exc_info[1])
    assert len([record async for record in stream]) == 2  # the first call's, and nothing more


async def test_the_event_is_built_only_for_observers_that_want_it(tokenizer, anyio_backend):
    class Counter(RolloutObserver):
        def __init__(self) -> None:
            self.records: list[FinishedTrajectory] = []

        def trajectory_finished(self, rollout, trajectory):
            assert rollout.index == trajectory.index
            assert rollout.trajectory_id == trajectory.trajectory_id
            self.records.append(trajectory)

    generator = make_generator(tokenizer)
    counter = Counter()
    generator.observers.append(counter)
    out = await generator.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert sorted(r.index for r in counter.records) == [0, 1]
    for record in counter.records:
        _assert_matches_output(record, out)
        with pytest.raises(AttributeError):
            record.index = 5  # type: ignore[misc]  # frozen: a record cannot be changed under another observer
