"""The GC policy of generate(): a raised generation-0 threshold while any batch runs, restored exactly after."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from skyrl_structured._runtime import gc as _gc
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.types import InferenceEngineInput, InferenceEngineOutput

from .helpers import make_batch, make_generator

pytestmark = pytest.mark.anyio

#: A threshold no test environment uses by default, so "restored" cannot pass by accident.
APP_THRESHOLD = (613, 17, 9)


@pytest.fixture(autouse=True)
def app_threshold() -> Iterator[None]:
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(*APP_THRESHOLD)
    gc.enable()
    yield
    gc.set_threshold(*saved)
    if not enabled:
        gc.disable()
    assert _gc.active_calls() == 0


class GateEngine(ScriptedEngine):
    """Records the gen-0 threshold seen by each call; holds every call until ``release`` is set."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, lambda call: "answer #### 7")
        self.seen: list[int] = []
        self.entered = 0
        self._entry = anyio.Event()
        self.release: anyio.Event | None = None

    async def wait_entered(self, n: int) -> None:
        """Return once ``n`` calls have entered (each entry sets the current event and arms a new one)."""
        while self.entered < n:
            await self._entry.wait()

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        self.seen.append(gc.get_threshold()[0])
        self.entered += 1
        entry, self._entry = self._entry, anyio.Event()
        entry.set()
        if self.release is not None:
            await self.release.wait()
        return await super().generate(input_batch, model)


def failing(call: EngineCall) -> str:
    raise RuntimeError("engine down")


async def test_threshold_is_raised_during_generate_and_restored_after(anyio_backend, tokenizer, ledger: EnvLedger):
    engine = GateEngine(tokenizer)
    gen = make_generator(tokenizer, engine)
    out = await gen.generate(make_batch(4, ledger))
    assert len(out["response_ids"]) == 4
    assert engine.seen
    assert set(engine.seen) == {_gc.GEN0_THRESHOLD}
    assert gc.get_threshold() == APP_THRESHOLD


async def test_restored_after_an_error(anyio_backend, tokenizer, ledger: EnvLedger):
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, failing))
    with pytest.raises(RuntimeError, match="engine down"):
        await gen.generate(make_batch(3, ledger))
    assert gc.get_threshold() == APP_THRESHOLD
    assert ledger.never_closed() == []


async def test_restored_after_cancellation(anyio_backend, tokenizer, ledger: EnvLedger):
    engine = GateEngine(tokenizer)
    engine.release = anyio.Event()  # never set: every rollout waits in the engine
    gen = make_generator(tokenizer, engine)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(3, ledger))
            with anyio.fail_after(30):
                await engine.wait_entered(3)
            assert gc.get_threshold()[0] == _gc.GEN0_THRESHOLD
            scope.cancel()
    assert scope.cancelled_caught
    assert gc.get_threshold() == APP_THRESHOLD
    assert ledger.never_closed() == []


async def test_overlapping_calls_share_one_raise_restored_after_the_last(anyio_backend, tokenizer, ledger: EnvLedger):
    first, second = GateEngine(tokenizer), GateEngine(tokenizer)
    first.release, second.release = anyio.Event(), anyio.Event()
    done: list[str] = []
    first_done = anyio.Event()

    async def run(name: str, engine: GateEngine) -> None:
        await make_generator(tokenizer, engine).generate(make_batch(2, ledger))
        done.append(name)
        if name == "first":
            first_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "first", first)
        tg.start_soon(run, "second", second)
        with anyio.fail_after(30):
            await first.wait_entered(2)
            await second.wait_entered(2)
        assert _gc.active_calls() == 2
        first.release.set()
        with anyio.fail_after(30):
            await first_done.wait()
        assert done == ["first"]
        # One call still runs: the threshold stays raised.
        assert gc.get_threshold()[0] == _gc.GEN0_THRESHOLD
        second.release.set()
    assert done == ["first", "second"]
    assert gc.get_threshold() == APP_THRESHOLD


def test_calls_in_two_threads_share_one_raise():
    inside = threading.Barrier(2)
    leave_first = threading.Event()
    seen: dict[str, tuple[int, int, int]] = {}

    def worker(name: str) -> None:
        with _gc.relaxed_gc():
            inside.wait(10)
            if name == "first":
                seen["first_inside"] = gc.get_threshold()
                return
            leave_first.wait(10)
            seen["second_after_first_left"] = gc.get_threshold()

    first = threading.Thread(target=worker, args=("first",))
    second = threading.Thread(target=worker, args=("second",))
    first.start()
    second.start()
    first.join(10)
    leave_first.set()
    second.join(10)
    assert seen["first_inside"][0] == _gc.GEN0_THRESHOLD
    assert seen["second_after_first_left"][0] == _gc.GEN0_THRESHOLD
    assert gc.get_threshold() == APP_THRESHOLD


async def test_a_disabled_collector_is_left_alone(anyio_backend, tokenizer, ledger: EnvLedger):
    gc.disable()
    engine = GateEngine(tokenizer)
    await make_generator(tokenizer, engine).generate(make_batch(2, ledger))
    assert set(engine.seen) == {APP_THRESHOLD[0]}
    assert not gc.isenabled()
    assert gc.get_threshold() == APP_THRESHOLD


async def test_a_higher_threshold_of_the_application_is_kept(anyio_backend, tokenizer, ledger: EnvLedger):
    gc.set_threshold(_gc.GEN0_THRESHOLD * 2, 11, 12)
    engine = GateEngine(tokenizer)
    await make_generator(tokenizer, engine).generate(make_batch(2, ledger))
    assert set(engine.seen) == {_gc.GEN0_THRESHOLD * 2}
    assert gc.get_threshold() == (_gc.GEN0_THRESHOLD * 2, 11, 12)


async def test_opt_out_leaves_the_threshold_alone(anyio_backend, tokenizer, ledger: EnvLedger):
    engine = GateEngine(tokenizer)
    await make_generator(tokenizer, engine, gc_tuning=False).generate(make_batch(2, ledger))
    assert set(engine.seen) == {APP_THRESHOLD[0]}
    assert gc.get_threshold() == APP_THRESHOLD


def test_gc_tuning_must_be_a_bool(tokenizer):
    with pytest.raises(ValueError, match=r"generator\.gc_tuning"):
        make_generator(tokenizer, gc_tuning="no")
