"""Deadlines measure work, not a weight sync: ``generator.pause()`` stops their clocks (design rule 16).

Short real times stand in for long ones (a 2.5 s pause against a 1.5 s deadline for "a 5 s pause
with rollout_timeout_s=2"); every assertion is about outcomes, never about how long anything took.
The deadline is also the bound of each rollout's work outside the pause: generous on a loaded machine.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON
from skyrl_structured._runtime.pauses import PauseClock
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.testing.vllm_server import serve_vllm

from .helpers import make_batch, make_generator, not_none, turn_replies

pytestmark = pytest.mark.anyio

TIMEOUT = 1.5
PAUSE = 2.5  # longer than TIMEOUT: a deadline that counted the pause would fire


class Gate:
    """An engine handler whose first call per session waits for ``open``; ``hung`` sessions never answer."""

    def __init__(self, sessions: int, hung: frozenset[str] = frozenset()) -> None:
        self.sessions = sessions
        self.hung = hung
        self.waiting: set[Any] = set()
        self.all_waiting = anyio.Event()
        self.open = anyio.Event()
        self.replies = turn_replies("first #### 7", "second #### 8")

    async def __call__(self, call: EngineCall) -> str:
        if call.session_id in self.hung:
            await anyio.sleep_forever()
        if call.session_id not in self.waiting:
            self.waiting.add(call.session_id)
            if len(self.waiting) == self.sessions:
                self.all_waiting.set()
            await self.open.wait()
        return self.replies(call)


def timed_out(out: Any) -> int:
    return int(not_none(out["rollout_metrics"])["generate/num_timed_out_rollouts"])


async def test_a_pause_longer_than_the_deadline_times_nothing_out(tokenizer, anyio_backend):
    gate = Gate(4)
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, gate), rollout_timeout_s=TIMEOUT, skip_failed_rollouts=True
    )
    ledger = EnvLedger()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gate.all_waiting.wait()  # every rollout is in flight in the engine
            async with gen.paused():
                await anyio.sleep(PAUSE)
                gate.open.set()  # the engine answers during the pause; calls in flight go on
    out = result["out"]
    assert out["stop_reasons"] == ["stop"] * 4
    assert timed_out(out) == 0
    assert not gen.pauses.paused
    ledger.assert_all_closed_once()


async def test_a_rollout_hung_outside_the_pause_still_times_out(tokenizer, anyio_backend):
    gate = Gate(3, hung=frozenset({"q1_1"}))
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, gate), rollout_timeout_s=TIMEOUT, skip_failed_rollouts=True
    )
    ledger = EnvLedger()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gate.all_waiting.wait()
            gen.pause()
            await anyio.sleep(PAUSE)
            gate.open.set()
            gen.resume()
    out = result["out"]
    assert out["stop_reasons"] == ["stop", "stop", "stop", ROLLOUT_ERROR_STOP_REASON]
    assert timed_out(out) == 1
    ledger.assert_all_closed_once()


async def test_nested_and_overlapping_pauses_are_counted(tokenizer, anyio_backend):
    gate = Gate(3, hung=frozenset({"q1_1"}))
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, gate), rollout_timeout_s=TIMEOUT, skip_failed_rollouts=True
    )
    result: dict[str, Any] = {}
    ledger = EnvLedger()

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    async def weight_sync(started: anyio.Event, release: anyio.Event) -> None:
        async with gen.paused():
            started.set()
            await release.wait()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gate.all_waiting.wait()
            started, release = anyio.Event(), anyio.Event()
            gen.pause()  # a user's pause ...
            gen.pause()  # ... nested ...
            group.start_soon(weight_sync, started, release)  # ... and a weight sync overlapping it
            await started.wait()
            assert gen.pauses.depth == 3
            gen.resume()
            gen.resume()  # the user's pauses are released, the sync's is still held
            await anyio.sleep(PAUSE)
            assert "out" not in result  # the hung rollout has not timed out: its clock is stopped
            gate.open.set()
            release.set()
    out = result["out"]
    assert gen.pauses.depth == 0
    # Once the last pause was released the hung rollout's clock ran again, and it timed out.
    assert out["stop_reasons"] == ["stop", "stop", "stop", ROLLOUT_ERROR_STOP_REASON]
    assert timed_out(out) == 1
    with pytest.raises(RuntimeError, match=r"resume\(\) without a matching pause\(\)"):
        gen.resume()


async def test_a_pause_never_resumed_is_reported_once(tokenizer, anyio_backend, caplog):
    gate = Gate(2)
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, gate), rollout_timeout_s=TIMEOUT, skip_failed_rollouts=True
    )
    gen.pauses.warn_after_s = 0.1
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "skyrl_structured._runtime.pauses" and r.levelno == logging.WARNING
        ]

    with caplog.at_level(logging.WARNING, logger="skyrl_structured._runtime.pauses"), anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gate.all_waiting.wait()
            gen.pause()
            while not warnings():  # noqa: ASYNC110 - polling the log is the point
                await anyio.sleep(0.02)
            await anyio.sleep(0.2)  # one warning per pause, however long it lasts
            gate.open.set()
            gen.resume()
    (warning,) = warnings()
    assert warning.startswith("the generator has been paused for ")
    assert "and not resumed: rollout deadlines, HTTPEngine request timeouts and the straggler grace stay" in warning
    assert result["out"]["stop_reasons"] == ["stop", "stop"]


async def test_httpengine_request_timeout_stops_while_the_generator_is_paused(tokenizer, anyio_backend):
    gate = Gate(2)
    served = ScriptedEngine(tokenizer, gate)
    async with serve_vllm(served, model="m") as server, HTTPEngine(server.url, "m", timeout_s=TIMEOUT) as engine:
        gen = make_generator(tokenizer, engine, skip_failed_rollouts=True, failure_budget_action="warn")
        result: dict[str, Any] = {}

        async def run() -> None:
            result["out"] = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(run)
                await gate.all_waiting.wait()
                async with gen.paused():
                    await anyio.sleep(PAUSE)
                    gate.open.set()
        # And without a pause the same wait fails: the timeout is still there.
        gate.open = anyio.Event()
        gate.waiting.clear()
        late = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
        gate.open.set()
    assert result["out"]["stop_reasons"] == ["stop", "stop"]
    assert late["stop_reasons"] == [ROLLOUT_ERROR_STOP_REASON] * 2
    assert not_none(late["rollout_metrics"])["generate/failures/EngineTimeoutError"] == 2


async def test_pause_clock_deadline_entered_while_paused_waits_for_resume(anyio_backend):
    clock = PauseClock()
    clock.pause()
    with clock.deadline(0.05) as scope:
        with anyio.move_on_after(0.3) as outer:
            await anyio.sleep_forever()
    assert outer.cancelled_caught  # the paused deadline never fired
    assert not scope.cancelled_caught
    clock.resume()
    with clock.deadline(0.05) as scope:
        await anyio.sleep_forever()
    assert scope.cancelled_caught
