"""``max_concurrent_rollouts`` is the generator's bound, not a call's (design rule 15).

SkyRL's fully-async trainer runs one ``generate()`` per prompt group, many at once; the bound must
hold across all of them, hand slots out first come first served, and let a call that is still
waiting for a slot be cancelled without losing anything.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import skyrl_gym

from skyrl_structured import GeneratorInput, TrajectoryID
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger, ScriptedEnv

from .helpers import make_batch, make_generator, not_none, other_tasks, turn_replies

pytestmark = pytest.mark.anyio

LIVE_ENV = "tests_shared_bounds_live"


class LiveLedger:
    """Environments alive at once (created, close not yet returned), across every call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def opened(self) -> None:
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)

    def closed(self) -> None:
        with self.lock:
            self.live -= 1


class LiveEnv(ScriptedEnv):
    """A scripted env that reports its life to ``extras["live"]`` (a :class:`LiveLedger`)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__(env_config, extras)
        self.live: LiveLedger = (extras or {})["live"]
        self.live.opened()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.live.closed()


if LIVE_ENV not in skyrl_gym.registry:
    skyrl_gym.register(id=LIVE_ENV, entry_point=LiveEnv)


def slow_script() -> list[dict[str, Any]]:
    # Each step blocks its worker thread a little, so rollouts overlap unless the bound holds them back.
    return [{"observation": "<observation>more</observation>", "sleep": 0.01}, {"reward": 1.0, "done": True}]


def call_batch(call: int, n: int, ledger: EnvLedger, live: LiveLedger) -> GeneratorInput:
    batch = make_batch(n, ledger, group_size=n, script=slow_script, extras={i: {"live": live} for i in range(n)})
    batch["env_classes"] = [LIVE_ENV] * n
    batch["prompts"] = [[{"role": "user", "content": f"call {call} question {i}?"}] for i in range(n)]
    return batch


async def test_eight_concurrent_calls_share_one_bound(tokenizer, anyio_backend):
    ledger, live = EnvLedger(), LiveLedger()
    gen = make_generator(tokenizer, workers=8, max_concurrent_rollouts=3)
    outputs: dict[int, Any] = {}

    async def one_call(call: int) -> None:
        outputs[call] = await gen.generate(call_batch(call, 4, ledger, live), disable_tqdm=True)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for call in range(8):
                group.start_soon(one_call, call)
    assert live.peak <= 3
    assert live.peak >= 2  # the calls did overlap: the bound, not the event loop, kept the peak down
    assert all(outputs[c]["stop_reasons"] == ["stop"] * 4 for c in range(8))
    assert ledger.opened == 32
    ledger.assert_all_closed_once()
    assert live.live == 0


async def test_a_call_waiting_for_a_slot_can_be_cancelled_and_loses_nothing(tokenizer, anyio_backend):
    tasks_before = other_tasks()
    ledger, live = EnvLedger(), LiveLedger()
    release = anyio.Event()
    holding = anyio.Event()
    gate_first_call = {"open": False}
    replies = turn_replies("first #### 7", "second #### 8")

    async def handler(call: Any) -> str:
        if not gate_first_call["open"] and str(call.session_id).startswith("big"):
            holding.set()
            await release.wait()
        return replies(call)

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, workers=4, max_concurrent_rollouts=2)
    big = call_batch(0, 2, ledger, live)
    big["trajectory_ids"] = [TrajectoryID("big", t.repetition_id) for t in not_none(big["trajectory_ids"])]
    results: dict[str, Any] = {}

    async def run_big() -> None:
        results["big"] = await gen.generate(big, disable_tqdm=True)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run_big)
            await holding.wait()  # both slots are held by the big call
            with anyio.CancelScope() as waiting:
                group.start_soon(lambda: _cancel_soon(waiting))
                await gen.generate(call_batch(1, 2, ledger, live), disable_tqdm=True)
            assert waiting.cancelled_caught
            opened_while_waiting = ledger.opened
            gate_first_call["open"] = True
            release.set()
        # The cancelled call never got a slot: it opened nothing and gave nothing away.
        assert opened_while_waiting == 2
        after = await gen.generate(call_batch(2, 2, ledger, live), disable_tqdm=True)
    assert results["big"]["stop_reasons"] == ["stop", "stop"]
    assert after["stop_reasons"] == ["stop", "stop"]
    slots = gen._slots()
    assert slots is not None
    assert slots.borrowed_tokens == 0
    ledger.assert_all_closed_once()
    assert live.live == 0
    assert other_tasks() == tasks_before


async def _cancel_soon(scope: anyio.CancelScope) -> None:
    for _ in range(20):  # let the waiting call reach the limiter's queue
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def test_slots_are_handed_out_first_come_first_served(tokenizer, anyio_backend):
    # One slot; calls queued in order A, B, C must get it in that order, whatever their size.
    order: list[str] = []
    queued = anyio.Event()  # the slot's holder answers once every call has queued behind it
    replies = turn_replies("first #### 7", "second #### 8")

    async def handler(call: Any) -> str:
        await queued.wait()
        name = str(call.session_id).split("_")[0]
        if not order or order[-1] != name:
            order.append(name)
        return replies(call)

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler), workers=2, max_concurrent_rollouts=1)
    ledger, live = EnvLedger(), LiveLedger()

    def named(name: str, call: int, n: int) -> GeneratorInput:
        batch = call_batch(call, n, ledger, live)
        batch["trajectory_ids"] = [TrajectoryID(name, t.repetition_id) for t in not_none(batch["trajectory_ids"])]
        return batch

    async def run(batch: GeneratorInput) -> None:
        await gen.generate(batch, disable_tqdm=True)

    slots = gen._slots()
    assert slots is not None
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            waiting = 0
            for call, (name, n) in enumerate([("A", 3), ("B", 1), ("C", 1)]):
                group.start_soon(run, named(name, call, n))
                waiting += n if call else n - 1  # A's first rollout holds the slot
                while slots.statistics().tasks_waiting < waiting:  # noqa: ASYNC110 - the call has queued
                    await anyio.sleep(0.01)
            queued.set()
    # A's three rollouts queued first, then B's, then C's: B and C never jump ahead of A's queue.
    assert order == ["A", "B", "C"]
    assert live.peak == 1
    ledger.assert_all_closed_once()
