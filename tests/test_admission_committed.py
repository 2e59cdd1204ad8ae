"""``max_concurrent_rollouts="auto"`` counts the context its admitted rollouts hold (the committed KV).

Through real ``generate()`` calls on asyncio and trio: a scripted engine whose every call waits
until the test lets it go, so each check reads the committed context in a state the test froze
(calls in the engine, an environment stepping, a rollout ended), never at a time. The exact values
are the engine calls' own token counts, as the observers hear them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from skyrl_structured import GeneratorOutput
from skyrl_structured._runtime.committed import CommittedContexts
from skyrl_structured.observe import EnvMethod, RolloutObserver, RolloutRef
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from ._scripted_load import AdmissionWatch, ScriptedLoad, admission_of
from .helpers import make_batch, make_generator, other_tasks

pytestmark = pytest.mark.anyio

#: Two slots, whatever the load: the controller can only hold.
TWO: dict[str, Any] = {"max_concurrent_rollouts": "auto", "admission_min_rollouts": 2, "admission_max_rollouts": 2}
#: Only a hang reaches this.
HANG_S = 60


class Gates:
    """An engine handler whose calls each wait until the test opens them, by session and turn (from 0)."""

    def __init__(self) -> None:
        #: (session, turn, prompt tokens) of every call, in arrival order.
        self.calls: list[tuple[str, int, int]] = []
        self._turns: Counter[str] = Counter()
        self._gates: defaultdict[tuple[str, int], anyio.Event] = defaultdict(anyio.Event)
        self._open_sessions: set[str] = set()
        self._everything = False
        self._changed: anyio.Event | None = None

    async def handler(self, call: EngineCall) -> str:
        session = str(call.session_id)
        turn = self._turns[session]
        self._turns[session] += 1
        self.calls.append((session, turn, len(call.prompt_token_ids)))
        if self._changed is not None:
            self._changed.set()
        if not (self._everything or session in self._open_sessions):
            await self._gates[(session, turn)].wait()
        return "an answer #### 7"

    def open(self, session: str, turn: int | None = None) -> None:
        """Let ``session``'s call ``turn`` go (every call of it, now and later, for None)."""
        if turn is None:
            self._open_sessions.add(session)
            for (gated, _), gate in self._gates.items():
                if gated == session:
                    gate.set()
        else:
            self._gates[(session, turn)].set()

    def open_all(self) -> None:
        self._everything = True
        for gate in self._gates.values():
            gate.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed = anyio.Event()
            await self._changed.wait()

    def prompt(self, session: str, turn: int) -> int:
        [tokens] = [t for s, n, t in self.calls if (s, n) == (session, turn)]
        return tokens


class Committed(RolloutObserver):
    """What the committed context was at chosen events: (event, rollout index, indexes held, tokens).

    ``tracker`` is the call's admitted attempts (set once the call runs); ``tokens`` reads the admission.
    """

    def __init__(self) -> None:
        self.tracker: CommittedContexts | None = None
        self.tokens: Callable[[], float | None] = lambda: None
        self.snapshots: list[tuple[str, int, list[int], float | None]] = []
        #: Each rollout's latest response, in tokens.
        self.responses: dict[int, int | None] = {}
        self._changed: anyio.Event | None = None

    def held(self) -> list[int]:
        assert self.tracker is not None
        return sorted(attempt.ref.index for attempt in self.tracker)  # type: ignore[attr-defined]

    def _snap(self, event: str, rollout: RolloutRef) -> None:
        if self.tracker is not None:
            self.snapshots.append((event, rollout.index, self.held(), self.tokens()))
        if self._changed is not None:
            self._changed.set()

    async def until(self, condition: Callable[[Committed], bool]) -> None:
        while not condition(self):
            self._changed = anyio.Event()
            await self._changed.wait()

    def of(self, event: str, index: int) -> list[tuple[list[int], float | None]]:
        return [(held, tokens) for e, i, held, tokens in self.snapshots if (e, i) == (event, index)]

    def engine_call_finished(
        self, rollout: RolloutRef, turn: int, response_tokens: int | None, stop_reason: str | None, error: Any
    ) -> None:
        self.responses[rollout.index] = response_tokens

    def env_call_started(self, rollout: RolloutRef, method: EnvMethod, turn: int) -> None:
        if method == "step":
            self._snap("step", rollout)

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self._snap("failed", rollout)

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self._snap("cancelled", rollout)

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self._snap("finished", rollout)


