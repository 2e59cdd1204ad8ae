"""The kit names the processes an environment's close left running (issue 47 item 7).

A sandbox env starts a process per episode and must stop it in ``close()``; one that forgot passed
the check ("116 cases, 0 failed") with hundreds of sandboxes still alive. The env here is real and
so are its sandboxes (``sleep 1000``); every one this module started is killed after each test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured.testing import ConcurrencyReport, check_structured_concurrency
from skyrl_structured.testing._report import SHARED_PROCESSES_CASE, narrowing
from skyrl_structured.testing.worker_envs import register_trouble_env

PROMPTS = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
#: A small thread-mode check: the baseline and the faults at step, 2 worker threads, both backends.
NARROW: dict[str, Any] = {"max_env_workers": (2,), "matrices": ("fault",), "stages": ("step",)}
LEFTOVER = re.compile(r"^process left running after the environment closed: 'sleep 1000' \(pid (\d+)\)$")


def _sandboxes(ledger: Path) -> list[int]:
    return [int(path.read_text()) for path in ledger.glob("*.sandbox")]


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Path]:
    """Where the envs write their sandboxes' pids; every sandbox still there is killed (and reaped) afterwards."""
    yield tmp_path
    for pid in _sandboxes(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # a worker's sandbox is not ours to reap
            os.waitpid(pid, 0)


def _check(ledger: Path, sandbox: str, **arguments: Any) -> ConcurrencyReport:
    return check_structured_concurrency(
        register_trouble_env(),
        prompts=PROMPTS,
        env_extras={"sandbox": sandbox, "ledger_dir": str(ledger)},
        raise_on_failure=False,
        progress=False,
        budget_s=None,
        **arguments,
    )


def _leftover_pids(report: ConcurrencyReport) -> list[int]:
    pids = []
    for case in report.cases:
        for problem in case.problems:
            match = LEFTOVER.match(problem)
            assert match is not None, problem  # nothing else failed
            pids.append(int(match[1]))
    return pids


def test_a_sandbox_its_close_forgets_fails_every_case_and_is_named_with_its_pid(ledger):
    report = _check(ledger, "forget", **NARROW)
    assert [(c.backend, c.kind, c.verdict) for c in report.cases] == [
        (backend, kind, "failed") for backend in ("asyncio", "trio") for kind in ("baseline", "fault", "fault")
    ]
    started = _sandboxes(ledger)
    named = _leftover_pids(report)
    assert len(started) == 12  # every rollout of every case started one
    assert sorted(named) == sorted(started)  # each named once, in the case that left it
    lines = report.summary().splitlines()
    # One forgotten sandbox per episode is one problem, not one per process.
    assert lines[0] == f"check_structured_concurrency({register_trouble_env()!r}): 6 cases, 6 failed"
    assert lines[1].startswith("- process left running after the environment closed: 'sleep 1000' (12 processes: pids ")
    assert lines[2].startswith("    12 times in 6 cases: [asyncio] baseline (skip_failed_rollouts=False, ")


def test_a_sandbox_its_close_stops_is_no_leak(ledger):
    report = _check(ledger, "stop", **NARROW)
    assert report.ok, report.summary()
    assert len(_sandboxes(ledger)) == 12


def test_cases_run_at_once_are_judged_together_once_they_have_ended(ledger):
    # Sharing the process, a case cannot tell its sandboxes from another's still running: the cases
    # the lanes ran are judged once all have ended, in one result that narrows to jobs=1.
    report = _check(ledger, "forget", jobs=2, **NARROW)
    shared = [c for c in report.cases if c.kind == "processes"]
    assert [(c.name, c.backend) for c in shared] == [(f"{SHARED_PROCESSES_CASE} (2 at once)", "asyncio+trio")]
    assert sorted(_leftover_pids(report)) == sorted(_sandboxes(ledger))
    assert narrowing(shared[0]) == "jobs=1"
    clean = _check(ledger, "stop", jobs=2, **NARROW)
    assert clean.ok, clean.summary()


def test_the_process_executor_names_a_sandbox_left_running_in_its_worker(ledger):
    # Every env the attacks closed left its sandbox: all are named (those of an env killed with its
    # worker died with it, and are not); the kit's own worker processes are never named.
    report = _check(ledger, "forget", env_executor="process")
    assert len(report.cases) == 6
    assert all(c.problems for c in report.cases)
    named = _leftover_pids(report)
    assert named
    assert set(named) <= set(_sandboxes(ledger))
    clean = _check(ledger, "stop", env_executor="process")
    assert clean.ok, clean.summary()
