"""Smoke test of the capture endpoint benchmark (``benchmarks/agents.py``) at toy sizes: shape and counts only.

No figure is asserted (rule 20). What is asserted: both parts ran on both backends with every
contender (``remote`` included: its agents in a child process; ``openai_own``, the official client
building its own HTTP client and TLS context per rollout, as the docs once showed), every rollout made its three calls,
and on the endpoint every call after a session's first extended its one branch (so the endpoint rows
time the real capture path, not a branch per call).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import agents

from .helpers import LONG_RUN_TIMEOUT_S

# Both backends, every contender, an agent child process: minutes on a loaded machine (past the
# suite's 300 s at load 12-24 on 2 cores), so the bound is one only a hang reaches.
pytestmark = pytest.mark.timeout(LONG_RUN_TIMEOUT_S)


def test_quick_run_measures_every_contender_on_both_backends(tmp_path, capsys):
    out = tmp_path / "agents.json"
    assert agents.main(["--quick", "--tokenizer", "tiny", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["machine"]["quick"] is True
    assert results["turns"] == agents.TURNS == 3

    cpu = results["cpu"]
    assert [row["backend"] for row in cpu] == ["asyncio", "trio"]
    for row in cpu:
        assert row["calls"] == row["rollouts"] * 3 == 48
        for kind in agents.CONTENDERS:
            assert row[f"{kind}_calls"] == [48] * row["repeats"]
            assert row[f"{kind}_cpu_s"] > 0
        assert agents.ENDPOINT_CONTENDERS == ("httpx", "openai", "openai_own", "remote")
        for kind in agents.ENDPOINT_CONTENDERS:
            assert row[f"{kind}_extended_calls"] == [16 * 2] * row["repeats"]
            assert row[f"{kind}_branches"] == [16] * row["repeats"]
            added = (row[f"{kind}_cpu_s"] - row["direct_cpu_s"]) / row["calls"]
            assert row[f"{kind}_cpu_added_ms_per_call"] == pytest.approx(1e3 * added)
        assert isinstance(row["meets_goal"], bool)
        assert isinstance(row["remote_meets_goal"], bool)

    latency = results["latency"]
    assert [row["backend"] for row in latency] == ["asyncio", "trio"]
    for row in latency:
        assert row["engine_latency_s"] == 0.2
        for kind in agents.CONTENDERS:
            assert row[f"{kind}_calls"] == [row["agents"] * 3] * row["repeats"]
            added = row[f"{kind}_added"]
            assert added["n"] == row["agents"] * 3 * row["repeats"]
            assert added["p50_ms"] <= added["p90_ms"] <= added["p99_ms"] <= added["max_ms"]
        assert isinstance(row["meets_goal"], bool)
        assert isinstance(row["remote_meets_goal"], bool)

    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in printed] == [
        ["cpu", "asyncio"],
        ["cpu", "trio"],
        ["latency", "asyncio"],
        ["latency", "trio"],
    ]
