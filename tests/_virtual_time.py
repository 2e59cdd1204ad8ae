"""Backends for tests where time matters: asyncio on the real clock, trio on a mock clock that jumps ahead.

On ``trio-autojump`` time passes only when every task is blocked, and then at once to the next
deadline, so a test there can assert exact instants (a deadline fires *at* its bound) and wait
for an hour for free. On ``asyncio`` the same test runs on the real clock with short times and
may assert only what no machine speed can break: that something did not happen before a bound
(deadlines never fire early), never that it happened by one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sniffio


def real_and_virtual_time() -> list[Any]:
    """``anyio_backend`` params: asyncio (debug, real time) and trio on an autojumping ``MockClock``."""
    import trio.testing

    return [
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-autojump"),
    ]


def on_virtual_time() -> bool:
    """Whether the running loop is trio on a ``MockClock`` (time jumps; exact instants can be asserted)."""
    if sniffio.current_async_library() != "trio":
        return False
    import trio.lowlevel
    import trio.testing

    return isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)


def seconds(virtual: float, real: float) -> float:
    """``virtual`` on a mock clock (free), else ``real`` (kept short: the real clock is spent)."""
    return virtual if on_virtual_time() else real


#: Slack for ``asyncio``'s timers, which may fire up to one clock resolution before their time.
EARLY = 0.01

#: How long :func:`preempted` holds the thread: well over :data:`EARLY`, well under a test's real-time bounds.
PREEMPTION_S = 0.05


def preempted() -> None:
    """Stand for the OS taking the CPU from the test at this line, as a busy machine may at any line.

    On the real clock this blocks the thread (and its event loop) for :data:`PREEMPTION_S`; on a mock
    clock it does nothing (no virtual time passes while a task runs). A test calls it where a stall
    would break a timestamp taken on the wrong side of the event it stands for: between starting a
    deadline and noting when it started, say. A lower bound on how long a deadline ran is measured
    from a timestamp taken *before* whatever started it, so no stall can make the bound fail.
    """
    if not on_virtual_time():
        time.sleep(PREEMPTION_S)


def hang_bound() -> Any:
    """``anyio.fail_after`` that only a hang reaches: a minute of real time, or a million virtual seconds."""
    import anyio

    return anyio.fail_after(seconds(virtual=1e6, real=60.0))
