"""The straggler benchmark at toy size: the figures it reports rest on the right behaviour (never a timing).

Its quick mode holds each cutoff's tail until the cut (an event, not a clock), so the counts below
are exact on any machine, however loaded (issue 27 item 11: real latencies alone cut nothing when
the event loop was starved).
"""

from __future__ import annotations

from benchmarks import stragglers
from skyrl_structured._runtime.stragglers import cutoff_threshold


def test_straggler_benchmark_quick_run_cuts_the_tail_and_reports_every_policy():
    result = stragglers.run(quick=True, backends=["asyncio"], repeats=1, tokenizer_name="tiny")
    n = result["n"]
    wall = {row["cutoff"]: row for row in result["wall"]}
    assert set(wall) == set(stragglers.CUTOFFS)
    assert (wall[1.0]["cut_rollouts"], wall[1.0]["trainable_rows"]) == (0, n)
    for cutoff in (0.90, 0.95, 0.99):
        row = wall[cutoff]
        # Grace 0: everything past ceil(cutoff * n) is cut (held until then in quick mode).
        assert row["cut_rollouts"] == n - cutoff_threshold(cutoff, n) > 0
        assert row["trainable_rows"] == n - row["cut_rollouts"]
    assert result["latency_p99_s"] / result["latency_p50_s"] > 5  # a long tail, as specified
    policies = {(r["scenario"], r["cutoff"], r["policy"]) for r in result["grpo"]}
    assert len(policies) == len(stragglers.SCENARIOS) * len(stragglers.GRPO_CUTOFFS) * len(stragglers.POLICIES)
    for row in result["grpo"]:
        assert row["cut"] == n - cutoff_threshold(row["cutoff"], n)
        if row["scenario"] == "slow means wrong":
            assert row["cut_correct_share"] < row["kept_correct_share"]  # the cut took the slow, mostly wrong ones
        if row["policy"] == "mask_group":
            assert row["trainable_rows"] < n - row["cut"]  # the cut groups train nothing
        else:
            assert row["trainable_rows"] == n - row["cut"]
    assert "| asyncio | 0.95 |" in stragglers.tables(result)
