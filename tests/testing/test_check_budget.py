"""The kit on a broken environment: it stops once the budget is spent, and says how to narrow the check.

A hanging or leaking environment used to make every one of the 116 cases pay its bound (about 33 s
for a hang, the leak grace for a leak, stretched by a baseline the grace itself had slowed), so the
check was slowest exactly when there was something to fix (issue 38). A process-mode check on a
clean environment prints nothing but its summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured.testing import SCRIPTED_ENV, ConcurrencyReport, check_structured_concurrency
from skyrl_structured.testing.check import FAULT_STAGES, _cases

#: Everything the broken environments below hold (a leaked thread, a hung step) lets go when this is set.
RELEASE = threading.Event()


def _count(max_env_workers: tuple[int, ...]) -> int:
    """How many cases the default matrices hold per backend with these worker counts."""
    return len(_cases(FAULT_STAGES, ("fault", "cancel", "attack"), max_env_workers))


#: The full check's cases on both backends with the default worker counts (116).
ALL_CASES = 2 * _count((4, 0))


@pytest.fixture(autouse=True)
def _release_leftovers():
    RELEASE.clear()
    yield
    RELEASE.set()


class LeakingEnv(BaseTextEnv):  # type: ignore[misc]
    """Starts a thread in ``init`` that its ``close`` never stops."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def init(self, prompt: Any) -> Any:
        threading.Thread(target=RELEASE.wait, name="heartbeat", daemon=True).start()
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


class HangingEnv(LeakingEnv):
    """A ``step`` that never returns (until the test ends), with no thread of its own."""

    def init(self, prompt: Any) -> Any:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        RELEASE.wait(600)
        return super().step(action)


def _check(env_class: str, **arguments: Any) -> ConcurrencyReport:
    """The check with no bar, returning its report whatever it found."""
    return check_structured_concurrency(env_class, raise_on_failure=False, progress=False, **arguments)


def _register(env_id: str, cls: type) -> str:
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=cls)
    return env_id


def test_a_failing_check_starts_no_case_once_its_budget_is_spent():
    """A tiny budget is spent by the first failure: the first baseline runs, the other 115 cases do not."""
    env_class = _register("tests_budget_leak", LeakingEnv)
    report = _check(env_class, budget_s=0.001)
    [case] = report.cases
    assert (case.backend, case.kind, case.max_env_workers) == ("asyncio", "baseline", 4)
    assert any(p.startswith("thread left running: daemon thread 'heartbeat'") for p in case.problems)
    assert len(report.not_run) == ALL_CASES - 1
    # The second baseline (it calibrates max_env_workers=0) is not run either.
    assert "[asyncio] baseline (skip_failed_rollouts=False, max_env_workers=0)" in report.not_run
    lines = report.summary().splitlines()
    assert lines[0] == (
        f"check_structured_concurrency({env_class!r}): 1 cases, 1 failed, {ALL_CASES - 1} not run (a case had failed "
        "and budget_s=0.001 was spent; narrow the check as below, or pass budget_s=None to run every case)"
    )
    assert lines[-1] == "    narrow the check to it: matrices=(), backends=('asyncio',), max_env_workers=(4,)"


def test_a_clean_check_runs_every_case_whatever_the_budget():
    report = _check(SCRIPTED_ENV, budget_s=0.001, max_env_workers=(2,), matrices=("fault",), stages=("step",))
    assert report.ok, report.summary()
    assert len(report.cases) == 6
    assert report.not_run == []


def test_a_leak_does_not_stretch_the_calibrated_deadlines():
    """The baseline's leak check waits leak_grace_s for the leaked thread; the calibration measures the batch alone."""
    env_class = _register("tests_budget_leak", LeakingEnv)
    narrow: dict[str, Any] = {"backends": ("asyncio",), "max_env_workers": (2,), "stages": ("step",)}
    report = _check(env_class, matrices=("fault",), leak_grace_s=1.0, budget_s=None, **narrow)
    baseline = report.cases[0]
    assert baseline.kind == "baseline"
    assert not baseline.ok
    assert baseline.batch_s is not None
    assert report.baseline_s[2] == baseline.batch_s
    assert baseline.seconds - report.baseline_s[2] >= 1.0  # the grace the leak check waited is not the batch's
    assert len(report.cases) == 3
    assert report.not_run == []


def test_a_hung_case_costs_its_bound_once_and_then_the_check_stops():
    """A step that blocks the event loop itself (no worker threads): the baseline hangs, nothing runs after it."""
    env_class = _register("tests_budget_hang", HangingEnv)
    report = _check(env_class, max_env_workers=(0,), case_timeout_s=1.0, budget_s=0.001)
    [case] = report.cases
    assert case.kind == "baseline"
    assert case.problems[0].startswith("hung: still running after 4.5s and abandoned")
    assert len(report.not_run) == 2 * _count((0,)) - 1  # every other case, on both backends
    assert report.summary().splitlines()[-1] == (
        "    narrow the check to it: matrices=(), backends=('asyncio',), max_env_workers=(0,)"
    )


SCRIPT = """
from skyrl_structured.testing import SCRIPTED_ENV, ConcurrencyReport, check_structured_concurrency
prompts = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
env = "skyrl_structured.testing.worker_envs:TroubleEnv"
# The warm-up's deadline is case_timeout_s (20 s unset): a loaded machine overran 20 s once; only a hang passes 120 s.
report = check_structured_concurrency(
    env, env_executor="process", prompts=prompts, backends=("asyncio",), case_timeout_s=120.0
)
print(report.summary())
"""


@pytest.mark.slow
def test_outside_pytest_a_clean_process_mode_check_prints_only_its_summary(tmp_path):
    """The attacks kill workers on purpose; the executor's log line for each death is held back when all is well."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    env_id = "skyrl_structured.testing.worker_envs:TroubleEnv"
    assert proc.stdout == f"check_structured_concurrency({env_id!r}): 3 cases, 0 failed\n"
    assert proc.stderr == "", proc.stderr
