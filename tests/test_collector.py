"""The collector: placeholders, reward-shape inference, failure budget, group policies, and the
invariants any pattern of failures must keep (Hypothesis)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_structured import (
    ROLLOUT_ERROR_STOP_REASON,
    FailedRollout,
    GeneratorConfig,
    GeneratorOutputError,
    ResilienceSettings,
    StepWiseOutput,
    TrajectoryID,
    TrajectoryOutput,
    validate_generator_output,
)
from skyrl_structured._output.collector import OutputSpec, build_generator_output
from skyrl_structured._output.placeholders import (
    RowLayout,
    apply_group_policy,
    check_failure_budget,
    infer_token_level_rewards,
    make_placeholder,
    substitute_placeholders,
)
from skyrl_structured._runtime.contexts import BatchShape
from skyrl_structured._runtime.supervisor import BatchResult
from skyrl_structured.envs import CleanupStats
from skyrl_structured.failures import failure_budget_exceeded

from ._upstream import load_upstream_validator

PAD = 0


def _spec(cfg: GeneratorConfig, resilience: ResilienceSettings, *, get_logprobs: bool) -> OutputSpec:
    return OutputSpec(
        cfg, resilience, placeholder_token_id=PAD, float_rewards=False, routed_experts=False, get_logprobs=get_logprobs
    )


def failure(i=0, exc=None, elapsed=1.5, splits=None):
    return FailedRollout(index=i, exception=exc or ValueError("x"), elapsed=elapsed, attempts=1, time_splits=splits)


def trajectory(n: int, token_level: bool, reward: float = 1.0) -> TrajectoryOutput:
    rewards = [0.0] * (n - 1) + [reward] if token_level else reward
    return TrajectoryOutput(
        response_ids=list(range(10, 10 + n)),
        reward=rewards,
        stop_reason="stop",
        loss_mask=[1] * n,
        prompt_ids=[1, 2, 3],
        rollout_logprobs=[-0.1] * n,
        env_metrics={"turns": 1},
        e2e_time=0.5,
        time_splits={"llm": 0.2, "env": 0.1},
    )


def test_placeholder_has_exactly_the_documented_fields():
    p = make_placeholder(
        failure(splits={"llm": 0.4, "env": 0.0}),
        token_id=PAD,
        token_level_rewards=True,
        with_logprobs=True,
        step_wise=False,
    )
    assert p == TrajectoryOutput(
        response_ids=[PAD],
        reward=[0.0],
        stop_reason=ROLLOUT_ERROR_STOP_REASON,
        loss_mask=[0],
        prompt_ids=[PAD],
        rollout_logprobs=[0.0],
        env_metrics={},
        e2e_time=1.5,
        time_splits={"llm": 0.4, "env": 0.0},
    )
    p = make_placeholder(failure(), token_id=7, token_level_rewards=False, with_logprobs=False, step_wise=False)
    assert isinstance(p, TrajectoryOutput)
    assert (p.reward, p.rollout_logprobs, p.response_ids) == (0.0, None, [7])


def test_step_wise_placeholder_is_a_single_last_step():
    p = make_placeholder(failure(), token_id=PAD, token_level_rewards=True, with_logprobs=False, step_wise=True)
    assert isinstance(p, StepWiseOutput)
    assert len(p.step_outputs) == 1
    assert p.e2e_time == 1.5
    assert p.step_outputs[0].stop_reason == ROLLOUT_ERROR_STOP_REASON


def test_every_placeholder_is_fresh():
    out = substitute_placeholders(
        [failure(0), failure(1)], token_id=PAD, default_token_level_rewards=True, with_logprobs=True, step_wise=False
    )
    out[0].reward.append(9.0)
    out[0].loss_mask[0] = 1
    assert out[1].reward == [0.0]
    assert out[1].loss_mask == [0]


def test_reward_shape_comes_from_first_success_with_a_trajectory():
    empty = StepWiseOutput(step_outputs=[])
    scalar = trajectory(3, token_level=False)
    assert infer_token_level_rewards([failure(), empty, scalar], default=True) is False
    assert infer_token_level_rewards([failure(), empty], default=True) is True
    assert infer_token_level_rewards([failure(), empty], default=False) is False
    assert infer_token_level_rewards([StepWiseOutput([trajectory(2, True)])], default=False) is True


def _check(failures: list[FailedRollout], total: int, max_fraction: float, **kwargs: Any) -> bool:
    # The verdict as the supervisor reaches it, then worded and acted on by the collector.
    exceeded = failure_budget_exceeded(len(failures), total, max_fraction)
    return check_failure_budget(failures, total, max_fraction, exceeded=exceeded, **kwargs)


def test_budget_messages_count_by_type_and_chain_the_first():
    failures = [failure(2, KeyError("b")), failure(0, OSError("a")), failure(1, OSError("c"))]
    with pytest.raises(RuntimeError, match=r"All 3 rollouts failed \(2 x OSError, 1 x KeyError\)") as info:
        _check(failures, 3, 1.0)
    assert str(info.value.__cause__) == "a"
    _check(failures[:1], 3, 0.34)  # 1/3 <= 0.34
    with pytest.raises(RuntimeError, match=r"2 of 3 rollouts failed"):
        _check(failures[:2], 3, 0.5)


def test_raise_names_the_knob_that_would_keep_the_step():
    with pytest.raises(
        RuntimeError, match=r"generator.failure_budget_action=warn returns such a step with placeholders"
    ):
        _check([failure(0)], 1, 1.0)


def _budget_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "skyrl_structured._output.placeholders"]


def test_warn_logs_one_warning_and_reports_an_over_budget_step(caplog):
    every = [failure(1, OSError("b")), failure(0, OSError("a"))]
    assert _check(every, 2, 1.0, action="warn") is True
    (record,) = _budget_warnings(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "All 2 rollouts failed (2 x OSError); a step made only of placeholders carries no training signal. "
        "Returning the step with 2 placeholder(s) because generator.failure_budget_action=warn; "
        "the first error was OSError: a"
    )
    caplog.clear()
    assert _check(every, 4, 0.25, action="warn") is True
    (record,) = _budget_warnings(caplog)
    assert record.getMessage().startswith(
        "2 of 4 rollouts failed (2 x OSError), more than generator.max_failed_rollout_fraction=0.25 allows. "
        "Returning the step with 2 placeholder(s) because generator.failure_budget_action=warn"
    )


def test_warn_within_budget_is_silent(caplog):
    assert _check([failure(0)], 4, 0.25, action="warn") is False
    assert _check([], 4, 0.0, action="warn") is False
    assert _check([failure(0)], 4, 0.25) is False
    assert _budget_warnings(caplog) == []


@pytest.mark.parametrize("step_wise", [False, True])
@pytest.mark.parametrize("default_token_level", [True, False])
@pytest.mark.parametrize("policy", ["placeholder", "mask_group", "fill_group_mean"])
def test_a_step_of_only_placeholders_is_a_valid_batch(step_wise, default_token_level, policy):
    # failure_budget_action=warn returns a step in which every rollout failed: the reward shape then
    # comes from the configuration (no rollout has a trajectory to infer it from).
    n = 4
    token_level = default_token_level or step_wise
    failures = [failure(i, ConnectionError(f"down {i}")) for i in range(n)]
    results = substitute_placeholders(
        failures, token_id=PAD, default_token_level_rewards=token_level, with_logprobs=True, step_wise=step_wise
    )
    out = build_generator_output(
        results,
        BatchResult(list(failures), failures, retries=0, cleanup=CleanupStats()),
        BatchShape(n, [TrajectoryID("g", i) for i in range(n)], ["gsm8k"] * n, step_wise=step_wise),
        _spec(
            GeneratorConfig(step_wise_trajectories=step_wise),
            ResilienceSettings(skip_failed_rollouts=True, failure_budget_action="warn", failed_rollout_policy=policy),
            get_logprobs=True,
        ),
        budget_exceeded=True,
    )
    validate_generator_output(n, out, step_wise=step_wise)
    load_upstream_validator()(n, out, step_wise=step_wise)  # SkyRL's trainer accepts it too
    assert out["rewards"] == [[0.0] if token_level else 0.0] * n
    assert out["loss_masks"] == [[0]] * n
    assert out["stop_reasons"] == [ROLLOUT_ERROR_STOP_REASON] * n
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_failed_rollouts"] == n
    assert metrics["generate/mean_failed_rollout_fraction"] == 1.0
    assert metrics["generate/failure_budget_exceeded"] == 1
    assert metrics["generate/failures/ConnectionError"] == n


def test_group_policies_worked_example():
    # Group "a": rewards 1, 0, failure. Group "b": all fine.
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    masks = [[1, 1], [1], [0], [1], [1, 1, 1]]
    common: dict[str, Any] = dict(
        layout=RowLayout([0, 1, 2, 3, 4], [True] * 5),
        failed=[False, False, True, False, False],
        groups=["a", "a", "a", "b", "b"],
    )

    placeholder_rewards = list(rewards)
    apply_group_policy("placeholder", rewards=placeholder_rewards, loss_masks=[m[:] for m in masks], **common)
    assert placeholder_rewards == rewards  # group "a" mean drops from 0.5 to 1/3

    filled = list(rewards)
    apply_group_policy("fill_group_mean", rewards=filled, loss_masks=[m[:] for m in masks], **common)
    assert filled == [1.0, 0.0, 0.5, 1.0, 1.0]  # group "a" mean stays 0.5

    masked, masked_masks = list(rewards), [m[:] for m in masks]
    apply_group_policy("mask_group", rewards=masked, loss_masks=masked_masks, **common)
    assert masked == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert masked_masks == [[0, 0], [0], [0], [1], [1, 1, 1]]


def test_fill_group_mean_places_token_level_mean_on_the_last_token():
    rewards = [[0.0, 1.0], [0.0, 0.0, 0.5], [0.0]]
    apply_group_policy(
        "fill_group_mean",
        rewards=rewards,
        loss_masks=[[1, 1], [1, 1, 1], [0]],
        layout=RowLayout([0, 1, 2], [True] * 3),
        failed=[False, False, True],
        groups=["g"] * 3,
    )
    assert rewards[2] == [0.75]


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    step_wise = draw(st.booleans())
    token_level = True if step_wise else draw(st.booleans())
    failed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if all(failed):
        failed[draw(st.integers(0, n - 1))] = False
    lengths = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    steps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) if step_wise else [1] * n
    policy = draw(st.sampled_from(["placeholder", "mask_group", "fill_group_mean"]))
    logprobs = draw(st.booleans())
    return n, step_wise, token_level, failed, lengths, steps, policy, logprobs


@settings(max_examples=150, deadline=None)
@given(batches())
def test_any_failure_pattern_keeps_order_size_lengths_and_one_reward_shape(case):
    n, step_wise, token_level, failed, lengths, steps, policy, logprobs = case
    results = []
    for i in range(n):
        if failed[i]:
            results.append(failure(i))
        elif step_wise:
            results.append(
                StepWiseOutput(
                    [trajectory(lengths[i] + k, True, reward=float(i)) for k in range(steps[i])],
                    e2e_time=0.1,
                    time_splits={"llm": 0.0, "env": 0.0},
                )
            )
        else:
            t = trajectory(lengths[i], token_level, reward=float(i))
            if not logprobs:
                t.rollout_logprobs = None
            results.append(t)
    substituted = substitute_placeholders(
        results, token_id=PAD, default_token_level_rewards=True, with_logprobs=logprobs, step_wise=step_wise
    )
    ids = [TrajectoryID(f"g{i // 3}", i % 3) for i in range(n)]
    out = build_generator_output(
        substituted,
        BatchResult(results, [r for r in results if isinstance(r, FailedRollout)], retries=0, cleanup=CleanupStats()),
        BatchShape(n, ids, ["gsm8k"] * n, step_wise=step_wise),
        _spec(
            GeneratorConfig(step_wise_trajectories=step_wise),
            ResilienceSettings(skip_failed_rollouts=True, failed_rollout_policy=policy),
            get_logprobs=logprobs,
        ),
    )
    expected_rows = sum(1 if failed[i] else steps[i] for i in range(n))
    if expected_rows == 0:  # only step-wise rollouts with no steps: nothing to train on, as in SkyRL
        with pytest.raises(GeneratorOutputError, match="no outputs generated"):
            validate_generator_output(n, out, step_wise=step_wise)
        return
    validate_generator_output(n, out, step_wise=step_wise)
    if not step_wise:
        assert len(out["response_ids"]) == n
        for i in range(n):
            if failed[i]:
                assert out["stop_reasons"] is not None
                assert out["stop_reasons"][i] == ROLLOUT_ERROR_STOP_REASON
                assert out["loss_masks"][i] == [0]
            else:  # order kept: row i is rollout i
                assert out["response_ids"][i] == list(range(10, 10 + lengths[i]))
    else:
        assert len(out["response_ids"]) == expected_rows
        assert out["trajectory_ids"] is not None
        assert out["is_last_step"] is not None
        assert [t.to_string() for t, last in zip(out["trajectory_ids"], out["is_last_step"], strict=True) if last] == [
            ids[i].to_string() for i in range(n) if failed[i] or steps[i]
        ]
    shapes = {isinstance(r, list) for r in out["rewards"]}
    assert len(shapes) <= 1
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_failed_rollouts"] == sum(failed)
    if policy == "mask_group":
        tainted = {ids[i].instance_id for i in range(n) if failed[i]}
        rows = out["trajectory_ids"] if step_wise else ids
        assert rows is not None
        for row, tid in enumerate(rows):
            if tid.instance_id in tainted:
                assert not any(out["loss_masks"][row])
