"""The kit on a realistically slow environment, and outside pytest.

A ``close`` that takes 3 s: the kit measures a clean baseline first and fits its own deadlines to
it, runs the other cases in lanes at once (the environment mostly waits), and reports the closes it
had to abandon in the hang cases as **slow, not leaked**, naming ``leak_grace_s``. A reduced case
set keeps the test short; the full check on the same environment takes about two minutes (see
docs/testing.md) where it took about fourteen.

Outside pytest a clean check prints one line: no WARNING per injected failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured.generator import StructuredGymGenerator
from skyrl_structured.testing import SCRIPTED_ENV, check_structured_concurrency
from skyrl_structured.testing._matrix import Setup
from skyrl_structured.testing._runners import CaseTracker, _settle
from skyrl_structured.testing._schedule import (
    DEFAULT_CASE_TIMEOUT_S,
    MAX_LANES,
    SLOW_BASELINE_S,
    TIMEOUT_BASELINES,
    Calibration,
    lanes_for,
)

ENV_ID = "tests_check_slow_close"
CLOSE_S = 3.0


class SlowCloseEnv(BaseTextEnv):  # type: ignore[misc]
    """A correct environment whose teardown takes seconds (a sandbox's delete call)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def init(self, prompt: Any) -> Any:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})

    def close(self) -> None:
        time.sleep(CLOSE_S)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=SlowCloseEnv)


def test_a_slow_close_is_slow_not_leaked_and_the_kit_fits_its_deadlines_to_it():
    # Baseline, then the two hang attacks (their cleanup gives up after 25 ms, so the other rollouts'
    # closes outlive generate()) and a close fault, on both backends.
    report = check_structured_concurrency(
        ENV_ID, max_env_workers=(4,), matrices=("hang", "fault"), stages=("close",), progress=False
    )
    assert report.ok, report.summary()
    assert report.baseline_s[4] >= CLOSE_S  # one clean batch, measured: it waits for its closes
    assert report.case_timeouts[4] >= 10 * CLOSE_S  # ten baselines, not the kit's fixed 20 s
    assert report.lanes > 1  # the cases mostly wait, so they ran at once
    slow = report.slow
    assert {(c.backend, c.kind) for c in slow} == {("asyncio", "hang"), ("trio", "hang")}
    for case in slow:
        assert case.verdict == "slow"
        (line,) = case.slow
        assert line.startswith(
            "slow, not leaked: the environment's worker threads were still busy after leak_grace_s=1s"
        )
        assert "pass leak_grace_s=" in line
    assert {c.verdict for c in report.cases if c.kind != "hang"} == {"passed"}
    head = report.summary().splitlines()[0]
    assert head == f"check_structured_concurrency({ENV_ID!r}): {len(report.cases)} cases, 0 failed, 2 slow (not leaked)"


@pytest.mark.anyio
async def test_threads_idle_by_the_second_look_make_the_case_slow_not_failed(anyio_backend):
    """Threads busy at the end of ``leak_grace_s`` and idle a moment later: slow, never those stale lines.

    Under load the moment can be long; the kit once reported the lines seen at the end of the grace as
    leaks, and failed a case whose threads had gone idle meanwhile.
    """
    tracker = CaseTracker(shared=False)  # this process, now: no thread of the test's is busy
    setup = Setup(ENV_ID, [], [], None, [], StructuredGymGenerator, {}, None, 30.0, leak_grace_s=1.0, target=0)
    slow_setup = replace(setup, settle_s=8.0)
    seen = ["1 environment calls are still running in worker threads", "thread still busy: worker 'w' at env.py:9"]
    problems, slow = await _settle(tracker, slow_setup, seen)
    assert problems == []
    (line,) = slow
    assert line.startswith("slow, not leaked: the environment's worker threads were still busy after leak_grace_s=1s")
    # Without a slow baseline there is no wait (the lines stand), and a leak that is not a thread's is
    # never slowness.
    assert await _settle(tracker, setup, seen) == (seen, [])
    unclosed = ["1 of 4 environments were never closed"]
    assert await _settle(tracker, slow_setup, unclosed) == (unclosed, [])


