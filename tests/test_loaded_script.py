"""``scripts/test-loaded``: the test command under load, stopping exactly the load it started."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test-loaded"

pytestmark = pytest.mark.skipif(
    not (SCRIPT.parents[1] / ".venv" / "bin" / "python").exists(), reason="needs the checkout's .venv (scripts/setup)"
)


def _run(tmp_path: Path, body: str, load_procs: int | None = 2) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """The script on a test file of ``body``, beside ``load_procs`` busy processes (None: its default)."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(body)
    env = {key: value for key, value in os.environ.items() if key != "LOAD_PROCS"}
    if load_procs is not None:
        env["LOAD_PROCS"] = str(load_procs)
    done = subprocess.run(
        [str(SCRIPT), str(test_file), "-q", "-n", "0", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    started = re.search(r"test-loaded: (\d+) busy process\(es\) beside the suite \(pids ([\d ]+)\)", done.stderr)
    assert started, done.stderr
    pids = [int(p) for p in started.group(2).split()]
    assert int(started.group(1)) == len(pids)
    return done, pids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_run_prints_pytests_summary_keeps_its_status_and_stops_its_load(tmp_path: Path) -> None:
    done, pids = _run(tmp_path, "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert False\n")
    assert done.returncode == 1, done.stdout + done.stderr  # pytest's own status
    assert re.search(r"^1 failed, 1 passed in [\d.]+s", done.stdout, re.MULTILINE), done.stdout
    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)  # killed and waited for by the script: no zombie either
    assert done.stderr.rstrip().endswith(f"stopped the load (pids {' '.join(map(str, pids))})")


def test_by_default_the_load_is_four_busy_processes_per_core(tmp_path: Path) -> None:
    # As loaded as the machines whose runs failed on speed (issue 47: load 12-24 on 2 cores), not one per core.
    done, pids = _run(tmp_path, "def test_passes():\n    pass\n", load_procs=None)
    assert done.returncode == 0, done.stdout + done.stderr
    cores = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)  # as the script counts
    assert len(pids) == 4 * cores
    assert all(_gone(pid) for pid in pids)


def test_the_readme_ci_and_the_loaded_run_use_one_test_command() -> None:
    root = SCRIPT.parents[1]
    (readme_line,) = [
        line
        for line in (root / "README.md").read_text().splitlines()
        if line.startswith("./scripts/setup && ") and "pytest" in line
    ]
    pytest_command = readme_line.removeprefix("./scripts/setup && ")
    assert readme_line in (root / ".ci" / "run").read_text().splitlines()
    assert f'{pytest_command} "$@" || status=$?' in SCRIPT.read_text().splitlines()
