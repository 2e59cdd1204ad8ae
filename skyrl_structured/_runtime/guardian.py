"""A worker process's guardian: the root of its process tree, which dies with the trainer (DESIGN rule 21).

The process a pool starts stays as the guardian, a child subreaper; the worker is its forked child.
Whatever the worker starts, and leaves behind, stays in the guardian's tree; when the worker exits
or the trainer's process is gone (EOF on the lifeline pipe), the guardian kills the whole tree and
exits as the worker did, which the pool reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, NoReturn

from . import reaper

__all__ = ["guarded_child"]


def _lead_group() -> None:
    """Make this process the leader of a process group of its own (a new session), which the worker
    and its children join by default: the fallback kill where a tree cannot be walked."""
    with contextlib.suppress(OSError):  # already a group leader (not the case when forked or spawned)
        os.setsid()


def _guard(worker: int, lifeline: Any) -> NoReturn:
    """The guardian's whole life: it holds nothing of the worker's but the lifeline (its channel to the
    trainer must close with the worker), waits, kills the tree and exits with the worker's status."""
    keep = lifeline.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    reaper.exit_like(reaper.guard(worker, keep))


def guarded_child(lifeline: Any) -> None:
    """Split this freshly started process into its guardian and the worker; returns only in the worker.

    The worker gets SIGKILL when the guardian dies (the guardian is single-threaded: a reliable
    parent) and closes its end of the lifeline, which only the guardian watches.
    """
    _lead_group()
    reaper.become_subreaper()
    guardian = os.getpid()
    worker = os.fork()
    if worker != 0:
        _guard(worker, lifeline)
    reaper.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != guardian:  # it died before the signal was armed
        os._exit(70)
    lifeline.close()
