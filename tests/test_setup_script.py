"""``scripts/setup``: what it says before it installs anything (nothing here installs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup"


def test_an_interpreter_not_on_path_is_named_as_not_found(tmp_path: Path) -> None:
    """``PYTHON=python3.12`` where there is none: not found, not "needs Python >= 3.11" (issue 27)."""
    env = dict(os.environ, PYTHON="python3.99-not-installed", PATH=os.environ.get("PATH", ""))
    done = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "setup: interpreter 'python3.99-not-installed' not found (PYTHON=python3.99-not-installed): install it, "
        "or point PYTHON at one, e.g. PYTHON=/usr/bin/python3.12"
    ]
    assert "needs Python" not in done.stderr
    assert done.stdout == ""
