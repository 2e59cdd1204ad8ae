"""rollout_metrics: SkyRL's keys and values (parity is also checked end to end), the fast run counter."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from skyrl_structured.metrics import turn_token_counts


def numpy_runs(masks):
    # The general path: numpy arrays never take the bytes fast path.
    return turn_token_counts([np.asarray(m, dtype=np.int64) for m in masks])


@given(st.lists(st.lists(st.sampled_from([0, 1, 2]), max_size=40), max_size=20))
def test_fast_run_counter_agrees_with_the_numpy_path(masks):
    assert turn_token_counts(masks) == numpy_runs(masks)


def test_turn_counts_examples():
    assert turn_token_counts([[1, 1, 0, 1], [0, 0], [], [1]]) == [2, 1, 1]
    assert turn_token_counts([np.array([1, 0, 1, 1])]) == [1, 2]
    assert turn_token_counts([[1, 300, 0, 1]]) == [2, 1]  # ints beyond a byte fall back to numpy
