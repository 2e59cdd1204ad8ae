"""A kill takes every descendant (DESIGN rule 21): process trees rooted at a child subreaper.

A process that calls ``setsid``, is started with ``start_new_session=True`` or double-forks leaves
its process group, so a group kill misses it and it outlives its rollout, re-parented to pid 1. On
Linux the root of every tree a rollout starts (a command agent's launcher, an env worker's guardian)
is a small process that makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan
anywhere below it is re-parented to it instead of pid 1, so the whole tree stays findable through
``/proc`` for as long as the root lives. The root only waits (:func:`guard`) for its one child (the
agent's command, the env worker) to exit or for its lifeline, a pipe whose write end only the
generator's process holds, to reach EOF (that process is gone, ``kill -9`` included); then it kills
what is left of its tree and exits with its child's status.

:func:`kill_tree` kills a tree from outside (a deadline, a cancellation, a kill): it stops the root,
then walks its descendants, stopping each (a stopped process cannot fork, and nothing in a stopped
tree reaps, so no pid is reused), until a walk finds no new one; then it SIGKILLs them all.

Why not a cgroup per rollout: it takes a writable, delegated cgroup v2 hierarchy, which containers
and many clusters do not give (the generator's own machine did not). A lifeline pipe and not a
parent-death signal for the launcher: the "parent" of ``PR_SET_PDEATHSIG`` is the thread that
started the process, and trio starts processes from worker threads that exit when idle.

Elsewhere (macOS, no ``/proc``) the fallback is the process group: the root leads a session of its
own, which its descendants join unless they leave it, and each kill signals the group.

This file is also the command agents' launcher, run by path with the standard library only (importing
the package would cost a second or more per rollout): ``python -I -S reaper.py -- argv...`` with the
lifeline on its stdin.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import subprocess
import sys
import time
from typing import NoReturn

__all__ = [
    "become_subreaper",
    "exit_like",
    "guard",
    "kill_tree",
    "launcher_argv",
    "set_parent_death_signal",
    "tree_kills",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: How long :func:`kill_tree` waits for the processes it killed to die (one in uninterruptible sleep
#: dies when it wakes; the wait only makes "gone when the kill returns" hold in every other case).
_DEATH_WAIT_S = 5.0
#: Exit status of a root whose child's status is unknown (it could not start its command, for one).
_FAILED = 70


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return False


def become_subreaper() -> bool:
    """Make the calling process a child subreaper (Linux); False where the platform has none."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to the caller when the thread that started it exits (Linux)."""
    return _prctl(_PR_SET_PDEATHSIG, signum)


def tree_kills() -> bool:
    """Whether :func:`kill_tree` walks the tree here (Linux with ``/proc``), or falls back to the group."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self/task")


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (of every thread of it); none once it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as listing:
                found.extend(int(child) for child in listing.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{task}"):
                continue  # that thread ended
            return _children_by_scan(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return found


def _children_by_scan(pid: int) -> list[int]:
    """The children of ``pid`` found from every process's parent id (slower: reads all of ``/proc``)."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(name))
    return found


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone: nothing left to do
        os.kill(pid, signum)


def kill_tree(root: int, *, include_root: bool = True) -> None:
    """SIGKILL every descendant of ``root`` (and ``root`` itself if ``include_root``); never raises.

    On Linux: stop, walk, repeat until a walk finds nothing new, kill (see the module docstring).
    Elsewhere: SIGKILL the process group ``root`` leads (with ``include_root=False``, from a process
    that must outlive the kill, a forked helper sends it once its parent has gone).
    """
    if not tree_kills():
        _kill_group(root, include_root=include_root)
        return
    if include_root:
        _signal(root, signal.SIGSTOP)
    stopped: set[int] = set()
    while True:
        new: list[int] = []
        walk = [root]
        while walk:
            for child in _children(walk.pop()):
                walk.append(child)
                if child not in stopped:
                    new.append(child)
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
            stopped.add(pid)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    # While the root lives (stopped), nothing reaps the killed: their pids cannot be reused, and
    # once each is a zombie no process of the tree runs any more.
    _wait_dead(stopped, _DEATH_WAIT_S)
    if include_root:
        _signal(root, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_dead(pids: set[int], timeout_s: float) -> None:
    """Wait until none of ``pids`` runs (SIGKILL is delivered asynchronously), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    left = [pid for pid in pids if _running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        left = [pid for pid in left if _running(pid)]


def _kill_group(root: int, *, include_root: bool) -> None:
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
        return
    if os.fork() == 0:  # the helper stays in the group and kills it, itself included, once the root exits
        while os.getppid() == root:
            time.sleep(0.01)
        os.killpg(root, signal.SIGKILL)
        os._exit(0)  # pragma: no cover - killed by its own signal


def _reap(child: int) -> int | None:
    """Reap every exited child of the caller (orphans re-parented to it too); ``child``'s wait status if it exited."""
    status: int | None = None
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == child:
            status = code


def guard(child: int, lifeline: int | None) -> int:
    """Wait until ``child`` exits or ``lifeline`` reaches EOF; kill the rest of the tree; ``child``'s wait status.

    Run by the root of a tree (the caller, a subreaper where :func:`become_subreaper` succeeded). It
    reaps the orphans it inherits as they exit, and ignores SIGTERM, SIGINT and SIGHUP: a kill meant
    for its group ends its child, and then it cleans up.
    """
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # its wake-up byte is what matters
    for ignored in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    watch = select.poll()  # poll, not select: any fd number
    watch.register(wake_r, select.POLLIN)
    if lifeline is not None:
        watch.register(lifeline, select.POLLIN)
    status = _reap(child)
    while status is None:
        events = watch.poll()
        if any(fd == lifeline for fd, _ in events) and _at_eof(lifeline):  # the generator's process is gone
            break
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 512)
        status = _reap(child)
    kill_tree(os.getpid(), include_root=False)
    if status is None:
        with contextlib.suppress(ChildProcessError):
            status = os.waitpid(child, 0)[1]
    _reap(child)  # the rest are zombies now; what is left goes to pid 1 when this exits
    return status if status is not None else _FAILED << 8


def _at_eof(fd: int | None) -> bool:
    """Whether the lifeline ``fd`` is at EOF (what is written to it, which nothing should, is dropped)."""
    try:
        return fd is not None and os.read(fd, 4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def exit_like(status: int) -> NoReturn:
    """Exit with wait status ``status``: its exit code, or killed by its signal (no core dump)."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else _FAILED)


def launcher_argv(argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` under the launcher (:func:`_launch`), with this interpreter."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "--", *argv]  # the standard library only


def _launch(argv: list[str]) -> NoReturn:
    """The launcher: become a subreaper, run ``argv`` (stdin from ``/dev/null``), guard it, exit as it did.

    Its own stdin is the lifeline. The command inherits its stdout and stderr and its session.
    """
    become_subreaper()
    try:
        command = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as exc:
        os.write(2, f"skyrl_structured launcher: could not start {argv!r}: {exc}\n".encode(errors="replace"))
        os._exit(127)
    exit_like(guard(command.pid, 0))


if __name__ == "__main__":
    _launch(sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:])
