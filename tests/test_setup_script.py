"""``scripts/setup``: what it says before it installs anything (nothing here installs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def _setup_with(tmp_path: Path, python: str) -> subprocess.CompletedProcess[str]:
    """Run a copy of ``scripts/setup`` under ``tmp_path`` with ``PYTHON=python``, ``tmp_path/bin`` first on PATH.

    The copy's checkout is ``tmp_path``: if a check let the interpreter through, setup would build
    ``tmp_path/.venv``, never this checkout's.
    """
    script = tmp_path / "scripts" / "setup"
    script.parent.mkdir()
    script.write_text(SETUP.read_text())
    env = dict(os.environ, PYTHON=python, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)


def _program(tmp_path: Path, name: str, body: str) -> Path:
    """An executable shell script ``tmp_path/bin/name``."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}")
    path.chmod(0o755)
    return path


def test_a_pyenv_shim_without_its_version_is_not_installed_and_the_advice_names_that_version(tmp_path: Path) -> None:
    """A pyenv shim is on PATH whether or not its version is installed: it must run (issue 38)."""
    shim = _program(tmp_path, "python3.12", "echo 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    done = _setup_with(tmp_path, "python3.12")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"setup: 'python3.12' is a pyenv shim ({shim}) whose version is not active here (pyenv: python3.12: command "
        "not found): install it (pyenv install 3.12), select it (pyenv shell 3.12), or point PYTHON at a real "
        "interpreter, e.g. PYTHON=/usr/bin/python3.12"
    ]
    assert "needs Python" not in done.stderr
    assert "python3.11" not in done.stderr
    assert not (tmp_path / ".venv").exists()


def test_a_pyenv_shim_whose_version_is_installed_elsewhere_names_the_one_to_select(tmp_path: Path) -> None:
    """pyenv lists the installed versions that have the command: the advice selects the newest listed."""
    listing = (
        "pyenv: python3.12: command not found\n\nThe `python3.12' command exists in these Python versions:\n"
        "  3.12.3\n  3.12.4\n\nNote: See 'pyenv help global' for tips on allowing both\n"
        "      python2 and python3 to be found.\n"
    )
    _program(tmp_path, "python3.12", f"cat >&2 <<'PYENV'\n{listing}PYENV\nexit 127\n")
    done = _setup_with(tmp_path, "python3.12")
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.endswith(
        "(pyenv: python3.12: command not found): select an installed one (pyenv shell 3.12.4), or point PYTHON at "
        "it: PYTHON=$(pyenv root)/versions/3.12.4/bin/python"
    )


def test_an_interpreter_that_does_not_run_is_named_with_what_it_said(tmp_path: Path) -> None:
    """Not pyenv's: whatever the program printed first is quoted, and the advice keeps the asked-for version."""
    broken = _program(tmp_path, "python3.13", "echo 'cannot execute binary file: Exec format error' >&2\nexit 126\n")
    done = _setup_with(tmp_path, "python3.13")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"setup: interpreter 'python3.13' ({broken}) does not run (cannot execute binary file: Exec format error): "
        "install it, or point PYTHON at one that runs, e.g. PYTHON=/usr/bin/python3.13"
    ]


def test_an_interpreter_older_than_3_11_is_refused_with_its_version(tmp_path: Path) -> None:
    """A real interpreter that reports 3.10 (its ``sys.version_info`` set by a ``sitecustomize``) is too old."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n\nsys.version_info = (3, 10, 12, 'final', 0)\n")
    _program(tmp_path, "python3.10", f'PYTHONPATH={site} exec {sys.executable} "$@"\n')
    done = _setup_with(tmp_path, "python3.10")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "setup: skyrl-structured needs Python >= 3.11; 'python3.10' is Python 3.10.12: point PYTHON at 3.11 or newer, "
        "e.g. PYTHON=python3.12 (3.12 also trains through SkyRL)"
    ]
    assert not (tmp_path / ".venv").exists()


def _uv_sources() -> Any:
    """scripts/uv_sources.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("uv_sources", SETUP.parent / "uv_sources.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``pip config list`` on a machine like the issue's: a pip.conf, a constraints file, PIP_* variables.
PIP_CONFIG = """\
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
:env:.index-url='https://mirror.example/simple'
download.dest='/tmp/elsewhere'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/other'
global.index-url='https://pypi.org/simple'
"""


def test_uv_gets_pips_package_sources_with_pips_precedence() -> None:
    uv_sources = _uv_sources()
    settings = uv_sources.pip_settings(PIP_CONFIG)
    assert settings == {
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "constraint": "/etc/xdg/pip/constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "find-links": "/opt/wheels",  # PIP_FIND_LINKS over pip.conf, as pip ranks them
        "index-url": "https://mirror.example/simple",
    }
    assert uv_sources.uv_options(settings) == [
        "--index-strategy",
        "unsafe-best-match",  # pip's choice: the best version on any index
        "--index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/pypi-more/simple",
        "--find-links",
        "/opt/wheels",
        "--constraint",
        "/etc/xdg/pip/constraints.txt",
    ]


def test_a_pip_setting_uv_would_not_follow_leaves_the_install_to_pip() -> None:
    uv_sources = _uv_sources()
    with pytest.raises(ValueError, match=r"^pip is configured with global\.no-binary, which uv would not follow$"):
        uv_sources.pip_settings(PIP_CONFIG + "global.no-binary=':all:'\n")
    assert uv_sources.pip_settings("install.find-links='/a'\nglobal.find-links='/b'\n") == {"find-links": "/a"}
