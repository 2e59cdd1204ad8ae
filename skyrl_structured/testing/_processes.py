"""Processes an environment left running: the descendants of the process running it, still alive after its close.

A sandbox env typically starts a process per episode (a container's client, an interpreter, a
server) and must stop it in ``close()``. :class:`ProcessCensus` takes the descendants of the
current process at a baseline and, later, names the ones started since that still run (a zombie,
exited and not yet reaped, does not run). What is not the environment's is never counted:

- the subtree of a process that was already a child at the baseline (a Ray node started before,
  a fork server, a worker pool: their later children are their own business);
- multiprocessing's own helpers (``forkserver``, ``resource_tracker``) and what they fork (the
  process executor's env workers): started on first use, kept for the life of the process by design.

Linux only (``/proc``); elsewhere the census sees nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from .._runtime.reaper import _children, _running, tree_kills

__all__ = ["ProcessCensus", "command_line", "descendants", "leftover_line"]

#: Command-line fragments of multiprocessing's helpers, whose trees are never an environment's.
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "multiprocessing.spawn")
#: The most characters of a command line a report shows.
_SHOWN = 200


def command_line(pid: int) -> str:
    """``pid``'s command line, its arguments joined by spaces (``"?"`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as listing:
            raw = listing.read()
    except OSError:
        return "?"
    text = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _is_helper(pid: int) -> bool:
    line = command_line(pid)
    return any(helper in line for helper in _HELPERS)


def descendants(pid: int, *, skip: Iterable[int] = ()) -> list[int]:
    """Every descendant of ``pid`` (children first), leaving out the subtrees rooted at ``skip`` and at helpers."""
    if not tree_kills():
        return []
    skipped = set(skip)
    found: list[int] = []
    walk = [pid]
    while walk:
        for child in _children(walk.pop()):
            if child in skipped or _is_helper(child):
                continue
            found.append(child)
            walk.append(child)
    return found


def leftover_line(pid: int) -> str:
    """The problem line for one process left running (the summary groups these by command line)."""
    return f"process left running after the environment closed: {command_line(pid)!r} (pid {pid})"


class ProcessCensus:
    """The current process's descendants at a baseline; :meth:`leftovers` names those started since that still run."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._children = set(_children(self.pid)) if tree_kills() else set()
        self._known = set(descendants(self.pid))

    def running_since(self) -> list[int]:
        """Descendants started since the baseline that still run (not under a child the baseline had)."""
        return [pid for pid in descendants(self.pid, skip=self._children) if pid not in self._known and _running(pid)]

    def leftovers(self, grace_s: float = 0.0) -> list[str]:
        """One line per process started since the baseline still running after up to ``grace_s`` seconds."""
        deadline = time.monotonic() + grace_s
        left = self.running_since()
        while left and time.monotonic() < deadline:
            time.sleep(0.01)
            left = [pid for pid in left if _running(pid)]
        return [leftover_line(pid) for pid in left]
