"""Smoke test of the benchmark suite at toy sizes: it runs, and its result files have their shape.

No timing is asserted. What is asserted is behaviour the figures rely on: the generator's tokens
equal the bare loop's (checked inside the overhead benchmark), every successful rollout reaches
the output under faults, every environment is closed after cancellation (checked inside the
cancellation benchmark), and ``max_concurrent_rollouts`` caps live environments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run_all
from benchmarks.concurrency import simulate

from .helpers import LONG_RUN_TIMEOUT_S, SUBPROCESS_HANG_S

# The benchmarks run in process at toy sizes: minutes on a loaded machine (past the suite's 300 s at
# load 12-24 on 2 cores), so the bound is one only a hang reaches.
pytestmark = pytest.mark.timeout(LONG_RUN_TIMEOUT_S)

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _committed(results: Path) -> dict[str, bytes]:
    """Each committed result file's bytes, by path (a quick run's own folder left out)."""
    return {
        str(path.relative_to(results)): path.read_bytes()
        for path in sorted(results.rglob("*"))
        if path.is_file() and "quick" not in path.relative_to(results).parts
    }


def test_a_quick_run_leaves_the_committed_full_size_results_as_they_are(tmp_path):
    # `python -m benchmarks --quick` as a user runs it, in a copy of the benchmarks package (its
    # results/ included), so that a run that overwrote them would overwrite the copy's.
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("quick", "__pycache__"))
    results = tmp_path / "benchmarks" / "results"
    before = _committed(results)
    assert {"scale.json", "scale.png", "summary.md"} <= set(before)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--in-process", "--only", "scale", "--tokenizer", "tiny"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_HANG_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _committed(results) == before  # byte for byte
    quick = results / "quick"
    assert json.loads((quick / "scale.json").read_text())["machine"]["quick"] is True
    assert f"tables in {quick / 'summary.md'}" in done.stdout  # and it says where they went
    if not (ROOT / ".git").exists():
        return  # not a git checkout: nothing to keep clean
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "benchmarks/results/quick/scale.json"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0  # a quick run leaves the clone clean


def test_quick_results_are_not_published_to_the_docs():
    with pytest.raises(SystemExit) as refused:  # refused as the arguments are read: nothing runs
        run_all._args(["--quick", "--update-docs"])
    assert refused.value.code == 2


def test_simulated_schedule_bounds():
    chains = [[1.0, 2.0], [3.0], [0.5, 0.5, 0.5]]
    assert simulate(chains, limit=None, capacity=100) == pytest.approx(3.0)  # the slowest rollout
    assert simulate(chains, limit=None, capacity=1) == pytest.approx(7.5)  # the sum
    # One rollout at a time, in order: 3 + 3 + 1.5.
    assert simulate(chains, limit=1, capacity=100) == pytest.approx(7.5)


def test_quick_suite_writes_every_result(tmp_path):
    rc = run_all.main(["--quick", "--in-process", "--out", str(tmp_path), "--tokenizer", "tiny"])
    assert rc == 0

    for name in run_all.NAMES:
        document = json.loads((tmp_path / f"{name}.json").read_text())
        assert document["benchmark"] == name
        assert document["machine"]["quick"] is True
        assert "tokenizer" in document["machine"]
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC

    overhead = json.loads((tmp_path / "overhead.json").read_text())
    assert {(r["backend"], r["variant"]) for r in overhead["rows"]} == {
        (b, v) for b in ("asyncio", "trio") for v in ("inline", "threads")
    }
    for row in overhead["rows"]:
        assert row["ratio"] == pytest.approx(row["generator_s"]["median"] / row["bare_s"]["median"])

    scale = json.loads((tmp_path / "scale.json").read_text())
    assert all(r["peak_traced_bytes"] > 0 and r["retained_output_bytes"] > 0 for r in scale["rows"])

    concurrency = json.loads((tmp_path / "concurrency.json").read_text())
    for row in concurrency["rows"]:
        limit = row["max_concurrent_rollouts"]
        assert row["peak_live_envs"] <= (limit if limit is not None else row["n"])
    assert any(r["max_concurrent_rollouts"] is None and r["peak_live_envs"] == r["n"] for r in concurrency["rows"])

    cancellation = json.loads((tmp_path / "cancellation.json").read_text())
    assert {r["how"] for r in cancellation["rows"]} == {"cancel scope", "task.cancel"}
    assert all(r["latency_s"]["n"] >= 1 for r in cancellation["rows"])

    goodput = json.loads((tmp_path / "goodput.json").read_text())
    for row in goodput["rows"]:
        assert row["goodput"] == 1.0
        assert row["placeholders_match_faults"]
        assert any(c["placeholders"] > 0 for c in row["checks"])

    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["cprofile"]["generator/asyncio"]["top_cumulative"]
    assert (tmp_path / "profile_generator_trio.txt").stat().st_size > 0

    text = (tmp_path / "summary.md").read_text()
    for title in ("Overhead", "Scale", "Concurrency", "Cancellation", "Goodput", "Profile"):
        assert f"### {title}" in text


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_thread_lag_runs_every_turn_through_each_pool_size(backend, capsys):
    from benchmarks import thread_lag

    argv = ["--rollouts", "8", "--turns", "2", "--burst", "4", "--workers", "2,0", "--backend", backend]
    assert thread_lag.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == ["2 threads", "inline"]
    assert all(line.endswith("over 16 turns") for line in lines)  # every rollout's every turn came back


def test_observability_benchmark_runs_its_three_contenders(tmp_path, capsys):
    from benchmarks import observability

    out = tmp_path / "observability.json"
    argv = ["--n", "8", "--repeats", "1", "--tokenizer", "tiny", "--backend", "asyncio,trio", "--json", str(out)]
    assert observability.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["asyncio", "trio"]
    for row in rows:
        assert row["traced_ratio"] == pytest.approx(row["traced_s"] / row["plain_s"])
    assert "TraceRecorder x" in capsys.readouterr().out


def test_env_executor_benchmark_at_toy_size(tmp_path):
    from benchmarks import env_executors

    out = tmp_path / "env_executors.json"
    assert env_executors.main(["--quick", "--only", "cheap,hang,cancel", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["cheap"]["ratio"] == pytest.approx(results["cheap"]["process_s"] / results["cheap"]["thread_s"])
    hang = results["hang"]
    # Every rollout that did not hang on all its attempts is real, and the next batch is all real.
    assert hang["placeholders_by_error"].get("EnvWorkerError", 0) == 0
    assert hang["real"] + hang["placeholders"] == hang["n"]
    assert hang["next_batch_real"] == hang["next_batch_n"]
    assert hang["next_batch_workers_killed"] == 0
    assert results["cancel"]["every_env_closed_once"] is True


def test_env_executor_kills_benchmark_quick_run(tmp_path):
    """The "batch right after 8 kills" row: both batches real, 8 workers killed, their ratio (not its value)."""
    from benchmarks import env_executors

    out = tmp_path / "env_executors.json"
    assert env_executors.main(["--quick", "--only", "kills", "--json", str(out)]) == 0
    kills = json.loads(out.read_text())["kills"]
    assert kills["workers_killed"] == [16]  # 8 before the batch right after, 8 before the one after a pause
    ((clean_s, after_s, paused_s),) = kills["rounds_s"]
    assert (kills["without_kills_s"], kills["after_kills_s"], kills["after_kills_and_pause_s"]) == (
        clean_s,
        after_s,
        paused_s,
    )
    assert kills["ratio"] == pytest.approx(after_s / clean_s)
    assert kills["ratio_after_pause"] == pytest.approx(paused_s / clean_s)
