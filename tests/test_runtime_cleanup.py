"""The cleanup engine on its own: ``run_cleanups`` and the ``Cleanup`` steps it runs.

What a rollout relies on: each step (an environment's close, a session's end) runs exactly once
and hears exactly once how it ended; it runs to the end although the caller is being cancelled,
yet no longer than its own bound; a failure is logged and noted on the rollout's own error but
never stops the next step; the caller's cancellation is not swallowed; an interrupt propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from skyrl_structured._runtime.cleanup import Cleanup, run_cleanups
from skyrl_structured.observe import CleanupOutcome

from ._virtual_time import EARLY, hang_bound, on_virtual_time, real_and_virtual_time, seconds

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches: the steps meant to finish wait on events, never on the clock.
GENEROUS_S = 60.0

Heard = tuple[str, CleanupOutcome, BaseException | None]


class Step(Cleanup):
    """A cleanup step that counts its runs and records every outcome it hears, in one shared log."""

    def __init__(self, name: str, body: Callable[[], Awaitable[Any]], heard: list[Heard]) -> None:
        super().__init__()
        self.name = name
        self.body = body
        self.heard = heard
        self.runs = 0

    def describe(self) -> str:
        return self.name

    def run(self) -> Awaitable[Any]:
        self.runs += 1
        return self.body()

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        self.heard.append((self.name, outcome, error))


async def nothing() -> None:
    return None


async def checkpoint() -> None:
    await anyio.lowlevel.checkpoint()


async def hang() -> None:
    await anyio.sleep_forever()


def outcomes(heard: list[Heard]) -> list[tuple[str, CleanupOutcome]]:
    return [(name, outcome) for name, outcome, _ in heard]


def cleanup_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "skyrl_structured._runtime.cleanup" and r.levelno == logging.WARNING
    ]


async def test_each_step_runs_once_in_order_and_hears_ok_once(anyio_backend):
    heard: list[Heard] = []
    ready = anyio.Event()
    ready.set()
    steps = [Step("inline", nothing, heard), Step("suspends", checkpoint, heard), Step("waits", ready.wait, heard)]
    assert [step.started for step in steps] == [False] * 3
    error = RuntimeError("the rollout's own error")
    await run_cleanups(steps, limit_s=GENEROUS_S, error=error)
    assert heard == [("inline", "ok", None), ("suspends", "ok", None), ("waits", "ok", None)]
    assert [step.runs for step in steps] == [1, 1, 1]
    assert [step.started for step in steps] == [True] * 3
    assert not hasattr(error, "__notes__")  # nothing failed: nothing to note


async def test_a_step_runs_to_its_end_while_the_caller_is_cancelled_and_the_cancellation_still_arrives(anyio_backend):
    heard: list[Heard] = []
    entered, release = anyio.Event(), anyio.Event()
    finished: list[str] = []

    async def close() -> None:
        entered.set()
        await release.wait()
        await anyio.lowlevel.checkpoint()  # a cancellation that reached the step would land here
        finished.append("close")

    step = Step("close", close, heard)
    caller = anyio.CancelScope()
    reached: list[str] = []

    async def rollout() -> None:
        with caller:
            await run_cleanups([step], limit_s=GENEROUS_S, error=None)
            reached.append("cleanups returned")
            await anyio.lowlevel.checkpoint()
            reached.append("past the next checkpoint")

    with hang_bound():
        async with anyio.create_task_group() as group:
            group.start_soon(rollout)
            await entered.wait()
            caller.cancel()
            await anyio.wait_all_tasks_blocked()
            assert heard == []  # the close is still running, shielded from the caller's cancellation
            release.set()
    assert finished == ["close"]
    assert heard == [("close", "ok", None)]
    assert step.runs == 1
    # The caller's cancellation was held, not swallowed: its next checkpoint raised it.
    assert caller.cancelled_caught
    assert "past the next checkpoint" not in reached


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_hung_step_is_abandoned_at_its_bound_and_each_next_step_gets_a_fresh_bound(anyio_backend, caplog):
    limit = seconds(virtual=600.0, real=1.0)
    heard: list[Heard] = []
    spans: dict[str, tuple[float, float]] = {}

    def hung(name: str) -> Callable[[], Awaitable[None]]:
        async def body() -> None:
            started = anyio.current_time()
            try:
                await anyio.sleep_forever()
            finally:
                spans[name] = (started, anyio.current_time())

        return body

    steps = [
        Step("first hung", hung("first hung"), heard),
        # Starts after the first bound ran out: with that bound still armed it would be cancelled at once.
        Step("after it", checkpoint, heard),
        Step("second hung", hung("second hung"), heard),
        Step("last", checkpoint, heard),
    ]
    error = RuntimeError("the rollout's own error")
    with hang_bound(), anyio.CancelScope() as caller:
        caller.cancel()  # every step runs on the cancellation path: shielded, yet bounded
        await run_cleanups(steps, limit_s=limit, error=error)
    assert outcomes(heard) == [
        ("first hung", "timeout"),
        ("after it", "ok"),
        ("second hung", "timeout"),
        ("last", "ok"),
    ]
    assert [step.runs for step in steps] == [1, 1, 1, 1]
    for name in ("first hung", "second hung"):
        started, ended = spans[name]
        if on_virtual_time():
            assert ended - started == pytest.approx(limit)  # abandoned at its bound, not before or after
        else:
            assert ended - started >= limit - EARLY  # never before its bound
    assert not hasattr(error, "__notes__")  # an overrun is logged, not noted on the rollout's error
    assert cleanup_warnings(caplog) == [
        f"first hung did not finish within env_cleanup_timeout_s={limit:g}s; abandoned it",
        f"second hung did not finish within env_cleanup_timeout_s={limit:g}s; abandoned it",
    ]


@pytest.mark.parametrize("anyio_backend", [real_and_virtual_time()[1]])
async def test_each_step_gets_its_bound_in_full_not_what_the_steps_before_it_left(anyio_backend):
    # Virtual time only: on the real clock a step that takes most of its bound could overrun it.
    limit = 600.0
    heard: list[Heard] = []

    async def most_of_the_bound() -> None:
        await anyio.sleep(0.9 * limit)

    steps = [Step(name, most_of_the_bound, heard) for name in ("close", "finish", "third")]
    began = anyio.current_time()
    with anyio.CancelScope() as caller:
        caller.cancel()
        await run_cleanups(steps, limit_s=limit, error=None)
    assert outcomes(heard) == [("close", "ok"), ("finish", "ok"), ("third", "ok")]
    assert anyio.current_time() - began == pytest.approx(3 * 0.9 * limit)


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_step_that_catches_its_bounds_cancellation_still_hears_one_outcome(anyio_backend):
    limit = seconds(virtual=600.0, real=1.0)
    heard: list[Heard] = []

    async def catches_and_returns() -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            return  # a close that swallows the cancellation and returns: it did end

    async def catches_and_waits_again() -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            await anyio.sleep_forever()  # the bound's cancellation is raised again here

    async def turns_it_into_an_error() -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            raise RuntimeError("close interrupted") from None

    steps = [
        Step("returns", catches_and_returns, heard),
        Step("waits again", catches_and_waits_again, heard),
        Step("raises", turns_it_into_an_error, heard),
        Step("next", checkpoint, heard),
    ]
    with hang_bound():
        await run_cleanups(steps, limit_s=limit, error=None)
    assert outcomes(heard) == [("returns", "ok"), ("waits again", "timeout"), ("raises", "error"), ("next", "ok")]
    assert [step.runs for step in steps] == [1, 1, 1, 1]


async def test_a_failing_step_is_logged_and_noted_on_the_rollouts_error_and_the_next_steps_run(anyio_backend, caplog):
    heard: list[Heard] = []
    gone = OSError("sandbox gone")
    exiting = GeneratorExit("generator closed")

    async def fails_after_suspending() -> None:
        await anyio.lowlevel.checkpoint()
        raise gone

    async def raises_generator_exit() -> None:
        raise exiting

    class FailsToStart(Step):
        def run(self) -> Awaitable[Any]:
            self.runs += 1
            raise ValueError("no close method")

    steps = [
        Step("close", fails_after_suspending, heard),
        Step("finish", raises_generator_exit, heard),
        FailsToStart("start", nothing, heard),
        Step("after", nothing, heard),
    ]
    error = RuntimeError("the rollout's own error")
    await run_cleanups(steps, limit_s=GENEROUS_S, error=error)
    assert outcomes(heard) == [("close", "error"), ("finish", "error"), ("start", "error"), ("after", "ok")]
    assert heard[0][2] is gone
    assert heard[1][2] is exiting
    assert isinstance(heard[2][2], ValueError)
    assert [step.runs for step in steps] == [1, 1, 1, 1]
    assert error.__notes__ == [
        "while cleaning up, close also failed: OSError: sandbox gone",
        "while cleaning up, finish also failed: GeneratorExit: generator closed",
        "while cleaning up, start also failed: ValueError: no close method",
    ]
    assert cleanup_warnings(caplog) == [
        "close failed with OSError: sandbox gone",
        "finish failed with GeneratorExit: generator closed",
        "start failed with ValueError: no close method",
    ]


async def test_a_failure_is_noted_only_on_another_error(anyio_backend):
    heard: list[Heard] = []
    gone = OSError("sandbox gone")

    async def fails() -> None:
        raise gone

    # No rollout error to note it on: reported all the same.
    await run_cleanups([Step("close", fails, heard)], limit_s=GENEROUS_S, error=None)
    # The rollout's error is the cleanup's own exception: not noted on itself.
    await run_cleanups([Step("close", fails, heard)], limit_s=GENEROUS_S, error=gone)
    assert heard == [("close", "error", gone), ("close", "error", gone)]
    assert not hasattr(gone, "__notes__")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
async def test_an_interrupt_is_reported_then_propagates_and_the_steps_after_it_stay_unstarted(anyio_backend, interrupt):
    heard: list[Heard] = []
    raised = interrupt()

    async def interrupted() -> None:
        await anyio.lowlevel.checkpoint()
        raise raised

    steps = [Step("before", nothing, heard), Step("interrupted", interrupted, heard), Step("after", nothing, heard)]
    error = RuntimeError("the rollout's own error")
    with pytest.raises(interrupt) as caught:
        await run_cleanups(steps, limit_s=GENEROUS_S, error=error)
    assert caught.value is raised
    assert heard == [("before", "ok", None), ("interrupted", "error", raised)]
    # The caller runs what was not started (an env's close is then run on its own).
    assert [step.started for step in steps] == [True, True, False]
    assert [step.runs for step in steps] == [1, 1, 0]
    assert error.__notes__ == [f"while cleaning up, interrupted also failed: {interrupt.__name__}: "]
