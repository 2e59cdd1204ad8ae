"""A stopped run keeps what finished: SIGINT and SIGKILL mid-batch leave a valid trajectories.jsonl.

The CLI runs in a subprocess on 12 rollouts, half of whose engine calls hang (chaos, drawn from the
seed and the call number, so which calls hang is known in advance): the batch can never finish on
its own, so the run is mid-batch for certain once the first finished rollout is in the file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured.testing.chaos import ChaosPolicy

pytestmark = pytest.mark.slow

ROLLOUTS = 12  # 3 prompts x 4 samples
HUNG = sum(ChaosPolicy(hang_rate=0.5, seed=0).decide("generate", call) == "hang" for call in range(1, ROLLOUTS + 1))


def _start(tmp_path: Path, backend: str, *, own_group: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skyrl_structured",
            "rollout",
            f"run.output_dir={tmp_path / 'out'}",
            f"run.backend={backend}",
            "data.max_prompts=3",
            "generator.sampling_params.max_generate_length=8",
            "chaos.hang_rate=0.5",
            "run.progress=false",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def _wait_for_lines(proc: subprocess.Popen[str], path: Path, lines: int) -> None:
    """Until ``path`` holds ``lines`` complete lines (polled: the signal is the file, not the clock)."""
    deadline = time.monotonic() + 240  # a guard against a hang only
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the batch could (half its calls hang)"
        if path.exists() and path.read_bytes().count(b"\n") >= lines:
            return
        time.sleep(0.05)
    pytest.fail(f"no {lines} finished rollouts in {path} after 240 s")


def _kept(path: Path) -> list[dict[str, Any]]:
    """Every line of the kept file, each parsed; the file ends with a complete line."""
    data = path.read_text(encoding="utf-8")
    assert data.endswith("\n")
    rows = [json.loads(line) for line in data.splitlines()]
    ids = [(row["trajectory_id"]["instance_id"], row["trajectory_id"]["repetition_id"]) for row in rows]
    assert len(set(ids)) == len(ids), ids  # each a distinct trajectory
    assert len({row["index"] for row in rows}) == len(rows)
    for row in rows:
        assert row["stop_reason"] in ("stop", "length")
        assert 1 <= len(row["response_ids"]) <= 8
        assert len(row["loss_mask"]) == len(row["response_ids"])
        assert row["env_class"] == "gsm8k"
        assert row["trajectory_id"]["instance_id"] == str(row["index"] // 4)
    return rows


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigint_mid_batch_keeps_the_finished_trajectories_and_counts_the_cut(tmp_path, backend):
    path = tmp_path / "out" / "trajectories.jsonl"
    proc = _start(tmp_path, backend)
    try:
        _wait_for_lines(proc, path, 1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    rows = _kept(path)
    assert 1 <= len(rows) <= ROLLOUTS - HUNG
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["trajectories_kept"] == len(rows)
    assert summary["trajectories_kept_failed"] == 0
    assert summary["trajectories_cut"] == ROLLOUTS - len(rows)
    assert summary["rollouts_finished"] == len(rows)  # nothing finished was lost
    assert "trajectories.jsonl" in summary["files"]
    assert not (tmp_path / "out" / "generator_output.json").exists()
    assert re.search(
        rf"^  trajectories kept\s+{len(rows)} in trajectories\.jsonl, {ROLLOUTS - len(rows)} cut$",
        stdout,
        re.MULTILINE,
    ), stdout


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigkill_mid_batch_leaves_a_valid_jsonl_prefix(tmp_path, backend):
    path = tmp_path / "out" / "trajectories.jsonl"
    proc = _start(tmp_path, backend)
    try:
        _wait_for_lines(proc, path, 2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    rows = _kept(path)
    assert 2 <= len(rows) <= ROLLOUTS - HUNG
    assert not (tmp_path / "out" / "summary.json").exists()  # killed: no summary, the rows are all there is


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stop_sent_to_the_process_and_its_group_is_one_request(tmp_path, backend):
    """What ``timeout -s TERM`` does: SIGTERM to the process, then to its group, within milliseconds."""
    path = tmp_path / "out" / "trajectories.jsonl"
    proc = _start(tmp_path, backend, own_group=True)
    try:
        _wait_for_lines(proc, path, 1)
        os.kill(proc.pid, signal.SIGTERM)
        # The group's copy lands once the first was handled (a copy sent while the first is still
        # pending merges with it in the kernel, and would test nothing).
        assert proc.stderr is not None
        seen, line = "", ""
        while "SIGTERM received" not in line:
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, rest = proc.communicate(timeout=120)
        stderr = seen + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "received again" not in stderr
    assert stderr.count("SIGTERM received") == 1, stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["envs_opened"] == summary["envs_closed"]
    assert summary["trajectories_kept"] == len(_kept(path))
    assert stdout.startswith("skyrl-structured rollout: interrupted\n"), stdout


def test_a_late_copy_of_the_stop_is_ignored_while_the_summary_is_written():
    """The group's copy may land after the signal receiver closed, while summary.png is drawn."""
    from skyrl_structured import cli
    from skyrl_structured.cli._run import RunResult, Tally

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopped = RunResult(status="interrupted", tally=Tally(), signal=signal.SIGTERM, signal_at=time.monotonic())
        cli._hold_repeats(stopped)
        os.kill(os.getpid(), signal.SIGTERM)  # a default handler here would end this very process
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, saved[signal.SIGTERM])
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
