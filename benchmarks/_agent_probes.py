"""What :mod:`benchmarks.agents` reads around each batch: CPU, wall time, the loop's lag, child processes' CPU.

A :class:`Window` is opened once the batch's endpoint is serving (so that starting a pool of
endpoint workers is not charged to the calls) and closed once every session has closed. Between
the two it samples the event loop's lag with the generator's own probe
(:class:`skyrl_structured._runtime.loop_lag.LoopLag`: how late a 50 ms sleep wakes), and it reads
the CPU time of this process and of every process descended from it when the window opened (the
endpoint's worker processes, when there are any) from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import anyio
import anyio.abc
from anyio.abc import TaskGroup

from skyrl_structured._runtime.loop_lag import LoopLag
from skyrl_structured.agents import serve_capture

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages (all three 0 where the system has none)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, theirs, ...), from ``/proc``; empty where there is no ``/proc``."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            todo.extend(children)
    return sorted(set(found))


def proc_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of ``pid`` (``/proc/<pid>/stat``), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def workers_unsupported() -> str | None:
    """Why the ``workers`` contender cannot run here, or None when ``serve_capture`` takes ``workers``."""
    if "workers" in inspect.signature(serve_capture).parameters:
        return None
    return (
        "serve_capture() takes no `workers` in this checkout (endpoint worker processes, issue 46), "
        "so the `workers` contender is skipped"
    )


def auto_workers() -> int:
    """What ``agent_endpoint_workers=auto`` gives on this machine (one per usable core beyond the first, at
    most 8), but at least 1: the contender measures worker processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, 8))


class Window:
    """The timed region of one batch: wall and CPU time, the loop's lag, and its child processes' CPU."""

    def __init__(self, group: TaskGroup) -> None:
        self._group = group
        self.lag = LoopLag()
        self._sampler = anyio.CancelScope()
        self.wall = self.cpu = 0.0
        #: The event loop's thread alone (``time.thread_time``, read on the loop): the process less its other threads.
        self.loop_cpu = 0.0
        self.children: dict[int, float] = {}

    async def _sample(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with self._sampler:
            task_status.started()  # the sampler runs on to its first sleep, its due time set, before the batch
            await self.lag.sample()

    async def open(self) -> None:
        """Start sampling, then timing (on the loop, once the endpoint serves).

        The sampler's first sleep is due before the batch's first step, so a batch that never lets the
        loop run it (instant engine calls that never wait) still shows its whole length as lag.
        """
        self.children = {pid: cpu for pid in descendants(os.getpid()) if (cpu := proc_cpu_s(pid)) is not None}
        await self._group.start(self._sample)
        self.wall, self.cpu, self.loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()

    def close(self) -> None:
        """Stop: the wall and CPU seconds since :meth:`open`, and each child's CPU seconds in between."""
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.loop_cpu = time.thread_time() - self.loop_cpu
        self.lag.stop()
        self._sampler.cancel()
        for pid, before in self.children.items():
            after = proc_cpu_s(pid)
            self.children[pid] = (after - before) if after is not None else float("nan")