def watched(gen: Any) -> Committed:
    committed = Committed()
    gen.observers.append(committed)
    return committed


def follow(gen: Any, committed: Committed) -> CommittedContexts:
    """Point ``committed`` at the running call's admitted attempts (the one call running) and return them."""
    admission = admission_of(gen)
    [tracker] = admission._committed
    committed.tracker = tracker
    committed.tokens = admission.committed_tokens
    return tracker


async def test_each_admitted_rollout_counts_its_latest_calls_prompt_and_response(tokenizer, anyio_backend):
    tasks_before = other_tasks()
    gates = Gates()
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gates.handler))
    gen = make_generator(tokenizer, engine, **TWO)
    committed, watch = watched(gen), AdmissionWatch()
    gen.observers.append(watch)
    ledger = EnvLedger()
    out: list[GeneratorOutput] = []

    async def run() -> None:
        # Three two-turn rollouts, one per session q0_0, q1_0, q2_0.
        out.append(await gen.generate(make_batch(3, ledger, group_size=1), disable_tqdm=True))

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gates.until(lambda: len(gates.calls) == 2)  # two admitted, both first calls in the engine
            tracker = follow(gen, committed)
            admission = admission_of(gen)
            a, b = gates.calls[0][0], gates.calls[1][0]
            index = {"q0_0": 0, "q1_0": 1, "q2_0": 2}
            assert committed.held() == sorted([index[a], index[b]])
            assert admission.committed_tokens() == gates.prompt(a, 0) + gates.prompt(b, 0)

            gates.open(a, 0)  # a's reply comes back, its env steps, its second call goes in
            await gates.until(lambda: len(gates.calls) == 3)
            reply = committed.responses[index[a]]
            assert reply is not None
            assert reply > 0
            # While a's env stepped: a's first prompt and its reply, b's first prompt.
            [(held, at_step)] = committed.of("step", index[a])
            assert (held, at_step) == (sorted([index[a], index[b]]), gates.prompt(a, 0) + reply + gates.prompt(b, 0))
            assert gates.calls[2][:2] == (a, 1)
            assert gates.prompt(a, 1) > gates.prompt(a, 0) + reply  # its history and the observation
            assert admission.committed_tokens() == gates.prompt(a, 1) + gates.prompt(b, 0)

            # A reading with the server's capacity: the committed fraction goes into the call's metrics.
            capacity = 4 * (gates.prompt(a, 1) + gates.prompt(b, 0))
            engine.give(0.0, capacity=capacity)
            await watch.until(lambda w: len(w.decisions) == 1)
            assert watch.decisions == [(2, 2, "hold_bound")]  # it would grow: the ceiling holds it

            gates.open_all()
    (output,) = out
    assert output["stop_reasons"] == ["stop"] * 3
    ledger.assert_all_closed_once()
    assert len(tracker) == 0  # every attempt released
    assert admission.committed_tokens() == 0.0  # and the call's set went with it
    assert other_tasks() == tasks_before
    # The rollouts that ended were no longer held when they ended.
    for index_ in range(3):
        [(held, _)] = committed.of("finished", index_)
        assert index_ not in held
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/admission_committed_kv_mean"] == metrics["generate/admission_committed_kv_max"] == 0.25
    assert metrics["generate/kv_cache_usage_max"] == 0.0


async def test_committed_context_past_the_target_holds_while_the_kv_usage_is_low(tokenizer, anyio_backend):
    gates = Gates()
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gates.handler))
    gen = make_generator(tokenizer, engine, max_concurrent_rollouts="auto", admission_min_rollouts=1)
    gen.admission_interval_s = 0.0
    watch = AdmissionWatch()
    gen.observers.append(watch)
    out: list[GeneratorOutput] = []

    async def run() -> None:
        out.append(await gen.generate(make_batch(3, EnvLedger(), group_size=1), disable_tqdm=True))

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gates.until(lambda: len(gates.calls) == 1)
            prompt = gates.calls[0][2]
            # The engine's cache looks empty, but the one admitted rollout already holds 90% of it.
            engine.give(0.0, capacity=round(prompt / 0.9))
            await watch.until(lambda w: len(w.decisions) == 1)
            assert watch.decisions == [(1, 1, "hold_kv_target")]
            assert watch.kv == [0.0]
            # Without the capacity the controller is as before: the empty cache lets it grow.
            engine.give(0.0)
            await watch.until(lambda w: len(w.decisions) == 2)
            assert watch.decisions[-1] == (2, 1, "grow")
            gates.open_all()
    (output,) = out
    assert output["stop_reasons"] == ["stop"] * 3
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/admission_committed_kv_max"] == pytest.approx(prompt / round(prompt / 0.9))