def test_a_leak_grace_long_enough_accepts_the_slow_close():
    report = check_structured_concurrency(
        ENV_ID,
        backends=("asyncio",),
        max_env_workers=(4,),
        matrices=("hang",),
        stages=("close",),
        leak_grace_s=2 * CLOSE_S,
        progress=False,
    )
    assert [c.verdict for c in report.cases] == ["passed", "passed"], report.summary()


def test_a_fast_environment_runs_its_cases_one_at_a_time():
    report = check_structured_concurrency(
        SCRIPTED_ENV, backends=("asyncio",), max_env_workers=(2,), matrices=("fault",), progress=False
    )
    assert report.ok, report.summary()
    # The kit's rule, applied to what it measured: a loaded machine may measure the baseline slow
    # (and waiting), and the rule itself is checked on fixed measurements below.
    baseline = report.baseline_s[2]
    assert report.case_timeouts == {2: max(DEFAULT_CASE_TIMEOUT_S, TIMEOUT_BASELINES * baseline)}
    if baseline < SLOW_BASELINE_S:
        assert report.lanes == 1


def test_lanes_follow_the_baselines_speed_and_cpu_share():
    fast = Calibration(seconds=0.05, cpu_fraction=0.2, clean=True)
    waiting = Calibration(seconds=3.0, cpu_fraction=0.01, clean=True)
    computing = Calibration(seconds=3.0, cpu_fraction=0.9, clean=True)
    hung = Calibration(seconds=3.0, cpu_fraction=0.01, clean=False)
    assert lanes_for([fast], None, 12) == 1  # a case costs about its setup: nothing to gain
    assert lanes_for([waiting], None, 12) == MAX_LANES
    assert lanes_for([waiting], None, 3) == 3
    assert lanes_for([waiting, computing], None, 12) == 1
    assert lanes_for([waiting, hung], None, 12) == 1
    assert lanes_for([fast], 4, 12) == 4  # `jobs` decides


def test_lanes_judge_each_case_by_its_own_threads():
    """Cases sharing the process still pass, each tracker counting only its own environment's calls."""
    report = check_structured_concurrency(
        SCRIPTED_ENV, max_env_workers=(2, 0), matrices=("fault", "cancel", "hang"), stages=("step", "close"), jobs=4
    )
    assert report.lanes == 4
    assert report.ok, report.summary()


SCRIPT = """
from skyrl_structured.testing import check_structured_concurrency, register_scripted_env
check_structured_concurrency(register_scripted_env(), backends=("asyncio",), max_env_workers=(2,), matrices=("fault",))
"""


def test_outside_pytest_a_clean_check_prints_one_summary_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, timeout=300, check=False
    )
    stderr = proc.stderr.decode()  # bytes: text mode would turn the bar's "\r" into line breaks
    assert proc.returncode == 0, stderr
    assert proc.stdout == b""
    lines = [line for line in stderr.split("\n") if line.strip()]
    assert len(lines) == 1, stderr  # the progress bar, redrawn in place with "\r"
    final = lines[0].split("\r")[-1].strip()
    assert final == f"check_structured_concurrency({SCRIPTED_ENV!r}): 13 cases, 0 failed"
    assert "WARNING" not in stderr
    assert "injected" not in stderr


class HeartbeatLeakingEnv(BaseTextEnv):  # type: ignore[misc]
    """Starts a thread per environment that nothing stops: a leak, also when cases share the process."""

    stop = threading.Event()

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        threading.Thread(target=self.stop.wait, name="heartbeat", daemon=True).start()

    def init(self, prompt: Any) -> Any:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


def test_lanes_still_report_a_thread_the_environment_leaks():
    env_class = "tests_check_lanes_heartbeat"
    if env_class not in skyrl_gym.registry:
        skyrl_gym.register(id=env_class, entry_point=HeartbeatLeakingEnv)
    try:
        report = check_structured_concurrency(
            env_class,
            backends=("asyncio",),
            max_env_workers=(2,),
            matrices=("fault",),
            stages=("step",),
            leak_grace_s=0.1,
            jobs=3,
            raise_on_failure=False,
            progress=False,
        )
    finally:
        HeartbeatLeakingEnv.stop.set()
    assert report.lanes == 2  # the baseline ran alone; its two fellow cases at once
    assert len(report.failures) == len(report.cases)
    for case in report.failures:
        assert any(p.startswith("thread left running: daemon thread 'heartbeat'") for p in case.problems), case
