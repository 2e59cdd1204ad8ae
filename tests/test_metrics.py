"""rollout_metrics: SkyRL's keys and values (parity is also checked end to end), the fast run counter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skyrl_structured import FailedRollout
from skyrl_structured._output.metrics import TrajectoryTimes, failure_metrics, rollout_metrics, turn_token_counts
from skyrl_structured.envs import CleanupStats
from skyrl_structured.failures import failure_budget_exceeded


def numpy_runs(masks):
    # The general path: numpy arrays never take the bytes fast path. The signature names only
    # sequences of ints; arrays are accepted at run time, so the cast just states that.
    arrays = [np.asarray(m, dtype=np.int64) for m in masks]
    return turn_token_counts(cast(list[Sequence[int]], arrays))


@given(st.lists(st.lists(st.sampled_from([0, 1, 2]), max_size=40), max_size=20))
def test_fast_run_counter_agrees_with_the_numpy_path(masks):
    assert turn_token_counts(masks) == numpy_runs(masks)


def test_turn_counts_examples():
    assert turn_token_counts([[1, 1, 0, 1], [0, 0], [], [1]]) == [2, 1, 1]
    assert turn_token_counts(cast(list[Sequence[int]], [np.array([1, 0, 1, 1])])) == [1, 2]  # arrays: see above
    assert turn_token_counts([[1, 300, 0, 1]]) == [2, 1]  # ints beyond a byte fall back to numpy


def _failed(i: int, exc: Exception, timed_out: bool = False) -> FailedRollout:
    return FailedRollout(index=i, exception=exc, elapsed=0.1, attempts=1, timed_out=timed_out)


def test_failure_metrics_are_counts_except_the_mean_named_fraction():
    # SkyRL's concatenate_generator_outputs sums every merged key without avg/mean/min/max in its
    # name: each count below stays a count, and the one ratio says "mean" so it is averaged.
    failures = [_failed(0, TimeoutError("t"), timed_out=True), _failed(3, ValueError("v")), _failed(5, ValueError("w"))]
    cleanup = CleanupStats(
        envs_opened=8, envs_closed=7, env_cleanup_timeouts=1, env_workers_killed=1, envs_lost_with_worker=2
    )
    assert failure_metrics(failures, 8, 2, cleanup) == {
        "generate/num_failed_rollouts": 3,
        "generate/mean_failed_rollout_fraction": 0.375,
        "generate/failure_budget_exceeded": 0,
        "generate/num_timed_out_rollouts": 1,
        "generate/num_cut_rollouts": 0,
        "generate/num_rollout_retries": 2,
        "generate/num_envs_opened": 8,
        "generate/num_envs_closed": 7,
        "generate/env_close_errors": 0,
        "generate/env_cleanup_timeouts": 1,
        "generate/finish_session_errors": 0,
        "generate/finish_session_timeouts": 0,
        "generate/env_workers_killed": 1,
        "generate/env_worker_crashes": 0,
        "generate/envs_lost_with_worker": 2,
        "generate/env_workers_recycled": 0,
        "generate/failures/TimeoutError": 1,
        "generate/failures/ValueError": 2,
    }


def test_failure_budget_exceeded_is_one_over_budget_and_zero_otherwise():
    failures = [_failed(0, ValueError("v")), _failed(1, ValueError("w"))]
    key = "generate/failure_budget_exceeded"
    assert failure_metrics(failures, 4, 0, CleanupStats(), budget_exceeded=True)[key] == 1
    assert failure_metrics(failures, 4, 0, CleanupStats())[key] == 0


def test_the_failure_budget_rule():
    # All of them, or more than the fraction; no failure is never over budget.
    assert failure_budget_exceeded(2, 4, 0.25)
    assert not failure_budget_exceeded(2, 4, 0.5)
    assert failure_budget_exceeded(2, 2, 1.0)  # every rollout failed
    assert not failure_budget_exceeded(0, 2, 0.0)
    assert not failure_budget_exceeded(0, 0, 1.0)


def test_time_stats_keep_upstream_names_and_add_an_averaged_p90_twin():
    metrics = rollout_metrics(
        [[1, 2], [3]],
        [1.0, 0.0],
        times=TrajectoryTimes([1.0, 3.0], {"llm": [0.5, 2.0], "env": [0.25, 0.5]}),
    )
    other = [1.0 - 0.5 - 0.25, 3.0 - 2.0 - 0.5]
    for name, times in (("completion", [1.0, 3.0]), ("llm", [0.5, 2.0]), ("env", [0.25, 0.5]), ("other", other)):
        # SkyRL main's names and values (skyrl/train/generators/utils.py::_add_time_stats) ...
        assert metrics[f"generate/trajectory_time_{name}_mean"] == pytest.approx(np.mean(times))
        assert metrics[f"generate/trajectory_time_{name}_p90"] == pytest.approx(np.percentile(times, 90))
        assert metrics[f"generate/trajectory_time_{name}_max"] == pytest.approx(max(times))
        # ... and the twin that skyrl 0.3.0's per-group merge averages instead of summing.
        assert metrics[f"generate/trajectory_time_{name}_p90_mean"] == metrics[f"generate/trajectory_time_{name}_p90"]
    # skyrl 0.3.0's own names for the completion times.
    assert metrics["generate/trajectory_completion_time_mean"] == 2.0
    assert metrics["generate/trajectory_completion_time_p90"] == pytest.approx(np.percentile([1.0, 3.0], 90))
    assert metrics["generate/trajectory_completion_time_max"] == 3.0
