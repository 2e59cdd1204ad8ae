"""What is running right now: the current event loop's tasks, and the process's threads.

Tasks: on asyncio, ``asyncio.all_tasks()``; on trio, every task reachable from the root task
through ``child_nurseries`` (system tasks included). Outside an event loop there are none to see.

Threads: a thread is a *pool worker* when its outermost frames are a known thread pool's loop:
anyio's asyncio worker (``WorkerThread.run``), trio's thread cache (``WorkerThread._work``), a
``concurrent.futures`` executor (``_worker``) or the generator's env pool. A pool worker is *idle*
when, below that loop, it only waits inside ``threading``/``queue``, or (the env pool) only hands a
finished call's outcome back to the event loop with no call chained after it; otherwise it is
*busy*, and ``where`` names the innermost frame of the code it runs. Reading other threads' stacks
uses ``sys._current_frames``, once per census: every state, and the stack it keeps, comes from the
same instant.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

from .._runtime import completion as _completion
from .._runtime import wakers as _wakers
from ..envs import _threads as _env_threads

__all__ = [
    "ThreadState",
    "coroutine_frames",
    "current_backend",
    "describe_task",
    "live_tasks",
    "loop_identity",
    "running_where",
    "thread_frames",
    "thread_states",
]


def current_backend() -> str | None:
    """``"asyncio"``, ``"trio"`` or None (no event loop running in this thread)."""
    try:
        import sniffio
    except ImportError:  # trio needs sniffio, so without it only asyncio can be running
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return "asyncio"
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None


def _trio_tasks() -> Iterator[Any]:
    import trio

    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None:
            continue
        yield task
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)


def loop_identity() -> object | None:
    """An object identifying the running event loop (to tell whether a baseline belongs to it)."""
    backend = current_backend()
    if backend == "asyncio":
        return asyncio.get_running_loop()
    if backend == "trio":
        import trio

        return trio.lowlevel.current_root_task()
    return None


def live_tasks() -> set[Any] | None:
    """Every unfinished task of the running event loop but the caller's, or None outside a loop."""
    backend = current_backend()
    if backend == "asyncio":
        current = asyncio.current_task()
        return {t for t in asyncio.all_tasks() if t is not current and not t.done()}
    if backend == "trio":
        import trio

        me = trio.lowlevel.current_task()
        return {t for t in _trio_tasks() if t is not me}
    return None


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "<no Python frame>"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_qualname}"


def running_where(frames: list[FrameType]) -> str:
    """Where code stopped in ``frames`` (innermost first) runs: its innermost frame outside waits and plumbing."""
    own = next((f for f in frames if f.f_code.co_filename not in _WAIT_FILES and not _is_plumbing(f.f_code)), None)
    return _where(own or (frames[0] if frames else None))


def thread_frames(ident: int) -> list[FrameType]:
    """The frames of the thread ``ident`` right now, innermost first (none once it is gone)."""
    frame = sys._current_frames().get(ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def coroutine_frames(coro: Any) -> list[FrameType]:
    """The frames of a suspended coroutine's await chain, innermost first."""
    frames: list[FrameType] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames[::-1]


def describe_task(task: Any) -> str:
    """``asyncio task 'name' running fn, suspended at file:line in function``."""
    coro: Any
    if isinstance(task, asyncio.Task):
        kind, name, coro = "asyncio", task.get_name(), task.get_coro()
        frame: FrameType | None = None
        awaited: Any = coro
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None) or frame
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    else:
        kind, name = "trio", getattr(task, "name", repr(task))
        coro = getattr(task, "coro", None)
        frames = list(task.iter_await_frames()) if hasattr(task, "iter_await_frames") else []
        frame = frames[-1][0] if frames else None
    running = getattr(coro, "__qualname__", type(coro).__name__)
    return f"{kind} task {name!r} running {running}, suspended at {_where(frame)}"


