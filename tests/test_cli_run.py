"""`skyrl-structured rollout` end to end, as a user runs it: a subprocess, the real tiny model, real envs.

Every run here is offline and CPU-only: the embedded dataset, skyrl_gym's gsm8k environment and
``TransformersEngine.tiny()``. Fault drills use the test kit's chaos wrappers, whose draws depend
only on the seed and the call number, so the number of injected failures is known in advance.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, validate_generator_output
from skyrl_structured.testing.chaos import ChaosPolicy

from .helpers import LONG_RUN_TIMEOUT_S, SUBPROCESS_HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(LONG_RUN_TIMEOUT_S)]

ROLLOUTS = 48  # 12 embedded prompts x 4 samples
ENVS = re.compile(r"environments\s+(\d+) opened = (\d+) closed")


def _envs(summary: str) -> re.Match[str]:
    """The summary's environments line."""
    match = ENVS.search(summary)
    assert match is not None, summary
    return match


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "skyrl_structured", "rollout", *args]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(f"run.output_dir={tmp_path / 'out'}", *args),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_HANG_S,
        check=False,
    )


def _load_output(tmp_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    out = tmp_path / "out"
    generator_output = json.loads((out / "generator_output.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return generator_output, trajectories, summary


def _expected_failures(rate: float, seed: int = 0) -> int:
    policy = ChaosPolicy(failure_rate=rate, seed=seed)
    return sum(policy.decide("generate", call) == "failure" for call in range(1, ROLLOUTS + 1))


#: Numbers vary from run to run (times) and machine to machine (what a random model samples).
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
#: Rows whose value lists what happened (which stop reasons occurred): the label is compared alone.
_LISTING_ROWS = ("stop reasons", "failures by type")


def _shape(block: str, output_dir: str) -> list[tuple[str, str]]:
    """Each line of a summary as (label, value with its numbers masked)."""
    shaped = []
    for line in block.replace(output_dir, "rollout_output").splitlines():
        label, _, value = line.strip().partition("  ")
        if label in _LISTING_ROWS:
            value = ""
        shaped.append((label, _NUMBER.sub("N", value.strip())))
    return shaped


def _quickstart_sample() -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "quickstart.md").read_text(encoding="utf-8")
    match = re.search(r"```text\n(skyrl-structured rollout: done\n.*?)```", text, re.DOTALL)
    assert match is not None, "docs/quickstart.md lost its sample summary"
    return match.group(1)


def test_default_run_is_offline_and_writes_a_valid_generator_output(tmp_path, tokenizer):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The quickstart's sample is this run's summary, line for line (only the figures may differ).
    assert _shape(proc.stdout, str(tmp_path / "out")) == _shape(_quickstart_sample(), "rollout_output")
    assert "; environment gsm8k; " in proc.stderr.splitlines()[0]
    assert "Traceback" not in proc.stderr
    assert "Generating Trajectories" in proc.stderr  # the progress bar
    assert proc.stdout.startswith("skyrl-structured rollout: done\n")
    for label in ("rollouts ok", "rollouts failed", "rollouts timed out", "rollout retries", "failures by type"):
        assert re.search(rf"^  {label}\s+\S", proc.stdout, re.MULTILINE), label
    assert re.search(rf"^  rollouts ok\s+{ROLLOUTS}$", proc.stdout, re.MULTILINE)
    assert re.search(r"^  mean reward\s+\d\.\d{3} \(\d+ of 48 rollouts rewarded\)$", proc.stdout, re.MULTILINE)
    assert _envs(proc.stdout).groups() == (str(ROLLOUTS), str(ROLLOUTS))

    output, trajectories, summary = _load_output(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["status"] == "ok"
    assert summary["rollouts_ok"] == ROLLOUTS
    assert summary["envs_opened"] == summary["envs_closed"] == ROLLOUTS
    assert summary["sessions_finished"] == ROLLOUTS
    assert summary["rollout_metrics"]["generate/num_failed_rollouts"] == 0
    assert summary["config"]["engine"]["kind"] == "transformers"
    assert len(trajectories) == ROLLOUTS
    assert sum(row["reward"] for row in trajectories) / ROLLOUTS == pytest.approx(summary["mean_reward"])
    for i, row in enumerate(trajectories):
        # Rows line up with the generator output, and their text is the decoding of their tokens.
        assert row["response_ids"] == output["response_ids"][i]
        assert row["prompt_ids"] == output["prompt_token_ids"][i]
        assert row["stop_reason"] == output["stop_reasons"][i]
        assert row["response_text"] == tokenizer.decode(row["response_ids"], skip_special_tokens=False)
        assert row["prompt_text"].startswith("<|im_start|>user\n")
        assert row["trajectory_id"] == {"instance_id": str(i // 4), "repetition_id": i % 4}
        assert 1 <= len(row["response_ids"]) <= 48
        assert row["stop_reason"] in ("stop", "length")


def test_chaos_with_skip_failed_rollouts_contains_the_failures(tmp_path):
    expected = _expected_failures(0.3)
    assert 0 < expected < ROLLOUTS
    proc = _run(tmp_path, "chaos.failure_rate=0.3", "generator.skip_failed_rollouts=true", "run.backend=trio")
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"^  rollouts failed\s+{expected}$", proc.stdout, re.MULTILINE)
    assert re.search(rf"^  failures by type\s+ChaosError {expected}$", proc.stdout, re.MULTILINE)
    assert _envs(proc.stdout).groups() == (str(ROLLOUTS), str(ROLLOUTS))

    output, trajectories, summary = _load_output(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["backend"] == "trio"
    assert summary["rollouts_failed"] == expected
    assert summary["rollouts_ok"] == ROLLOUTS - expected
    assert summary["failures_by_type"] == {"ChaosError": expected}
    placeholders = [row for row in trajectories if row["stop_reason"] == ROLLOUT_ERROR_STOP_REASON]
    assert len(placeholders) == expected
    for row in placeholders:
        assert row["loss_mask"] == [0]
        assert row["reward"] == 0.0
        assert len(row["response_ids"]) == 1


def test_a_failed_rollout_without_skip_fails_the_run_with_one_line(tmp_path):
    proc = _run(tmp_path, "chaos.failure_rate=0.3")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("skyrl-structured: error: a rollout failed and stopped the step: ChaosError: chaos: ")
    assert "generator.skip_failed_rollouts=true" in last
    # Siblings were cancelled and every environment they opened was closed.
    opened, closed = _envs(proc.stdout).groups()
    assert opened == closed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("ChaosError: ")
    assert summary["envs_opened"] == summary["envs_closed"]
    assert not (tmp_path / "out" / "generator_output.json").exists()


def test_all_rollouts_failing_fails_the_step_and_debug_shows_the_traceback(tmp_path):
    proc = _run(tmp_path, "chaos.failure_rate=1.0", "generator.skip_failed_rollouts=true", "--debug")
    assert proc.returncode == 1
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith(
        f"skyrl-structured: error: the step failed: All {ROLLOUTS} rollouts failed ({ROLLOUTS} x ChaosError)"
    )
    assert "First error: ChaosError: chaos: injected failure at stage 'generate'" in last
    # --debug: the traceback, with the first failure chained as the cause.
    assert "Traceback (most recent call last)" in proc.stderr
    assert "The above exception was the direct cause of the following exception" in proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["envs_opened"] == summary["envs_closed"] == ROLLOUTS


class _StderrReader:
    """Reads a child's stderr in a thread (so the pipe never fills) and keeps the text."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        while chunk := os.read(proc.stderr.fileno(), 4096):
            self.text += chunk.decode(errors="replace")

    def join(self) -> None:
        self._thread.join(timeout=30)


def _wait_for_a_finished_rollout(trajectories: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """True once ``trajectories.jsonl`` holds a whole line: the CLI appends one per rollout as it finishes.

    False if the child exits first or ``timeout_s`` passes (a bound for a broken run, not a pacing delay).
    """
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if trajectories.exists() and b"\n" in trajectories.read_bytes():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(
    ("backend", "signum", "status"), [("asyncio", signal.SIGINT, 130), ("trio", signal.SIGTERM, 143)]
)
def test_signal_mid_run_cancels_rollouts_and_closes_every_environment(tmp_path, backend, signum, status):
    # Half the engine calls are held for a minute, so the run is mid-flight for certain once the
    # first finished rollout lands in trajectories.jsonl.
    proc = subprocess.Popen(
        _command(
            f"run.output_dir={tmp_path / 'out'}",
            f"run.backend={backend}",
            "chaos.slow_rate=0.5",
            "chaos.slow_s=60",
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        watcher = _StderrReader(proc)
        finished = _wait_for_a_finished_rollout(tmp_path / "out" / "trajectories.jsonl", proc, SUBPROCESS_HANG_S / 2)
        assert finished, watcher.text
        proc.send_signal(signum)
        proc.wait(timeout=SUBPROCESS_HANG_S / 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    watcher.join()
    assert proc.stdout is not None
    assert proc.stderr is not None
    out = proc.stdout.read().decode()  # the summary: small enough never to fill the pipe
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == status, watcher.text
    assert "Traceback" not in watcher.text
    assert f"{signal.Signals(signum).name} received: cancelling" in watcher.text
    assert out.startswith("skyrl-structured rollout: interrupted\n")
    opened, closed = _envs(out).groups()
    assert opened == closed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["signal"] == signum
    assert summary["rollouts_finished"] >= 1
    assert summary["rollouts_cancelled"] >= 1
    assert summary["rollouts_finished"] + summary["rollouts_cancelled"] == summary["rollout_attempts"]
    assert summary["envs_opened"] == summary["envs_closed"] == summary["rollout_attempts"]
    assert summary["sessions_finished"] == summary["rollout_attempts"]
    assert not (tmp_path / "out" / "generator_output.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generator.max_turn=2"], r"unknown key `generator.max_turn`; did you mean `generator.max_turns`\?"),
        (["generator.max_turns=two"], r"`generator.max_turns` takes int, got 'two'"),
        (["data.path=missing.jsonl"], r"`data.path` 'missing.jsonl' does not exist"),
        (
            ["environment.env_class=gsm9k", "data.path=rows.jsonl"],
            r"rows.jsonl: unknown environment class 'gsm9k' \(did you mean 'gsm8k'\?\)",
        ),
    ],
)
def test_bad_configuration_is_refused_before_any_work(tmp_path, args, message):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}]}) + "\n")
    proc = _run(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.match(rf"skyrl-structured: error: {message}", lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_console_script_and_module_share_the_command(tmp_path):
    script = Path(sys.executable).with_name("skyrl-structured")
    if not script.exists():
        pytest.skip("the console script is not installed next to this interpreter")
    by_script = subprocess.run([str(script), "rollout", "--help"], capture_output=True, text=True, check=True)
    by_module = subprocess.run(_command("--help"), capture_output=True, text=True, check=True)
    assert by_script.stdout == by_module.stdout
    assert "generator.skip_failed_rollouts=false" in by_script.stdout
