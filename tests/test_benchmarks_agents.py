"""Smoke test of the capture endpoint benchmark (``benchmarks/agents.py``) at toy sizes: shape and counts only.

No figure is asserted (rule 20). What is asserted: both parts ran on both backends with every
contender (``engine``, the pre-tokenized floor; ``remote``, its agents in a child process;
``openai_shared``, one base client with ``with_options`` per rollout; ``openai_own``, the official
client building its own HTTP client and TLS context per rollout, as the docs once showed; and
``workers`` where ``serve_capture`` takes ``workers``, else the one line saying why it is skipped),
at two ``--agents`` counts, every rollout made its three calls, on the endpoint every call after a
session's first extended its one branch (so the endpoint rows time the real capture path, not a
branch per call), and every row holds the load average and the loop's lag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import _agent_calls, _agent_probes, agents

from .helpers import LONG_RUN_TIMEOUT_S

# Both backends, every contender, an agent child process: minutes on a loaded machine (past the
# suite's 300 s at load 12-24 on 2 cores), so the bound is one only a hang reaches.
pytestmark = pytest.mark.timeout(LONG_RUN_TIMEOUT_S)


def _check_common(row, calls, kinds):
    assert len(row["load_avg"]) == 3
    for kind in kinds:
        assert row[f"{kind}_calls"] == [calls] * row["repeats"]
        assert row[f"{kind}_cpu_s"] > 0
        assert 0 <= row[f"{kind}_lag_mean_ms"] <= row[f"{kind}_lag_max_ms"]
        trainer = (row[f"{kind}_cpu_s"] - row["engine_cpu_s"]) / calls
        assert row[f"{kind}_trainer_cpu_ms_per_call"] == pytest.approx(1e3 * trainer)
        assert 0 < row[f"{kind}_loop_cpu_s"] <= row[f"{kind}_cpu_s"] + 0.01  # the loop's thread, one of the process's
        loop = (row[f"{kind}_loop_cpu_s"] - row["engine_loop_cpu_s"]) / calls
        assert row[f"{kind}_trainer_loop_cpu_ms_per_call"] == pytest.approx(1e3 * loop)
    for kind in [k for k in kinds if agents.is_endpoint(k)]:
        assert row[f"{kind}_extended_calls"] == [calls // 3 * 2] * row["repeats"]
        assert row[f"{kind}_branches"] == [calls // 3] * row["repeats"]
    for kind in [k for k in kinds if agents.is_workers(k)]:
        assert row[f"{kind}_start_s"][0] > 0
        assert len(row[f"{kind}_proc_cpu_s"][0]) >= 1  # the workers: processes under this one
        assert row[f"{kind}_worker_cpu_ms_per_call"] > 0


def test_quick_run_measures_every_contender_on_both_backends(tmp_path, capsys):
    out = tmp_path / "agents.json"
    assert agents.main(["--quick", "--tokenizer", "tiny", "--agents", "4,8", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["machine"]["quick"] is True
    assert results["turns"] == _agent_calls.TURNS == 3
    assert agents.ENDPOINT_CONTENDERS == ("httpx", "openai", "openai_shared", "openai_own", "remote")
    skipped = _agent_probes.workers_unsupported()
    workers = [] if skipped else ["workers"]
    kinds = results["contenders"]
    assert kinds == [*agents.CONTENDERS, *workers]

    cpu = results["cpu"]
    assert [row["backend"] for row in cpu] == ["asyncio", "trio"]
    for row in cpu:
        assert row["calls"] == row["rollouts"] * 3 == 48
        _check_common(row, 48, kinds)
        for kind in kinds[2:]:
            added = (row[f"{kind}_cpu_s"] - row["direct_cpu_s"]) / row["calls"]
            assert row[f"{kind}_cpu_added_ms_per_call"] == pytest.approx(1e3 * added)
        assert isinstance(row["meets_goal"], bool)
        assert isinstance(row["remote_meets_goal"], bool)
        assert ("workers_cpu_meets_goal" in row) is bool(workers)

    latency = results["latency"]
    assert [(row["backend"], row["agents"]) for row in latency] == [
        ("asyncio", 4),
        ("asyncio", 8),
        ("trio", 4),
        ("trio", 8),
    ]
    for row in latency:
        assert row["engine_latency_s"] == 0.2
        _check_common(row, row["agents"] * 3, kinds)
        for kind in kinds:
            added = row[f"{kind}_added"]
            assert added["n"] == row["agents"] * 3 * row["repeats"]
            assert added["p50_ms"] <= added["p90_ms"] <= added["p99_ms"] <= added["max_ms"]
        assert isinstance(row["meets_goal"], bool)
        assert isinstance(row["remote_meets_goal"], bool)
        assert ("workers_meets_goal" in row) is bool(workers)

    printed = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
    expected = [] if workers else [["workers", "skipped:", "serve_capture()"]]
    for backend in ("asyncio", "trio"):
        expected += [["load", backend, "cpu"], ["cpu", backend, "16"], ["lag", backend, "cpu"]]
    for backend in ("asyncio", "trio"):
        for n in ("4", "8"):
            expected += [["load", backend, "latency"], ["latency", backend, n], ["lag", backend, "latency"]]
            expected += [["goals", backend, n]] if workers else []
    assert [line for line in printed if line[0] != "goals" or line[2] != "cpu:"] == expected


def test_contenders_can_be_chosen_and_an_unknown_one_is_refused(tmp_path):
    out = tmp_path / "agents.json"
    argv = ["--quick", "--tokenizer", "tiny", "--only", "latency", "--backends", "trio", "--agents", "2"]
    assert agents.main([*argv, "--contenders", "engine,direct", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["latency"][0]
    assert row["direct_calls"] == [6]
    assert "httpx_calls" not in row
    with pytest.raises(SystemExit, match="unknown nope"):
        agents.main([*argv, "--contenders", "direct,nope"])
    with pytest.raises(SystemExit, match="positive integers"):
        agents.main([*argv, "--agents", "0"])
    with pytest.raises(SystemExit, match="--workers takes auto or positive integers"):
        agents.main([*argv, "--workers", "0"])


def test_the_engine_floor_renders_what_the_direct_agent_sends(tokenizer):
    pool = agents._TurnPool.build(tokenizer)
    prompts = agents.engine_prompts(tokenizer, pool, 3)
    assert [len(calls) for calls in prompts] == [3, 3, 3]
    messages = _agent_calls.first_messages(2)
    for turn in range(3):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompts[2][turn] == list(rendered)
        messages = _agent_calls.next_messages(messages, pool.texts[turn], 2, turn)


def test_a_child_process_cpu_is_read_from_proc():
    # The child spins until it has used 0.2 s of CPU by its own clock, says so, then waits: no speed assumed.
    spin = "import sys,time\nwhile time.process_time() < 0.2: pass\nprint('spun', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "spun\n"
        assert child.pid in _agent_probes.descendants(os.getpid())
        used = _agent_probes.proc_cpu_s(child.pid)
        assert used is not None
        assert used >= 0.19  # clock ticks: 10 ms granularity
    finally:
        child.communicate("")
    assert child.returncode == 0
    assert child.pid not in _agent_probes.descendants(os.getpid())
    assert _agent_probes.proc_cpu_s(child.pid) is None
