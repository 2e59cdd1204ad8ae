"""ConcurrencyReport.summary: each distinct problem once, with how often and where, not a line per rollout per case."""

from __future__ import annotations

from skyrl_structured.testing import ConcurrencyReport
from skyrl_structured.testing.check import CaseResult

#: The arguments that narrow the check to the cases below (each a fault at step with 4 worker threads).
NARROW = "stages=('step',), matrices=('fault',), backends=('asyncio',), max_env_workers=(4,)"
LEAK = "thread left running: daemon thread 'heartbeat' at /src/sandbox.py:41 in SandboxEnv.init.<locals>.beat"


def _case(name: str, backend: str, problems: list[str]) -> CaseResult:
    return CaseResult(
        name=name,
        backend=backend,
        kind="fault",
        stage="step",
        skip_failed_rollouts=True,
        max_env_workers=4,
        problems=problems,
        seconds=0.1,
    )


def test_identical_problems_across_cases_are_one_entry_with_their_count():
    report = ConcurrencyReport("sandbox_env")
    report.cases = [
        _case("baseline", "asyncio", [LEAK] * 4),
        _case("fault at step", "asyncio", [LEAK] * 3 + ["generate() returned a batch instead of raising"]),
        _case("cancel at init", "asyncio", []),
        *[_case(f"case {i}", "trio", [LEAK] * 4) for i in range(40)],
    ]
    summary = report.summary()
    assert summary.splitlines() == [
        "check_structured_concurrency('sandbox_env'): 43 cases, 42 failed, 2 distinct problems",
        f"- {LEAK}",
        "    167 times in 42 cases: [asyncio] baseline (x4); [asyncio] fault at step (x3); [trio] case 0 (x4) "
        "and 39 more",
        f"    narrow the check to it: {NARROW}",
        "- generate() returned a batch instead of raising",
        "    in [asyncio] fault at step",
        f"    narrow the check to it: {NARROW}",
    ]
    assert len(summary) < 800  # one leak in every rollout of every case no longer reads as 170 lines
    assert [len(case.problems) for case in report.failures][:2] == [4, 4]  # every case keeps its own list


def test_a_problem_repeated_in_one_case_counts_that_case_once():
    report = ConcurrencyReport("env")
    report.cases = [_case("baseline", "trio", ["2 inference sessions were never finished"] * 2)]
    assert report.summary() == (
        "check_structured_concurrency('env'): 1 cases, 1 failed\n"
        "- 2 inference sessions were never finished\n"
        "    2 times in 1 case: [trio] baseline (x2)\n"
        "    narrow the check to it: stages=('step',), matrices=('fault',), backends=('trio',), max_env_workers=(4,)"
    )


def test_past_five_distinct_problems_the_rest_are_counted_and_a_baseline_narrows_to_the_baseline():
    report = ConcurrencyReport("env")
    baseline = CaseResult("baseline", "trio", "baseline", None, False, 0, [f"problem {i}" for i in range(7)], 0.1)
    report.cases = [baseline]
    lines = report.summary().splitlines()
    assert lines[0] == "check_structured_concurrency('env'): 1 cases, 1 failed, 7 distinct problems"
    assert [line for line in lines if line.startswith("- ")] == [
        *(f"- problem {i}" for i in range(5)),
        "- and 2 more distinct problems (report.failures lists every case's)",
    ]
    assert lines[3] == "    narrow the check to it: matrices=(), backends=('trio',), max_env_workers=(0,)"


def test_cases_the_budget_left_out_are_counted_in_the_first_line():
    report = ConcurrencyReport("env", budget_s=60.0, not_run=["[asyncio] fault at step (x)", "[trio] baseline (x)"])
    report.cases = [_case("baseline", "asyncio", ["hung: still running"])]
    assert report.summary().splitlines()[0] == (
        "check_structured_concurrency('env'): 1 cases, 1 failed, 2 not run (a case had failed and budget_s=60 was "
        "spent; narrow the check as below, or pass budget_s=None to run every case)"
    )


def _busy(thread: str, where: str = "/src/sandbox.py:13 in HangingEnv.step") -> str:
    return f"thread still busy: skyrl-structured env pool worker {thread!r} at {where}"


def test_one_hang_seen_in_every_pool_thread_is_one_problem():
    # Issue 47 item 8: one hung step listed once per pool thread read as 7 "distinct problems".
    report = ConcurrencyReport("hang_env")
    threads = [f"skyrl-structured-env-{i}" for i in range(1, 8)]
    report.cases = [
        _case("baseline", "asyncio", [_busy(t) for t in threads[:4]]),
        _case("fault at step", "asyncio", [_busy(t) for t in threads[3:]]),
    ]
    lines = report.summary().splitlines()
    assert lines == [
        "check_structured_concurrency('hang_env'): 2 cases, 2 failed",
        "- thread still busy: 7 skyrl-structured env pool workers at /src/sandbox.py:13 in HangingEnv.step "
        "('skyrl-structured-env-1', 'skyrl-structured-env-2', 'skyrl-structured-env-3' and 4 more)",
        "    8 times in 2 cases: [asyncio] baseline (x4); [asyncio] fault at step (x4)",
        f"    narrow the check to it: {NARROW}",
    ]
    assert report.failures[0].problems == [_busy(t) for t in threads[:4]]  # each case keeps its own lines


def test_threads_at_different_places_stay_distinct_and_a_lone_thread_keeps_its_line():
    report = ConcurrencyReport("env")
    other = _busy("skyrl-structured-env-2", "/src/sandbox.py:20 in HangingEnv.close")
    report.cases = [_case("baseline", "trio", [_busy("skyrl-structured-env-1"), other, LEAK])]
    assert [line for line in report.summary().splitlines() if line.startswith("- ")] == [
        f"- {_busy('skyrl-structured-env-1')}",
        f"- {other}",
        f"- {LEAK}",
    ]
