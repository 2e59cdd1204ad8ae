"""Processes that leave their process group, for the tests of DESIGN rule 21 ("a kill takes every descendant").

:func:`start_detached` starts three ``sleep 1000`` that a process-group kill misses: one through
``setsid`` (as ``setsid sleep 1000 &`` in a shell), one started with ``start_new_session=True``
(as mini-swe-agent starts every command) and one double-forked into a session of its own (as a
daemon starts). An env step calls it; a command agent runs this file by path (standard library only,
so it starts in milliseconds): ``python detached.py PIDFILE [hang]`` writes its own process id and
theirs, one a line, to ``PIDFILE`` (whole, by a rename), then exits, or sleeps with ``hang``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_detached", "write_pids"]

#: Forks a child that starts a session of its own and forks ``sleep 1000``; prints that pid; both parents exit.
_DOUBLE_FORK = """
import os, sys
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)  # not the pipes the pid is read from: that read would wait for the sleep
        os.dup2(null, 2)
        os.execvp("sleep", ["sleep", "1000"])
    os.write(w, str(pid).encode())
    os._exit(0)
os.close(w)
print(os.read(r, 64).decode(), flush=True)
"""


def start_detached(*, hold: bool = True) -> list[int]:
    """Start the three detached ``sleep 1000`` of the module docstring; their process ids.

    ``hold`` keeps the ``Popen`` of the one this process starts until its exit (``testing._leaked``);
    the script passes False: its children must outlive it for the generator under test to kill them.
    """
    setsid = subprocess.run(
        ["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    new_session = subprocess.Popen(["sleep", "1000"], start_new_session=True, text=True)
    if hold:  # left running on purpose: reaped at exit, never collected while it runs
        from ._leaked import keep  # imported here: run by path, this file has no package

        keep(new_session)
    forked = subprocess.run([sys.executable, "-c", _DOUBLE_FORK], capture_output=True, text=True, check=True)
    return [int(setsid.stdout), new_session.pid, int(forked.stdout)]


def write_pids(path: str | os.PathLike[str], pids: list[int]) -> None:
    """Write ``pids`` to ``path``, one a line, so that a reader polling for the file finds it whole."""
    partial = Path(f"{path}.partial")
    partial.write_text("".join(f"{pid}\n" for pid in pids))
    os.replace(partial, path)


if __name__ == "__main__":
    write_pids(sys.argv[1], [os.getpid(), *start_detached(hold=False)])
    if sys.argv[2:] == ["hang"]:
        time.sleep(1000)
