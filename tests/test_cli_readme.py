"""The README's command lines run as written: each is read from README.md here, so the two cannot drift."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import LONG_RUN_TIMEOUT_S, SUBPROCESS_HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(LONG_RUN_TIMEOUT_S)]

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands(containing: str) -> list[str]:
    """The README's inline ``skyrl-structured rollout ...`` code spans that mention ``containing``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    spans = re.findall(r"`(skyrl-structured rollout[^`]*)`", text)
    return [span for span in spans if containing in span]


def test_the_readme_straggler_cutoff_example_runs_as_written(tmp_path):
    (line,) = _readme_commands("straggler_cutoff")
    argv = shlex.split(line)
    assert argv[:2] == ["skyrl-structured", "rollout"]
    # As written: the README's keys only (its output goes to the default rollout_output/ in tmp_path).
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_structured", *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_HANG_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "rollout_output" / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["straggler_cutoff"] == 0.95
    assert re.search(r"^  rollouts cut\s+\d+ \(generator\.straggler_cutoff=0\.95\)$", proc.stdout, re.M), proc.stdout