async def test_a_failed_attempt_and_its_retry_are_released_before_their_events(tokenizer, anyio_backend):
    gates = Gates()
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gates.handler))
    gen = make_generator(
        tokenizer, engine, **TWO, skip_failed_rollouts=True, max_rollout_retries=1, rollout_retry_backoff_s=0.0
    )
    committed = watched(gen)
    ledger = EnvLedger()
    out: list[GeneratorOutput] = []

    async def run() -> None:
        batch = make_batch(2, ledger, group_size=1, extras={0: {"fail": "step"}})
        out.append(await gen.generate(batch, disable_tqdm=True))

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gates.until(lambda: len(gates.calls) == 2)
            tracker = follow(gen, committed)
            gates.open("q0_0")  # rollout 0: its env fails at each step, attempt 1 and its retry
            await committed.until(lambda c: bool(c.of("finished", 0)))
            # Each failed attempt was released before its attempt_failed; rollout 1 was held all along.
            assert [held for held, _ in committed.of("failed", 0)] == [[1], [1]]
            assert committed.of("finished", 0) == [([1], gates.prompt("q1_0", 0))]
            gates.open_all()
    (output,) = out
    assert (output["stop_reasons"] or [])[1] == "stop"
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/num_failed_rollouts"] == 1
    assert len(tracker) == 0
    ledger.assert_all_closed_once()


async def test_a_cancelled_call_releases_every_admitted_rollout(tokenizer, anyio_backend):
    tasks_before = other_tasks()
    gates = Gates()
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gates.handler))
    gen = make_generator(tokenizer, engine, **TWO)
    committed = watched(gen)
    ledger = EnvLedger()

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as group:
            scope = anyio.CancelScope()

            async def run() -> None:
                with scope:
                    await gen.generate(make_batch(3, ledger, group_size=1), disable_tqdm=True)

            group.start_soon(run)
            await gates.until(lambda: len(gates.calls) == 2)
            tracker = follow(gen, committed)
            admission = admission_of(gen)
            scope.cancel()
    assert scope.cancelled_caught
    # The two admitted and the one waiting for its slot (never admitted) were each cancelled.
    cancelled = sorted(index for event, index, _, _ in committed.snapshots if event == "cancelled")
    assert cancelled == [0, 1, 2]
    assert [held for event, _, held, _ in committed.snapshots if event == "cancelled"][-1] == []
    assert len(tracker) == 0
    assert admission.committed_tokens() == 0.0
    ledger.assert_all_closed_once()
    assert other_tasks() == tasks_before


async def test_a_cut_straggler_is_released(tokenizer, anyio_backend):
    gates = Gates()
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gates.handler))
    gen = make_generator(
        tokenizer,
        engine,
        **TWO,
        skip_failed_rollouts=True,
        failure_budget_action="warn",
        straggler_cutoff=0.5,
        max_turns=1,
    )
    committed = watched(gen)
    ledger = EnvLedger()
    out: list[GeneratorOutput] = []

    async def run() -> None:
        out.append(await gen.generate(make_batch(2, ledger, group_size=1), disable_tqdm=True))

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await gates.until(lambda: len(gates.calls) == 2)  # the straggler's call is in the engine too
            tracker = follow(gen, committed)
            gates.open("q0_0")  # rollout 0 ends: half the batch is final, rollout 1 (never answered) is cut
    (output,) = out
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/num_cut_rollouts"] == 1
    assert committed.of("cancelled", 1) == [([], 0.0)]
    assert len(tracker) == 0
    ledger.assert_all_closed_once()
