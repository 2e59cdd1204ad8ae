"""Ending a rollout's inference session on its own: the ``SessionEnd`` cleanup step.

What an engine relies on: ``finish_session`` is called exactly once per rollout with its session
id, after the environment's close, even when that close failed and even while the rollout is being
cancelled; a finish that fails or hangs is counted in the call's cleanup stats and told to the
observers (``cleanup_started``/``cleanup_finished`` with kind ``"finish_session"``), never raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from skyrl_structured._runtime.cleanup import Cleanup, run_cleanups
from skyrl_structured._runtime.contexts import BatchContext, RolloutContext
from skyrl_structured._runtime.sessions import SessionEnd
from skyrl_structured.observe import CleanupKind, CleanupOutcome, Observers, RolloutObserver, RolloutRef
from skyrl_structured.testing import ScriptedEngine

from ._virtual_time import EARLY, hang_bound, on_virtual_time, real_and_virtual_time, seconds

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches.
GENEROUS_S = 60.0

REF = RolloutRef(index=2, attempt=1, trajectory_id=None, session_id="s2")


class Engine(ScriptedEngine):
    """A scripted engine whose ``finish_session`` first awaits ``before_finish`` (to fail, hang or wait)."""

    before_finish: Callable[[], Awaitable[None]] | None = None

    async def finish_session(self, session_id: Hashable) -> None:
        if self.before_finish is not None:
            await self.before_finish()
        await super().finish_session(session_id)


class Heard(RolloutObserver):
    """The cleanup events the observers hear, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        self.events.append(("started", rollout, kind))

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        self.events.append(("finished", rollout, kind, outcome, error))


def rollout_of(engine: Engine, heard: Heard) -> RolloutContext:
    batch = BatchContext(generator=object(), client=engine, default_params={}, observers=Observers([heard]))
    return RolloutContext(batch, REF)


def engine_for(tokenizer: Any, before_finish: Callable[[], Awaitable[None]] | None = None) -> Engine:
    engine = Engine(tokenizer, lambda call: "unused")
    engine.before_finish = before_finish
    return engine


async def test_a_session_end_finishes_its_session_once_and_tells_the_observers(tokenizer, anyio_backend):
    engine, heard = engine_for(tokenizer), Heard()
    context = rollout_of(engine, heard)
    end = SessionEnd(context, "s2")
    assert end.describe() == "finish_session('s2')"
    await run_cleanups([end], limit_s=GENEROUS_S, error=None)
    assert engine.finished_sessions == ["s2"]
    assert heard.events == [
        ("started", REF, "finish_session"),
        ("finished", REF, "finish_session", "ok", None),
    ]
    stats = context.cleanup
    assert (stats.finish_session_errors, stats.finish_session_timeouts) == (0, 0)


async def test_a_failed_finish_is_counted_heard_and_noted_but_not_raised(tokenizer, anyio_backend):
    refused = ConnectionError("engine went away")

    async def fail() -> None:
        raise refused

    engine, heard = engine_for(tokenizer, fail), Heard()
    context = rollout_of(engine, heard)
    error = RuntimeError("the rollout's own error")
    await run_cleanups([SessionEnd(context, "s2")], limit_s=GENEROUS_S, error=error)
    assert engine.finished_sessions == []
    assert heard.events == [
        ("started", REF, "finish_session"),
        ("finished", REF, "finish_session", "error", refused),
    ]
    assert (context.cleanup.finish_session_errors, context.cleanup.finish_session_timeouts) == (1, 0)
    assert error.__notes__ == ["while cleaning up, finish_session('s2') also failed: ConnectionError: engine went away"]


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_a_finish_that_hangs_is_abandoned_at_the_bound_and_counted_as_a_timeout(tokenizer, anyio_backend):
    limit = seconds(virtual=600.0, real=0.5)
    engine, heard = engine_for(tokenizer, anyio.sleep_forever), Heard()
    context = rollout_of(engine, heard)
    began = anyio.current_time()
    with hang_bound():
        await run_cleanups([SessionEnd(context, "s2")], limit_s=limit, error=None)
    took = anyio.current_time() - began
    if on_virtual_time():
        assert took == pytest.approx(limit)
    else:
        assert took >= limit - EARLY
    assert heard.events == [
        ("started", REF, "finish_session"),
        ("finished", REF, "finish_session", "timeout", None),
    ]
    assert (context.cleanup.finish_session_errors, context.cleanup.finish_session_timeouts) == (0, 1)


async def test_a_finish_runs_to_its_end_while_the_rollout_is_cancelled(tokenizer, anyio_backend):
    entered, release = anyio.Event(), anyio.Event()

    async def wait_for_release() -> None:
        entered.set()
        await release.wait()
        await anyio.lowlevel.checkpoint()  # a cancellation that reached the finish would land here

    engine, heard = engine_for(tokenizer, wait_for_release), Heard()
    context = rollout_of(engine, heard)
    rollout_scope = anyio.CancelScope()

    async def rollout() -> None:
        with rollout_scope:
            await run_cleanups([SessionEnd(context, "s2")], limit_s=GENEROUS_S, error=None)
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(GENEROUS_S):
        async with anyio.create_task_group() as group:
            group.start_soon(rollout)
            await entered.wait()
            rollout_scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert engine.finished_sessions == []  # still finishing, shielded
            release.set()
    assert engine.finished_sessions == ["s2"]
    assert heard.events[-1] == ("finished", REF, "finish_session", "ok", None)
    assert rollout_scope.cancelled_caught  # the rollout's cancellation still arrived afterwards


class FailingClose(Cleanup):
    """An environment close that fails, run before the session's end as ``open_env`` chains them."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    def describe(self) -> str:
        return "closing environment 'x'"

    async def _close(self) -> None:
        self.order.append("env close")
        raise OSError("sandbox gone")

    def run(self) -> Awaitable[Any]:
        return self._close()

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        self.order.append(f"env close: {outcome}")


async def test_the_session_is_finished_after_the_envs_close_even_when_that_failed(tokenizer, anyio_backend):
    order: list[str] = []

    async def note() -> None:
        order.append("finish_session")

    engine, heard = engine_for(tokenizer, note), Heard()
    context = rollout_of(engine, heard)
    end = SessionEnd(context, "s2")
    await run_cleanups([FailingClose(order), end], limit_s=GENEROUS_S, error=None)
    assert order == ["env close", "env close: error", "finish_session"]
    assert engine.finished_sessions == ["s2"]
    assert end.started
    assert heard.events[-1] == ("finished", REF, "finish_session", "ok", None)
    assert context.cleanup.finish_session_errors == 0
