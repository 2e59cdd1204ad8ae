"""``max_concurrent_rollouts="auto"``: the generator admits rollouts as the engines' load allows (design rule 24).

The engine is a real scripted engine wrapped by :class:`~tests._scripted_load.ScriptedLoad`, which
reports the load each test scripts, one reading per read of the controller: every step below waits
on an event (a decision heard, a rollout started), never on the controller's interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skyrl_structured import GeneratorInput, GeneratorOutput
from skyrl_structured.engines._wrapper import EngineWrapper
from skyrl_structured.engines.load import EngineLoad
from skyrl_structured.observe import PrometheusObserver, TraceRecorder
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from ._scripted_load import AdmissionWatch, ScriptedLoad, admission_of
from ._virtual_time import real_and_virtual_time, seconds
from .helpers import make_batch, make_generator, other_tasks, turn_replies
from .trace_check import spans_by_track

pytestmark = pytest.mark.anyio

AUTO: dict[str, Any] = {"max_concurrent_rollouts": "auto"}


def one_turn() -> list[dict[str, Any]]:
    return [{"reward": 1.0, "done": True}]


def gated(gates: dict[str, anyio.Event]) -> Any:
    """A handler whose reply to a rollout of prompt group ``g`` waits for ``gates[g]``."""

    async def handler(call: EngineCall) -> str:
        await gates[str(call.session_id).split("_")[0]].wait()
        return "done #### 7"

    return handler


def batch_of(n: int, group: str, ledger: EnvLedger) -> GeneratorInput:
    batch = make_batch(n, ledger, group_size=n, script=one_turn)
    batch["trajectory_ids"] = [type(t)(group, t.repetition_id) for t in batch["trajectory_ids"] or []]
    batch["prompts"] = [[{"role": "user", "content": f"{group} question {i}?"}] for i in range(n)]
    return batch


async def test_admission_waits_while_the_engines_are_full_and_admits_when_they_free(tokenizer, anyio_backend):
    tasks_before = other_tasks()
    gates = {"q": anyio.Event()}
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gated(gates)))
    gen = make_generator(tokenizer, engine, **AUTO, admission_min_rollouts=1, admission_max_rollouts=8)
    gen.admission_interval_s = 0.0
    watch, trace, prom = AdmissionWatch(), TraceRecorder(), PrometheusObserver()
    gen.observers += [watch, trace, prom]
    ledger = EnvLedger()
    out: list[GeneratorOutput] = []

    async def run() -> None:
        out.append(await gen.generate(batch_of(4, "q", ledger), disable_tqdm=True))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await watch.until(lambda w: len(w.started) == 1)  # the floor: one rollout
            engine.give(0.9)  # the cache is past the target: no one else gets in
            await watch.until(lambda w: len(w.decisions) == 1)
            assert watch.decisions == [(1, 1, "hold_kv_target")]
            assert len(watch.started) == 1
            engine.give(0.0)  # room again: 1 -> 2, and the next rollout in line starts
            await watch.until(lambda w: len(w.started) == 2)
            engine.give(0.0)
            await watch.until(lambda w: len(w.started) == 3)
            assert watch.decisions == [(1, 1, "hold_kv_target"), (2, 1, "grow"), (3, 2, "grow")]
            gates["q"].set()
    (output,) = out
    assert output["stop_reasons"] == ["stop"] * 4
    assert watch.cancelled == []
    ledger.assert_all_closed_once()
    assert other_tasks() == tasks_before  # the controller ended with the call
    assert engine.reads == 3
    metrics = output["rollout_metrics"]
    assert metrics is not None
    assert {k: v for k, v in metrics.items() if k.startswith(("generate/admission", "generate/kv_cache"))} == {
        "generate/admission_limit_min": 1.0,
        "generate/admission_limit_max": 3.0,
        "generate/admission_fallback": 0.0,
        "generate/admission_engine_preemptions": 0.0,
        "generate/admission_changes/grow": 2.0,
        "generate/kv_cache_usage_mean": pytest.approx(0.3),
        "generate/kv_cache_usage_max": 0.9,
    }
    # The trace: counter tracks of the limit and the KV usage, an instant per change.
    events = trace.trace()
    spans_by_track(events)
    counters = [(e["name"], e["args"]) for e in events["traceEvents"] if e["ph"] == "C"]
    assert [args["limit"] for name, args in counters if name == "admission limit"] == [1, 2, 3]
    assert [args["usage"] for name, args in counters if name == "kv cache usage"] == [0.9, 0.0, 0.0]
    changes = [e for e in events["traceEvents"] if e["ph"] == "i" and e["cat"] == "admission"]
    assert [(e["name"], e["args"]["previous"], e["args"]["limit"]) for e in changes] == [
        ("admission grow", 1, 2),
        ("admission grow", 2, 3),
    ]
    # Prometheus: the limit and the KV usage now, the changes by reason.
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(_exposition(prom))
        for s in family.samples
    }
    assert samples[("skyrl_structured_admission_limit", ())] == 3
    assert samples[("skyrl_structured_engine_kv_cache_usage", ())] == 0.0
    assert samples[("skyrl_structured_admission_changes_total", (("reason", "grow"),))] == 2


def _exposition(prom: PrometheusObserver) -> str:
    from prometheus_client import generate_latest

    return generate_latest(prom.registry).decode()


async def test_a_cut_never_stops_an_admitted_rollout(tokenizer, anyio_backend):
    gates = {"q": anyio.Event()}
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gated(gates)))
    gen = make_generator(tokenizer, engine, **AUTO, admission_min_rollouts=1)
    gen.admission_interval_s = 0.0
    watch = AdmissionWatch()
    gen.observers.append(watch)
    ledger = EnvLedger()
    out: list[GeneratorOutput] = []

    async def run() -> None:
        out.append(await gen.generate(batch_of(4, "q", ledger), disable_tqdm=True))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            engine.give(0.0)
            await watch.until(lambda w: len(w.started) == 2)
            engine.give(0.0)
            await watch.until(lambda w: len(w.started) == 3)
            engine.give(0.5, preemptions=4)  # the engine evicted requests: 3 -> floor(3 * 0.7) = 2
            await watch.until(lambda w: len(w.decisions) == 3)
            assert watch.decisions[-1] == (2, 3, "cut_preempted")
            slots = gen._slots()
            assert slots is not None
            assert (slots.total_tokens, slots.borrowed_tokens) == (2, 3)  # all three admitted keep running
            engine.give(0.9, preemptions=9)  # more preemptions while draining: no second cut
            await watch.until(lambda w: len(w.decisions) == 4)
            assert watch.decisions[-1] == (2, 2, "hold_draining")
            assert watch.cancelled == []
            assert len(watch.started) == 3  # the fourth waits until fewer than two hold a slot
            gates["q"].set()
    (output,) = out
    assert output["stop_reasons"] == ["stop"] * 4
    assert watch.cancelled == []
    assert output["rollout_metrics"] is not None
    assert output["rollout_metrics"]["generate/admission_engine_preemptions"] == 9.0
    assert output["rollout_metrics"]["generate/admission_changes/cut_preempted"] == 1.0


@pytest.mark.parametrize("anyio_backend", real_and_virtual_time())
async def test_waiting_for_admission_is_not_counted_against_rollout_timeout(tokenizer, anyio_backend):
    """One slot, rollouts queued for longer than ``rollout_timeout_s`` in all: none times out."""
    timeout = seconds(virtual=10.0, real=4.0)
    step = seconds(virtual=4.0, real=0.25)  # each rollout's own work: well inside the deadline
    count = 18  # the last one waits 17 steps for its slot: past the deadline
    times: list[float] = []

    async def handler(call: EngineCall) -> str:
        times.append(anyio.current_time())
        await anyio.sleep(step)
        return "done #### 7"

    engine = ScriptedLoad(ScriptedEngine(tokenizer, handler))  # no reading ever comes: the limit stays 1
    gen = make_generator(
        tokenizer,
        engine,
        workers=0,  # env calls inline: no thread a mock clock would jump past
        **AUTO,
        admission_min_rollouts=1,
        rollout_timeout_s=timeout,
    )
    ledger = EnvLedger()
    with anyio.fail_after(seconds(virtual=10_000.0, real=120.0)):
        output = await gen.generate(batch_of(count, "q", ledger), disable_tqdm=True)
    assert times[-1] - times[0] >= timeout  # the premise: the last one waited past the deadline
    assert output["stop_reasons"] == ["stop"] * count
    assert output["rollout_metrics"] is not None
    assert output["rollout_metrics"]["generate/num_timed_out_rollouts"] == 0
    assert engine.reads == 0


async def test_concurrent_generate_calls_share_one_adaptive_limit(tokenizer, anyio_backend):
    gates = {"a": anyio.Event(), "b": anyio.Event()}
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gated(gates)))
    gen = make_generator(tokenizer, engine, **AUTO, admission_min_rollouts=1)
    gen.admission_interval_s = 0.0
    watch = AdmissionWatch()
    gen.observers.append(watch)
    ledger = EnvLedger()
    out: dict[str, GeneratorOutput] = {}
    slots = gen._slots()
    assert slots is not None

    done = {"a": anyio.Event(), "b": anyio.Event()}

    async def run(name: str) -> None:
        out[name] = await gen.generate(batch_of(2, name, ledger), disable_tqdm=True)
        done[name].set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run, "a")
            await watch.until(lambda w: len(w.started) == 1)
            group.start_soon(run, "b")
            while slots.statistics().tasks_waiting < 3:  # noqa: ASYNC110 - until b's two have queued too
                await anyio.sleep(0.01)
            assert len(watch.started) == 1  # one limit for both calls, not one each
            assert len(admission_of(gen)._committed) == 2  # both calls' admitted rollouts count
            engine.give(0.0)
            await watch.until(lambda w: len(w.started) == 2)
            engine.give(0.0)
            await watch.until(lambda w: len(w.started) == 3)
            assert slots.total_tokens == 3
            gates["a"].set()  # a ends; its controller hands over to b's
            await done["a"].wait()
            engine.give(0.2)
            await watch.until(lambda w: len(w.decisions) == 3)
            gates["b"].set()
    assert out["a"]["stop_reasons"] == out["b"]["stop_reasons"] == ["stop", "stop"]
    assert watch.decisions == [(2, 1, "grow"), (3, 2, "grow"), (3, 3, "hold_no_demand")]
    a, b = out["a"]["rollout_metrics"] or {}, out["b"]["rollout_metrics"] or {}
    # The changes are counted once, by the call that drove them (SkyRL's fully-async trainer sums them).
    assert a["generate/admission_changes/grow"] == 2.0
    assert "generate/admission_changes/grow" not in b
    assert (a["generate/admission_limit_min"], a["generate/admission_limit_max"]) == (1.0, 3.0)
    assert (b["generate/admission_limit_min"], b["generate/admission_limit_max"]) == (1.0, 3.0)
    assert b["generate/kv_cache_usage_max"] == 0.2  # only b was running at the third reading
    assert a["generate/kv_cache_usage_max"] == 0.0


async def test_a_client_that_reports_no_load_runs_at_the_fixed_fallback_logged_once(tokenizer, anyio_backend, caplog):
    in_flight, peak = 0, 0

    async def handler(call: EngineCall) -> str:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await anyio.lowlevel.checkpoint()
        in_flight -= 1
        return "done #### 7"

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler), **AUTO, admission_min_rollouts=2)
    tasks_before = other_tasks()
    ledger = EnvLedger()
    with caplog.at_level(logging.WARNING, logger="skyrl_structured"):
        first = await gen.generate(batch_of(6, "a", ledger), disable_tqdm=True)
        second = await gen.generate(batch_of(6, "b", ledger), disable_tqdm=True)
    warnings = [r.getMessage() for r in caplog.records if "reports no load" in r.getMessage()]
    assert warnings == [
        "generator.max_concurrent_rollouts='auto': the inference client ScriptedEngine reports no load (it does "
        "not implement skyrl_structured.engines.load.ReportsLoad), so the bound is fixed at 2 "
        "(generator.admission_min_rollouts); use HTTPEngine or VLLMEngine to follow the engines' KV cache, or set "
        "that bound yourself"
    ]
    assert peak <= 2
    assert other_tasks() == tasks_before
    for output in (first, second):
        assert output["stop_reasons"] == ["stop"] * 6
        metrics = output["rollout_metrics"] or {}
        assert metrics["generate/admission_fallback"] == 1.0
        assert (metrics["generate/admission_limit_min"], metrics["generate/admission_limit_max"]) == (2.0, 2.0)


async def test_preemptions_between_two_calls_are_neither_calls(tokenizer, anyio_backend):
    gates = {"a": anyio.Event(), "b": anyio.Event()}
    engine = ScriptedLoad(ScriptedEngine(tokenizer, gated(gates)))
    gen = make_generator(tokenizer, engine, **AUTO, admission_min_rollouts=2)
    gen.admission_interval_s = 0.0
    watch = AdmissionWatch()
    gen.observers.append(watch)
    ledger = EnvLedger()
    out: dict[str, GeneratorOutput] = {}

    async def run(name: str) -> None:
        out[name] = await gen.generate(batch_of(4, name, ledger), disable_tqdm=True)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run, "a")
            engine.give(0.1, preemptions=3)  # the server's first reading: its baseline
            engine.give(0.1, preemptions=5)  # 2 new: a cut
            await watch.until(lambda w: len(w.decisions) == 2)
            gates["a"].set()
        # Between the calls the server preempted 15 more times (another generator's batch, say).
        async with anyio.create_task_group() as group:
            group.start_soon(run, "b")
            engine.give(0.1, preemptions=20)  # b's first reading: a baseline again, no news
            engine.give(0.1, preemptions=21)  # 1 new, during b: a cut
            await watch.until(lambda w: len(w.decisions) == 4)
            gates["b"].set()
    assert [reason for _, _, reason in watch.decisions] == ["grow", "cut_preempted", "grow", "cut_preempted"]
    a, b = out["a"]["rollout_metrics"] or {}, out["b"]["rollout_metrics"] or {}
    assert a["generate/admission_engine_preemptions"] == 2.0
    assert b["generate/admission_engine_preemptions"] == 1.0


async def test_without_auto_the_metrics_are_the_drop_in_ones(tokenizer, anyio_backend):
    gen = make_generator(tokenizer, max_concurrent_rollouts=2)
    output = await gen.generate(batch_of(3, "a", EnvLedger()), disable_tqdm=True)
    keys = set(output["rollout_metrics"] or {})
    assert not {k for k in keys if "admission" in k or "kv_cache" in k}


class AsyncioOnlyLoad(EngineWrapper):
    """An asyncio-only client (it says so: ``requires_asyncio``) that reports a light load.

    Its replies wait for its first load reading, so the generator must have read it; under trio both
    go through the trio-asyncio bridge (``asyncio.sleep`` and ``asyncio.Event`` fail anywhere else).
    """

    requires_asyncio = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.reads = 0
        self._read: asyncio.Event | None = None

    def _first_read(self) -> asyncio.Event:
        if self._read is None:
            self._read = asyncio.Event()
        return self._read

    async def engine_load(self) -> list[EngineLoad]:
        await asyncio.sleep(0)
        self.reads += 1
        self._first_read().set()
        return [EngineLoad("http://127.0.0.1:1", 0.25, 1, 0, 0, 0, 0, time.monotonic())]

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        await self._first_read().wait()
        return await super().generate(input_batch, *args, **kwargs)


async def test_an_asyncio_only_clients_load_is_read_across_the_bridge(tokenizer, anyio_backend):
    engine = AsyncioOnlyLoad(ScriptedEngine(tokenizer, turn_replies("done #### 7")))
    gen = make_generator(tokenizer, engine, **AUTO, admission_min_rollouts=1)
    gen.admission_interval_s = 0.01
    with anyio.fail_after(60):
        output = await gen.generate(batch_of(3, "a", EnvLedger()), disable_tqdm=True)
    assert output["stop_reasons"] == ["stop"] * 3
    assert engine.reads >= 1
    metrics = output["rollout_metrics"] or {}
    assert (metrics["generate/admission_fallback"], metrics["generate/kv_cache_usage_max"]) == (0.0, 0.25)
