"""Contained failures: placeholders, the original error without the flag, retries, timeouts, budgets."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, PromptTooLongError, validate_generator_output
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, other_tasks, token_rewards, turn_replies

pytestmark = pytest.mark.anyio


def failing_engine(tokenizer, bad_sessions: set[str], exc: type[Exception] = ConnectionError):
    replies = turn_replies("first #### 7", "second #### 8")

    def handler(call):
        if call.session_id in bad_sessions:
            raise exc(f"engine unreachable for {call.session_id}")
        return replies(call)

    return ScriptedEngine(tokenizer, handler)


async def test_failed_rollout_becomes_placeholder_and_others_are_untouched(tokenizer, anyio_backend):
    clean_ledger, ledger = EnvLedger(), EnvLedger()
    clean = await make_generator(tokenizer).generate(make_batch(4, clean_ledger), disable_tqdm=True)
    engine = failing_engine(tokenizer, {"q0_1"})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    out = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    validate_generator_output(4, out)
    pad = tokenizer.pad_token_id
    assert out["response_ids"][1] == [pad]
    assert out["prompt_token_ids"][1] == [pad]
    assert out["loss_masks"][1] == [0]
    assert out["rewards"][1] == [0.0]  # token-level, like its successful siblings
    assert out["stop_reasons"] is not None
    assert out["stop_reasons"][1] == ROLLOUT_ERROR_STOP_REASON
    assert out["rollout_logprobs"] is not None
    assert out["rollout_logprobs"][1] == [0.0]
    assert out["env_metrics"] is not None
    assert out["env_metrics"][1] == {}
    for i in (0, 2, 3):
        for key in ("response_ids", "prompt_token_ids", "loss_masks", "rewards", "stop_reasons", "rollout_logprobs"):
            got, want = out[key], clean[key]
            assert got is not None, key
            assert want is not None, key
            assert got[i] == want[i], key
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_failed_rollouts"] == 1
    assert metrics["generate/mean_failed_rollout_fraction"] == 0.25
    assert metrics["generate/failure_budget_exceeded"] == 0
    assert metrics["generate/failures/ConnectionError"] == 1
    # Reward and length metrics describe the three rollouts that ran.
    assert metrics["generate/min_num_tokens"] == min(len(clean["response_ids"][i]) for i in (0, 2, 3))
    ledger.assert_all_closed_once()
    assert ledger.opened == 4
    assert sorted(engine.finished_sessions, key=str) == ["q0_0", "q0_1", "q1_0", "q1_1"]


async def test_placeholder_keeps_failed_attempt_timing(tokenizer, anyio_backend):
    async def handler(call):
        await anyio.sleep(0.05)
        raise TimeoutError("sandbox did not answer")

    batch = make_batch(2, EnvLedger())
    replies = turn_replies("a #### 7", "b #### 8")

    async def mixed(call):
        if call.session_id == "q0_1":
            return await handler(call)
        return replies(call)

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, mixed), skip_failed_rollouts=True)
    out = await gen.generate(batch, disable_tqdm=True)
    assert out["trajectory_generation_times"] is not None
    assert out["trajectory_time_splits"] is not None
    assert out["trajectory_generation_times"][1] >= 0.05
    assert out["trajectory_time_splits"]["llm"][1] >= 0.05
    assert out["trajectory_time_splits"]["env"][1] == 0.0


async def test_without_flag_the_original_exception_is_raised_after_siblings_clean_up(tokenizer, anyio_backend):
    ledger = EnvLedger()
    blocked = anyio.Event()
    replies = turn_replies("first #### 7", "second #### 8")

    async def handler(call):
        if call.session_id == "q0_0":
            raise ConnectionError("network blip")
        if call.session_id == "q1_1":
            await blocked.wait()  # never set: this sibling must be cancelled, not awaited
        return replies(call)

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine)
    before = other_tasks()
    with pytest.raises(ConnectionError, match="network blip") as info:
        await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert type(info.value) is ConnectionError  # not an ExceptionGroup
    assert other_tasks() == before
    ledger.assert_all_closed_once()
    # Every session the engine saw was finished, and none twice.
    assert engine.started_sessions <= set(engine.finished_sessions)
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions))


async def test_all_failed_raises_runtime_error_chained_to_first(tokenizer, anyio_backend):
    ledger = EnvLedger()
    engine = failing_engine(tokenizer, {"q0_0", "q0_1", "q1_0"})

    def handler(call):
        if call.session_id == "q1_1":
            raise ValueError("bad action")
        raise ConnectionError(f"down {call.session_id}")

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    with pytest.raises(RuntimeError, match=r"All 4 rollouts failed \(3 x ConnectionError, 1 x ValueError\)") as info:
        await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "q0_0" in str(info.value.__cause__)
    ledger.assert_all_closed_once()


async def test_failure_budget(tokenizer, anyio_backend):
    ledger = EnvLedger()
    engine = failing_engine(tokenizer, {"q0_0", "q1_1"})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True, max_failed_rollout_fraction=0.25)
    with pytest.raises(RuntimeError, match=r"2 of 4 rollouts failed .*max_failed_rollout_fraction=0.25") as info:
        await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert isinstance(info.value.__cause__, ConnectionError)
    ledger.assert_all_closed_once()
    # At the bar exactly, the step goes through.
    gen = make_generator(
        tokenizer, failing_engine(tokenizer, {"q0_0"}), skip_failed_rollouts=True, max_failed_rollout_fraction=0.25
    )
    out = await gen.generate(make_batch(4, EnvLedger()), disable_tqdm=True)
    assert out["stop_reasons"] is not None
    assert out["stop_reasons"].count(ROLLOUT_ERROR_STOP_REASON) == 1


def _deadline_backends() -> list[Any]:
    """asyncio on the wall clock, with a deadline that clears a loaded machine, and trio on virtual time."""
    import trio.testing

    autojump = ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
    return [
        pytest.param(("asyncio", {"debug": True}), 3, id="asyncio"),
        pytest.param(autojump, 600, id="trio-autojump"),
    ]


@pytest.mark.parametrize(("anyio_backend", "timeout_s"), _deadline_backends())
async def test_timeout_turns_a_hung_rollout_into_timeout_error(tokenizer, anyio_backend, timeout_s):
    ledger = EnvLedger()
    never = anyio.Event()
    replies = turn_replies("first #### 7", "second #### 8")

    async def handler(call):
        if call.session_id == "q0_1":
            await never.wait()
        return replies(call)

    engine = ScriptedEngine(tokenizer, handler)
    # Inline env calls: on virtual time the clock moves only once every rollout waits.
    gen = make_generator(tokenizer, engine, workers=0, skip_failed_rollouts=True, rollout_timeout_s=timeout_s)
    out = await gen.generate(make_batch(2, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", ROLLOUT_ERROR_STOP_REASON]
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_timed_out_rollouts"] == 1
    assert metrics["generate/failures/TimeoutError"] == 1
    ledger.assert_all_closed_once()
    assert sorted(engine.finished_sessions, key=str) == ["q0_0", "q0_1"]

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler), workers=0, rollout_timeout_s=timeout_s)
    with pytest.raises(TimeoutError, match=rf"rollout 1 \(q0_1\) exceeded generator.rollout_timeout_s={timeout_s}s"):
        await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)


async def test_retry_reruns_from_scratch_with_a_fresh_env(tokenizer, anyio_backend):
    ledger = EnvLedger()
    attempts = {"q0_1": 0}
    replies = turn_replies("first #### 7", "second #### 8")
    seen_first_calls = []

    def handler(call):
        if call.session_id == "q0_1" and len(call.prompt_token_ids) < 40:
            seen_first_calls.append(call.session_id)
        if call.session_id == "q0_1" and attempts["q0_1"] == 0:
            attempts["q0_1"] += 1
            raise ConnectionError("transient")
        return replies(call)

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, max_rollout_retries=2, rollout_retry_backoff_s=0.0)
    out = await gen.generate(make_batch(2, ledger), disable_tqdm=True)
    clean = await make_generator(tokenizer).generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert out["response_ids"] == [clean["response_ids"][0], clean["response_ids"][0]]
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/num_rollout_retries"] == 1
    assert out["rollout_metrics"]["generate/num_failed_rollouts"] == 0
    assert ledger.opened == 3  # the failed attempt's env, then a fresh one
    ledger.assert_all_closed_once()
    assert engine.finished_sessions.count("q0_1") == 2  # one per attempt


async def test_retries_exhausted_keep_the_last_failure(tokenizer, anyio_backend, caplog):
    ledger = EnvLedger()
    calls = {"n": 0}
    replies = turn_replies("first #### 7", "second #### 8")

    def handler(call):
        if call.session_id == "q0_1":
            calls["n"] += 1
            raise (ValueError if calls["n"] < 3 else KeyError)(f"attempt {calls['n']}")
        return replies(call)

    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        skip_failed_rollouts=True,
        max_rollout_retries=2,
        rollout_retry_backoff_s=0.001,
    )
    out = await gen.generate(make_batch(2, ledger), disable_tqdm=True)
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_rollout_retries"] == 2
    assert metrics["generate/failures/KeyError"] == 1
    assert "generate/failures/ValueError" not in metrics
    assert ledger.opened == 4
    ledger.assert_all_closed_once()
    failed_lines = [r for r in caplog.records if "failed on attempt" in r.getMessage()]
    assert len(failed_lines) == 1
    message = failed_lines[0].getMessage()
    assert "rollout 1 (q0_1) failed on attempt 3 with KeyError" in message
    assert failed_lines[0].levelno == logging.WARNING


async def test_bounded_concurrency_keeps_order_and_caps_live_envs(tokenizer, anyio_backend):
    ledger = EnvLedger()
    live = {"now": 0, "peak": 0}
    replies = turn_replies("first #### 7", "second #### 8")
    full = anyio.Event()

    async def handler(call):
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        if live["now"] == 3:
            full.set()
        # The first three wait for each other (an event, not a race against their tokenizing), so the
        # cap is reached on any machine; the short sleep gives a fourth the chance to break in.
        await full.wait()
        await anyio.sleep(0.01)
        live["now"] -= 1
        return replies(call)

    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, handler), max_concurrent_rollouts=3)
    out = await gen.generate(make_batch(10, ledger), disable_tqdm=True)
    clean = await make_generator(tokenizer).generate(make_batch(10, EnvLedger()), disable_tqdm=True)
    assert out["response_ids"] == clean["response_ids"]
    assert out["prompt_token_ids"] == clean["prompt_token_ids"]
    assert live["peak"] == 3
    ledger.assert_all_closed_once()


async def test_prompt_longer_than_max_input_length_is_a_clear_error(tokenizer, anyio_backend):
    gen = make_generator(tokenizer, max_input_length=5)
    with pytest.raises(PromptTooLongError, match=r"longer than generator.max_input_length=5"):
        await gen.generate(make_batch(1, EnvLedger(), with_ids=False), disable_tqdm=True)


async def test_prompt_too_long_in_step_wise_mode_yields_no_steps(tokenizer, anyio_backend):
    # SkyRL returns an empty step list for such a rollout; the placeholder shape must still come out right.
    replies = turn_replies("a #### 7", "b #### 8")
    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, replies),
        step_wise_trajectories=True,
        max_input_length=40,
    )
    batch = make_batch(2, EnvLedger())
    batch["prompts"][0] = [{"role": "user", "content": "a very long question " * 10}]
    out = await gen.generate(batch, disable_tqdm=True)
    # Rollout 0 contributes no rows; rollout 1 contributes its steps, the last one marked.
    assert out["trajectory_ids"]
    assert batch["trajectory_ids"] is not None
    assert set(map(str, out["trajectory_ids"])) == {str(batch["trajectory_ids"][1])}
    assert out["is_last_step"] is not None
    assert out["is_last_step"][-1] is True
    assert out["is_last_step"].count(True) == 1


async def test_step_wise_placeholder_is_one_last_step(tokenizer, anyio_backend):
    gen = make_generator(
        tokenizer, failing_engine(tokenizer, {"q0_0"}), step_wise_trajectories=True, skip_failed_rollouts=True
    )
    batch = make_batch(2, EnvLedger())
    out = await gen.generate(batch, disable_tqdm=True)
    validate_generator_output(2, out, step_wise=True)
    assert out["trajectory_ids"] is not None
    assert batch["trajectory_ids"] is not None
    assert out["is_last_step"] is not None
    assert out["trajectory_ids"][0] == batch["trajectory_ids"][0]
    assert out["is_last_step"][0] is True
    assert out["response_ids"][0] == [tokenizer.pad_token_id]
    assert out["rewards"][0] == [0.0]
    # The successful rollout contributes its two steps.
    assert out["trajectory_ids"][1:] == [batch["trajectory_ids"][1]] * 2


async def test_all_placeholders_in_step_wise_mode_take_the_configured_shape(tokenizer, anyio_backend):
    # No successful rollout has a trajectory (empty step list), so the shape comes from the config.
    replies = turn_replies("a #### 7", "b #### 8")

    def handler(call):
        if call.session_id == "q0_0":
            raise ConnectionError("down")
        return replies(call)

    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        step_wise_trajectories=True,
        skip_failed_rollouts=True,
        max_input_length=40,
    )
    batch = make_batch(2, EnvLedger())
    batch["prompts"][1] = [{"role": "user", "content": "a very long question " * 10}]
    out = await gen.generate(batch, disable_tqdm=True)
    assert out["rewards"] == [[0.0]]
    assert out["stop_reasons"] == [ROLLOUT_ERROR_STOP_REASON]


async def test_custom_template_placeholder_reward_is_a_float(tokenizer, anyio_backend):
    from skyrl_structured import ChatTemplateConfig, SamplingParams

    gen = make_generator(
        tokenizer,
        ScriptedEngine(
            tokenizer,
            lambda call: (_ for _ in ()).throw(OSError("x")) if call.session_id == "q0_0" else "fine",
            logprobs=False,
        ),
        skip_failed_rollouts=True,
        chat_template=ChatTemplateConfig(source="name", name_or_path="qwen3_with_thinking"),
        sampling_params=SamplingParams(logprobs=None),
    )
    out = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert out["rewards"][0] == 0.0
    assert isinstance(out["rewards"][1], float)
    assert out["rollout_logprobs"] is None


async def test_zero_reward_and_overlong_filters_leave_placeholders_inert(tokenizer, anyio_backend):
    gen = make_generator(
        tokenizer,
        failing_engine(tokenizer, {"q0_0"}),
        skip_failed_rollouts=True,
        zero_reward_on_non_stop=True,
        apply_overlong_filtering=True,
    )
    out = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert out["rewards"][0] == [0.0]
    assert out["loss_masks"][0] == [0]
    assert any(out["loss_masks"][1])


async def test_progress_bar_shows_failures(tokenizer, anyio_backend, monkeypatch):
    from skyrl_structured import progress

    bars = []

    class Recording(progress.Progress):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr("skyrl_structured._runtime.frame.Progress", Recording)
    gen = make_generator(tokenizer, failing_engine(tokenizer, {"q0_0", "q1_0"}), skip_failed_rollouts=True)
    await gen.generate(make_batch(4, EnvLedger()))
    (bar,) = bars
    assert (bar.done, bar.failed) == (4, 2)
    assert bar._bar is not None
    assert bar._bar.postfix == "in_flight=0, calls=4, failed=2"  # every attempt ended; the calls that came back
    assert bar._bar.desc == "Generating Trajectories"


@pytest.mark.parametrize("policy", ["fill_group_mean", "mask_group"])
async def test_group_policies_through_generate(tokenizer, anyio_backend, policy):
    def script_with(reward):
        return lambda: [{"observation": None, "reward": reward, "done": True}]

    ledger = EnvLedger()
    # Group q0: rewards 1.0, 0.0, failure; group q1: 1.0, 1.0, 1.0.
    batch = make_batch(6, ledger, group_size=3)
    assert batch["env_extras"] is not None
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]):
        batch["env_extras"][i]["script"] = script_with(reward)()
    gen = make_generator(
        tokenizer, failing_engine(tokenizer, {"q0_2"}), skip_failed_rollouts=True, failed_rollout_policy=policy
    )
    out = await gen.generate(batch, disable_tqdm=True)
    sums = [sum(r) for r in token_rewards(out)]
    if policy == "fill_group_mean":
        assert sums == [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
        assert out["rewards"][2] == [0.5]
        assert out["loss_masks"][2] == [0]
        assert all(any(m) for i, m in enumerate(out["loss_masks"]) if i != 2)
    else:
        assert sums == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
        assert [any(m) for m in out["loss_masks"]] == [False, False, False, True, True, True]
    ledger.assert_all_closed_once()
