"""The summary counts what happened when nothing could start (issue 38): a failed start is no leak.

Real CLI runs in a subprocess: an environment whose constructor raises in its worker process, and a
command agent that exits with an error before any call. Neither left anything open, so the summary
reports no environment NOT CLOSED and no inference session left unfinished, as threads always did.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

_BROKEN_ENV = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv


class BrokenSandbox(BaseTextEnv):
    """A sandbox that never starts: its constructor raises (in the worker process that builds it)."""

    def __init__(self, env_config=None, extras=None):
        raise ConnectionError("the sandbox did not start")
'''


def _rollout(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "skyrl_structured", "rollout", f"run.output_dir={tmp_path / 'out'}"),
            *("run.progress=false", "generator.sampling_params.max_generate_length=4", *args),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc, json.loads((tmp_path / "out" / "summary.json").read_text())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_env_that_fails_to_start_in_its_worker_process_is_no_leak(tmp_path, backend):
    (tmp_path / "broken_envs.py").write_text(_BROKEN_ENV)
    rows = [
        {"prompt": [{"role": "user", "content": f"{i} + 1?"}], "env_class": "broken_envs:BrokenSandbox"}
        for i in range(3)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc, summary = _rollout(
        tmp_path,
        f"run.backend={backend}",
        "data.path=rows.jsonl",
        "generator.n_samples_per_prompt=2",
        "environment.skyrl_gym.env_executor=process",
        "run.metrics_port=0",  # metrics.prom: the live metrics' final values
        "run.metrics_host=127.0.0.1",
    )
    assert proc.returncode != 0
    assert "the sandbox did not start" in proc.stderr
    # The gym generator finishes each attempt's session even when its env never opened: 6 of 6.
    assert summary["envs_opened"] == summary["envs_closed"] == 0, proc.stdout
    assert re.search(r"^  environments\s+0 opened = 0 closed$", proc.stdout, re.M), proc.stdout
    assert "NOT CLOSED" not in proc.stdout
    started = summary["rollout_attempts"]
    assert re.search(rf"^  inference sessions\s+{started} finished of {started} started$", proc.stdout, re.M)
    gauges = {
        sample.name: sample.value
        for family in text_string_to_metric_families((tmp_path / "out" / "metrics.prom").read_text())
        for sample in family.samples
        if not sample.labels
    }
    assert gauges["skyrl_structured_envs_open"] == 0  # Prometheus saw no env open either


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_command_agent_that_exits_with_an_error_before_any_call_is_no_leak(tmp_path, backend):
    proc, summary = _rollout(tmp_path, f"run.backend={backend}", "data.max_prompts=3", "agent=command:false")
    assert proc.returncode != 0
    assert "exited with status 1" in proc.stderr
    assert summary["status"] == "failed", proc.stderr
    # An agent's environment is its capture session: each attempt's was opened and closed.
    attempts = summary["rollout_attempts"]
    assert summary["envs_opened"] == summary["envs_closed"] == attempts > 0
    assert re.search(rf"^  capture sessions\s+{attempts} opened = {attempts} closed$", proc.stdout, re.M), proc.stdout
    assert "NOT CLOSED" not in proc.stdout
    # No call reached the engine, so there was no inference session to finish.
    assert summary["sessions_started"] == summary["sessions_finished"] == 0
    assert re.search(r"^  inference sessions\s+0 finished of 0 started$", proc.stdout, re.M), proc.stdout
