"""The children the kit's misbehaving envs leave running on purpose, held until the process exits.

A ``subprocess.Popen`` collected while its child runs, or after the child was killed by pid but never
waited for, warns (``ResourceWarning: subprocess N is still running``). These envs leave children
behind for the kit's leak checks, which kill them by pid. So each such ``Popen`` is kept here, and
at interpreter exit every one is reaped: waited for if it has ended, killed and waited for if it
still runs (nothing of a test outlives it).
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
from typing import Any

__all__ = ["keep"]

#: How long reaping one child at exit may wait after killing it.
_REAP_S = 5.0
_kept: list[subprocess.Popen[Any]] = []


def keep(process: subprocess.Popen[Any]) -> None:
    """Hold ``process`` until interpreter exit, then reap it."""
    if not _kept:
        atexit.register(_reap_all)
    _kept.append(process)


def _reap_all() -> None:
    for process in _kept:
        if process.poll() is None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D-state): left to init
                process.wait(_REAP_S)
    _kept.clear()
