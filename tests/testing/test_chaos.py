"""Chaos wrappers: deterministic decisions, faults where documented, contained by the real generator."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import skyrl_gym

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON
from skyrl_structured.testing import (
    SCRIPTED_ENV,
    ChaosEngine,
    ChaosError,
    ChaosEvent,
    ChaosPolicy,
    EnvLedger,
    ScriptedEngine,
    register_chaos_env,
)

from ._helpers import batch, generator


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"failure_rate": 1.5}, r"`failure_rate` must be a probability within \[0, 1\], got 1.5"),
        ({"hang_rate": -0.1}, r"`hang_rate` must be a probability"),
        ({"slow_rate": True}, r"`slow_rate` must be a probability"),
        ({"failure_rate": 0.6, "hang_rate": 0.5}, r"must be at most 1, got 1.1"),
        ({"stage": "tokenize"}, r"`stage` must be 'any' or one of generate, finish_session, create, init, step"),
        ({"slow_s": -1}, r"`slow_s` must be a non-negative number of seconds"),
        ({"sync_hang_s": "long"}, r"`sync_hang_s` must be a non-negative number of seconds"),
        ({"exception": ValueError("x")}, r"`exception` must be an exception class"),
        ({"exception": int}, r"`exception` must be an exception class"),
    ],
)
def test_policy_rejects_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        ChaosPolicy(**knobs)


def test_decisions_are_a_pure_function_of_seed_stage_and_call():
    policy = ChaosPolicy(failure_rate=0.3, hang_rate=0.2, slow_rate=0.1, stage="any", seed=7)
    decisions = [policy.decide("step", n) for n in range(1, 1001)]
    assert decisions == [ChaosPolicy(**_knobs(policy)).decide("step", n) for n in range(1, 1001)]
    assert decisions != [ChaosPolicy(**{**_knobs(policy), "seed": 8}).decide("step", n) for n in range(1, 1001)]
    assert decisions != [policy.decide("init", n) for n in range(1, 1001)]
    # The rates are probabilities: over 1000 calls each kind lands near its share.
    assert 250 <= decisions.count("failure") <= 350
    assert 150 <= decisions.count("hang") <= 250
    assert 60 <= decisions.count("slow") <= 140
    narrow = ChaosPolicy(failure_rate=1.0, stage="step")
    assert narrow.decide("step", 1) == "failure"
    assert narrow.decide("init", 1) is None  # other stages are never disturbed


def _knobs(policy: ChaosPolicy) -> dict[str, Any]:
    return {
        "failure_rate": policy.failure_rate,
        "hang_rate": policy.hang_rate,
        "slow_rate": policy.slow_rate,
        "stage": policy.stage,
        "seed": policy.seed,
    }


def test_inject_counts_calls_per_stage_and_records_each_fault():
    policy = ChaosPolicy(failure_rate=0.5, stage="any", seed=3)
    raised = []
    for _ in range(20):
        try:
            policy.inject("init")
        except ChaosError as exc:
            raised.append(exc)
    expected = [n for n in range(1, 21) if policy.decide("init", n) == "failure"]
    assert 0 < len(expected) < 20
    assert [e.call for e in raised] == expected
    assert all(e.stage == "init" for e in raised)
    assert str(raised[0]) == f"chaos: injected failure at stage 'init', call {expected[0]} (seed=3)"
    assert policy.events == [ChaosEvent("init", n, "failure") for n in expected]
    assert policy.calls("init") == 20
    assert policy.calls("step") == 0
    policy.reset()
    assert policy.calls("init") == 0
    assert policy.events == []


def test_failure_can_raise_a_chosen_exception_type():
    policy = ChaosPolicy(failure_rate=1.0, stage="step", exception=ConnectionError)
    with pytest.raises(ConnectionError, match=r"chaos: injected failure at stage 'step', call 1 \(seed=0\)"):
        policy.inject("step")


def test_sync_hang_is_bounded_then_fails():
    policy = ChaosPolicy(hang_rate=1.0, stage="step", sync_hang_s=0.05)
    with pytest.raises(ChaosError, match=r"injected hang \(hit its bound after .*s\) at stage 'step', call 1"):
        policy.inject("step")


def test_release_hangs_ends_a_sync_hang_in_another_thread():
    policy = ChaosPolicy(hang_rate=1.0, stage="close", sync_hang_s=60)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            policy.inject("close")
        except ChaosError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    while policy.calls("close") == 0:
        thread.join(0.01)
    policy.release_hangs()
    thread.join(10)
    assert not thread.is_alive()
    assert "hang (released after" in str(errors[0])


@pytest.mark.anyio
async def test_chaos_engine_fails_generate_before_the_engine_sees_it(tokenizer, anyio_backend):
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8")
    engine = ChaosEngine(scripted, ChaosPolicy(failure_rate=1.0, stage="generate"))
    request = {"prompt_token_ids": [[1, 2]], "session_ids": ["s"], "sampling_params": None}
    with pytest.raises(ChaosError, match="stage 'generate', call 1"):
        await engine.generate(request)
    assert scripted.calls == []


@pytest.mark.anyio
async def test_chaos_engine_fails_finish_session_after_the_session_is_finished(tokenizer, anyio_backend):
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8")
    engine = ChaosEngine(scripted, ChaosPolicy(failure_rate=1.0, stage="finish_session"))
    with pytest.raises(ChaosError, match="stage 'finish_session', call 1"):
        await engine.finish_session("s1")
    assert scripted.finished_sessions == ["s1"]


@pytest.mark.anyio
async def test_chaos_engine_forwards_everything_else(tokenizer, anyio_backend):
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8", weight_version="v3")
    engine = ChaosEngine(scripted, ChaosPolicy())
    assert engine.weight_version == "v3"
    out = await generator(tokenizer, engine).generate(batch(SCRIPTED_ENV, 2), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]
    assert [c.cache_salt for c in scripted.calls] == ["v3", "v3"]  # the generator read weight_version through it


def _seed_with_some(kind: str, rate_key: str, calls: int) -> int:
    """A seed whose first ``calls`` decisions at ``generate`` include ``kind``, but not only."""
    for seed in range(100):
        rate: dict[str, Any] = {rate_key: 0.5}
        policy = ChaosPolicy(**rate, stage="generate", seed=seed)
        hits = [policy.decide("generate", n) == kind for n in range(1, calls + 1)]
        if 0 < sum(hits) < calls:
            return seed
    raise AssertionError("no suitable seed")


@pytest.mark.anyio
async def test_async_hang_is_contained_by_the_rollout_deadline(tokenizer, anyio_backend):
    seed = _seed_with_some("hang", "hang_rate", 4)
    policy = ChaosPolicy(hang_rate=0.5, stage="generate", seed=seed)
    expected_hangs = sum(policy.decide("generate", n) == "hang" for n in range(1, 5))
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8")
    gen = generator(tokenizer, ChaosEngine(scripted, policy), skip_failed_rollouts=True, rollout_timeout_s=3)
    ledger = EnvLedger()
    # One turn per rollout, so each rollout makes exactly one generate call.
    out = await gen.generate(batch(SCRIPTED_ENV, 4, ledger=ledger), disable_tqdm=True)
    assert out["stop_reasons"] is not None
    assert out["stop_reasons"].count(ROLLOUT_ERROR_STOP_REASON) == expected_hangs
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/num_timed_out_rollouts"] == expected_hangs
    assert [e.kind for e in policy.events] == ["hang"] * expected_hangs
    ledger.assert_all_closed_once()
    assert sorted(scripted.finished_sessions, key=str) == ["t0_0", "t1_0", "t2_0", "t3_0"]


@pytest.mark.anyio
async def test_same_seed_gives_the_same_number_of_failures(tokenizer, anyio_backend):
    seed = _seed_with_some("failure", "failure_rate", 6)
    policy = ChaosPolicy(failure_rate=0.5, stage="generate", seed=seed)
    expected = sum(policy.decide("generate", n) == "failure" for n in range(1, 7))
    for _ in range(2):
        policy.reset()
        engine = ChaosEngine(ScriptedEngine.from_replies(tokenizer, "#### 8"), policy)
        out = await generator(tokenizer, engine, skip_failed_rollouts=True).generate(
            batch(SCRIPTED_ENV, 6), disable_tqdm=True
        )
        assert out["rollout_metrics"] is not None
        assert out["rollout_metrics"]["generate/failures/ChaosError"] == expected
        assert [e.call for e in policy.events] == [n for n in range(1, 7) if policy.decide("generate", n)]


@pytest.mark.anyio
async def test_hung_finish_session_is_bounded_by_the_cleanup_timeout(tokenizer, anyio_backend):
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8")
    engine = ChaosEngine(scripted, ChaosPolicy(hang_rate=1.0, stage="finish_session"))
    gen = generator(tokenizer, engine, env_cleanup_timeout_s=0.1)
    out = await gen.generate(batch(SCRIPTED_ENV, 2), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/finish_session_timeouts"] == 2
    assert sorted(scripted.finished_sessions, key=str) == ["t0_0", "t1_0"]  # finished before the hang


@pytest.mark.anyio
@pytest.mark.parametrize("stage", ["create", "init", "step"])
@pytest.mark.parametrize("workers", [0, 2])
async def test_chaos_env_fails_the_rollout_at_its_stage(tokenizer, anyio_backend, stage, workers):
    env_id = register_chaos_env(SCRIPTED_ENV, ChaosPolicy(failure_rate=1.0, stage=stage))
    ledger = EnvLedger()
    scripted = ScriptedEngine.from_replies(tokenizer, "#### 8")
    with pytest.raises(ChaosError, match=f"stage '{stage}', call 1") as info:
        await generator(tokenizer, scripted, workers=workers).generate(
            batch(env_id, 1, ledger=ledger), disable_tqdm=True
        )
    assert info.value.stage == stage
    ledger.assert_all_closed_once()
    assert ledger.opened == (0 if stage == "create" else 1)
    # The engine is reached only after init; a failing init or create never calls it.
    assert len(scripted.calls) == (1 if stage == "step" else 0)
    assert scripted.finished_sessions == ["t0_0"]


@pytest.mark.anyio
async def test_chaos_env_close_fault_lands_after_the_real_close(tokenizer, anyio_backend):
    policy = ChaosPolicy(failure_rate=1.0, stage="close")
    env_id = register_chaos_env(SCRIPTED_ENV, policy)
    ledger = EnvLedger()
    gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "#### 8"))
    out = await gen.generate(batch(env_id, 3, ledger=ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3  # a failing close never costs a finished trajectory
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/env_close_errors"] == 3
    ledger.assert_all_closed_once()  # the inner environments really were closed
    assert [e.stage for e in policy.events] == ["close"] * 3


@pytest.mark.anyio
async def test_slow_calls_sleep_then_run_normally(tokenizer, anyio_backend):
    env_id = register_chaos_env(SCRIPTED_ENV, ChaosPolicy(slow_rate=1.0, slow_s=0.05, stage="step"))
    gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "#### 8"))
    slow = await gen.generate(batch(env_id, 2), disable_tqdm=True)
    plain = await gen.generate(batch(SCRIPTED_ENV, 2), disable_tqdm=True)
    for key in ("response_ids", "loss_masks", "rewards", "stop_reasons"):
        assert slow[key] == plain[key]
    assert slow["trajectory_time_splits"] is not None
    assert all(t >= 0.05 for t in slow["trajectory_time_splits"]["env"])


def test_register_chaos_env_ids():
    policy = ChaosPolicy()
    first = register_chaos_env("gsm8k", policy)
    second = register_chaos_env("gsm8k", policy)
    assert first.startswith("gsm8k+chaos-")
    assert first != second
    named = register_chaos_env("gsm8k", policy, env_id="tests_chaos_named")
    assert named == "tests_chaos_named"
    other = ChaosPolicy(failure_rate=1.0, stage="create")
    assert register_chaos_env("gsm8k", other, env_id="tests_chaos_named") == named  # replaced
    with pytest.raises(ChaosError, match="stage 'create'"):
        skyrl_gym.make(named, extras={"reward_spec": {"ground_truth": "8"}})
    with pytest.raises(ValueError, match="`env_id` 'gsm8k' is already registered for another environment"):
        register_chaos_env("gsm8k_multi_turn", policy, env_id="gsm8k")
    with pytest.raises(ValueError, match="`inner_env_class` 'no_such_env' is not a registered skyrl_gym environment"):
        register_chaos_env("no_such_env", policy)


@pytest.mark.anyio
async def test_async_hang_in_env_step_waits_for_cancellation(tokenizer, anyio_backend):
    # A hang never returns by itself: only the caller's cancellation ends it.
    policy = ChaosPolicy(hang_rate=1.0, stage="step")
    with anyio.move_on_after(0.1) as scope:
        await policy.ainject("step")
    assert scope.cancelled_caught
    assert policy.events == [ChaosEvent("step", 1, "hang")]
