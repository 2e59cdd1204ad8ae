"""The carry-over benchmark at toy size: its ledger adds up and carry-over discards nothing (never a timing).

Single-turn rollouts with inline environments can only be cut inside their engine request (the
one place they wait), so with carry-over every cut is parked and no sampled token is lost, on any
machine; without it the cut requests' tokens are discarded.
"""

from __future__ import annotations

import pytest

from benchmarks import carry_over


@pytest.mark.timeout(1800)  # a hang bound: the quick run takes seconds
def test_carry_over_benchmark_quick_run_trains_every_group_and_discards_nothing_with_carry_over():
    result = carry_over.run(quick=True, backends=["asyncio"], repeats=1, tokenizer_name="tiny")
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == set(carry_over.CONTENDERS)  # SkyRL's generator included: the dev extra installs it
    for name, row in rows.items():
        assert row["groups"] == result["steps"] * result["groups"], name
        ledger = (
            row["tokens_trained"]
            + row["tokens_filtered"]
            + row["tokens_discarded"]
            + row["tokens_dropped_stale"]
            + row["tokens_parked_at_end"]
        )
        assert ledger == row["tokens_sampled"], name
        if name.startswith("carry-over"):
            assert row["tokens_discarded"] == 0, name
    assert rows["upstream + filter"]["staleness_mean"] == 0.0
    assert "| asyncio | carry-over, oversample 1.0 |" in carry_over.table(result)