_WAIT_FILES = {threading.__file__, queue.__file__}
# (path suffix, qualified name) of each known thread pool's worker loop.
_POOL_LOOPS = {
    ("anyio/_backends/_asyncio.py", "WorkerThread.run"): "anyio",
    ("trio/_core/_thread_cache.py", "WorkerThread._work"): "trio",
    ("concurrent/futures/thread.py", "_worker"): "executor",
    # Our own pool's loop is found from its code object, so moving its module cannot hide it.
    (_env_threads.EnvThreadPool._work.__code__.co_filename.replace("\\", "/"), "EnvThreadPool._work"): (
        "skyrl-structured env"
    ),
}


# trio_asyncio among them: once anything imports it (the engines' trio bridge does), the asyncio
# loops of that process are its loops, and a worker handing a call to one is in its frames.
_PLUMBING = ("/anyio/", "/trio/", "/trio_asyncio/", "/asyncio/", "/outcome/", "/sniffio/", "/concurrent/futures/")


def _is_plumbing(code: CodeType) -> bool:
    path = code.co_filename.replace("\\", "/")
    return any(part in path for part in _PLUMBING)


# The env pool's own code after an env call returned: settling the call and waking the loop (a
# worker found there under load is handing off, not running the environment). EnvCall.run is not
# among them: it is where the env call itself runs.
_HAND_OFF_FILES = {m.__file__ for m in (_env_threads, _completion, _wakers)}


def _is_hand_off(code: CodeType) -> bool:
    return code.co_filename in _HAND_OFF_FILES and code is not _env_threads.EnvCall.run.__code__


def _hands_on_a_follower(stack: list[FrameType]) -> bool:
    """True when the call being handed off has a call chained after it (an abandoned env's close).

    That close runs in this thread next: until it has, the env is open and the worker is its, so the
    hand-off is busy. Read from the hand-off's frame: the chained call is on the call (``_then``)
    until the hand-off takes it into its local ``follower``, which it does before waking the loop.
    """
    for frame in stack:
        if frame.f_code is _env_threads.EnvCall._report.__code__:
            # ``_then`` first: the hand-off stores ``follower`` before it clears ``_then``, so a
            # thread switch between the two reads cannot hide the follower from both.
            chained = getattr(frame.f_locals.get("self"), "_then", None)
            return chained is not None or frame.f_locals.get("follower") is not None
    return False


def _pool_of(code: CodeType) -> str | None:
    path = code.co_filename.replace("\\", "/")
    for (suffix, qualname), pool in _POOL_LOOPS.items():
        if code.co_qualname == qualname and path.endswith(suffix):
            return pool
    return None


@dataclass(frozen=True)
class ThreadState:
    """One live thread: which pool it works for (None: not a pool worker), whether it is busy."""

    thread: threading.Thread
    pool: str | None
    busy: bool
    where: str
    #: Its frames when the census was taken, innermost first (to read more from the same instant).
    stack: tuple[FrameType, ...] = field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        kind = f"{self.pool} pool worker" if self.pool else ("daemon thread" if self.thread.daemon else "thread")
        return f"{kind} {self.thread.name!r} at {self.where}"


def thread_states() -> list[ThreadState]:
    """The state of every live thread except the caller's."""
    frames = sys._current_frames()
    me = threading.get_ident()
    states = []
    for thread in threading.enumerate():
        if thread.ident == me or thread.ident is None:
            continue
        stack: list[FrameType] = []
        frame = frames.get(thread.ident)
        while frame is not None:
            stack.append(frame)  # innermost first
            frame = frame.f_back
        pool = next((p for p in (_pool_of(f.f_code) for f in reversed(stack)) if p is not None), None)
        working = next((f for f in stack if f.f_code.co_filename not in _WAIT_FILES), None)
        # Name the innermost frame of the code the thread runs for someone, not the libraries' plumbing.
        own = next((f for f in stack if f.f_code.co_filename not in _WAIT_FILES and not _is_plumbing(f.f_code)), None)
        busy = pool is not None and working is not None and _pool_of(working.f_code) is None
        if busy and own is not None and _is_hand_off(own.f_code) and not _hands_on_a_follower(stack):
            busy = False
        where = _where(own or working or (stack[0] if stack else None))
        states.append(ThreadState(thread, pool, busy, where, tuple(stack)))
    return states
