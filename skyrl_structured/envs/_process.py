"""``env_executor="process"``: environments in spawned worker processes that can be killed.

Each worker is a process forked by multiprocessing's fork server (``forkserver``, where the platform
has it, else ``spawn``; never a bare ``fork`` of the generator, which has threads and an event loop)
running :func:`~skyrl_structured.envs._worker.process_main`. The generator talks to it over one pipe,
through two daemon threads of its own: a writer that sends every request queued since its last send
as one message (a burst of a thousand cheap calls is a handful of messages) and a reader that
resolves replies and wakes the event loop once per burst (the coalescing waker shared with the
thread pool). That link is the same on asyncio and trio, needs no task of the event loop's, and
costs nothing while a worker is idle; ``benchmarks/env_executors.py`` measures it against threads.

A worker never runs the user's ``__main__`` to start (CPython's spawn and fork-server hand-offs
re-run the main script in every child: seconds for a trainer's entrypoint that imports torch; the
3.11 fork server never preloads it). :func:`_without_main` keeps the main module out of the data a
worker starts from; a worker imports ``__main__`` only when it must host an env class defined there
(``'__main__:Cls'``), once, off every rollout's clock.

A worker dies with the generator's process (a lifeline pipe whose EOF its guardian watches), with
the pool at ``aclose()``, at garbage collection and at interpreter exit. The process started here is
the worker's guardian, a child subreaper whose child is the worker (:func:`~._worker.process_main`):
a worker's end (killed, crashed, shut down, or orphaned by the generator's death) takes every
process its envs started with it, those that left its process group or session included. A kill
sends SIGTERM to the group (the guardian ignores it; the worker dies of it and the guardian kills the
rest), then, 0.5 s later, kills the whole tree from here
(:func:`~skyrl_structured._runtime.reaper.kill_tree`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import signal
import threading
import weakref
from typing import Any

from .._runtime.reaper import kill_tree
from .._runtime.spawning import FORKSERVER_PRELOAD as FORKSERVER_PRELOAD
from .._runtime.spawning import start_method as _default_start_method
from .._runtime.spawning import without_main as _without_main
from .._runtime.spawning import worker_context
from ..types import SkyRLConfig
from ._crossing import decode, encode_request
from ._executors import EnvWorkerError, worker_pool_knobs
from ._pool import Reply, Transport, WorkerPool
from ._remote_executor import RemoteEnvExecutor
from ._worker import Request, WorkerOp, dumps, one_line, process_main

__all__ = ["ProcessEnvExecutor", "ProcessWorker", "process_executor"]

logger = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL for a worker being killed.
KILL_GRACE_S = 0.5


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ProcessWorker(Transport):
    """One spawned worker process and the two threads that carry its pipe."""

    def __init__(self, index: int, context: Any) -> None:
        super().__init__(f"env-process-{index}")
        self._conn, child_conn = context.Pipe(duplex=True)
        lifeline_r, self._lifeline = context.Pipe(duplex=False)
        self._child_ends = (child_conn, lifeline_r)
        self.process = context.Process(target=process_main, args=(child_conn, lifeline_r), name=self.name, daemon=True)
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Request] = collections.deque()
        #: Requests sent and not answered, in the order the worker runs them (the first one is running).
        self._pending: dict[int, Reply] = {}
        self._ids = 0
        self._closing = False
        self._kill_reason: str | None = None
        self._timer: threading.Timer | None = None
        self._started = threading.Event()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        #: One thread at a time reaps the process (see _join).
        self._reap = threading.Lock()
        #: The worker's own pid (the process started here is its guardian), once it said it is ready.
        self._worker_pid: int | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        threading.Thread(target=self._start, name=f"{self.name}-start", daemon=True).start()

    def _start(self) -> None:
        try:
            with _without_main():
                self.process.start()
        except BaseException as exc:
            self._died(EnvWorkerError(f"env worker {self.name} could not start: {exc!r}", worker=self.name))
            self._started.set()
            return
        finally:
            for end in self._child_ends:
                end.close()
        self.name = f"{self.name} (pid {self.process.pid})"
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name=f"{self.name}-writer", daemon=True)
        self._writer.start()
        with self._cond:
            self._started.set()
            doomed = self._kill_reason is not None
        if doomed:  # killed while it was starting
            self._signal()

    def environ(self) -> dict[str, str] | None:
        # The worker takes the generator's environment variables as of its start (the fork server's
        # are those of the moment it started, maybe long ago).
        return dict(os.environ)

    @property
    def worker_pid(self) -> int | None:
        """The worker's own process id (``process`` is its guardian's), once it said it is ready."""
        return self._worker_pid

    def rss_mb(self) -> float | None:
        pid = self._worker_pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024.0
        except (OSError, ValueError, IndexError):
            return None
        return None

    def submit(self, op: WorkerOp, key: int, payload: Any, reply: Reply) -> None:
        with self._cond:
            if self.death is not None:
                error = self.death
            else:
                self._ids += 1
                reply.call_id = self._ids
                self._pending[self._ids] = reply
                self._queue.append((self._ids, op, key, payload))
                self._cond.notify()
                return
        reply.resolve(False, error)

    def skip(self, reply: Reply) -> None:
        with self._cond:
            if reply.call_id in self._pending and self.death is None:
                self._queue.append((0, "skip", 0, reply.call_id))
                self._cond.notify()

    def _write(self) -> None:
        conn, cond, queue = self._conn, self._cond, self._queue
        while True:
            with cond:
                while not queue and not self._closing:
                    cond.wait()
                if self._closing and not queue:
                    return
                batch = list(queue)
                queue.clear()
            try:
                data = self._pickled(batch)
                if data is not None:
                    conn.send_bytes(data)
            except (OSError, EOFError):
                return  # the worker is gone; the reader reports it

    def _pickled(self, batch: list[Request]) -> bytes | None:
        """One message for ``batch``: each payload pickled on its own, so one that cannot be fails its call only."""
        kept: list[Request] = []
        for call_id, op, key, payload in batch:
            if op in ("skip", "exit"):
                kept.append((call_id, op, key, payload))
                continue
            with self._cond:
                reply = self._pending.get(call_id)
            data = encode_request(reply.what if reply is not None else f"`{op}`", payload, dumps)
            if isinstance(data, bytes):
                kept.append((call_id, op, key, data))
                continue
            with self._cond:
                reply = self._pending.pop(call_id, None)
            if reply is not None:
                reply.resolve(False, data)
        return pickle.dumps(kept, pickle.HIGHEST_PROTOCOL) if kept else None

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                replies = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # pragma: no cover - ints and bytes (see serve): a broken link
                # The calls it carried cannot be told apart: end the worker, which fails every call it has.
                self.kill(f"it sent a message the generator cannot read ({one_line(exc)})")
                continue
            for call_id, ok, value, metrics in replies:
                if call_id == "ready":
                    self._worker_pid = value if isinstance(value, int) else None
                    continue
                with self._cond:
                    reply = self._pending.pop(call_id, None)
                if reply is not None:
                    reply.resolve(*decode(reply.what, ok, value, metrics))
        # Whatever ended the worker, its guardian kills what its envs left and exits as the worker did;
        # a guardian that does not (stopped, or killed itself) has its tree killed from here.
        if self._join(KILL_GRACE_S + 5.0) is None:
            self._kill_tree()
            self._join(5.0)
        self._died(self._death_error())

    def _join(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the process to exit; its exit code (None: still running).

        The fork server's ``Popen`` reads a child's exit code from a pipe once: a second thread polling
        at the same moment (the reader and ``shutdown`` both wait for the exit) reads EOF and records
        255 for a worker that exited cleanly, so the polls take turns.
        """
        with self._reap:
            if self.process.pid is None:  # it never started (its start failed): nothing to wait for
                return None
            self.process.join(timeout_s)
            code: int | None = self.process.exitcode
            return code

    def _death_error(self) -> EnvWorkerError:
        code = self._join(0)
        with self._cond:
            running = next(iter(self._pending.values()), None)
        what = f" while running {running.what}" if running is not None else " while idle"
        how = f"exit code {code}" if code is None or code >= 0 else _signal_name(-code)
        if self._kill_reason is not None:
            message = f"env worker {self.name} was killed ({how}): {self._kill_reason}"
        else:
            message = f"env worker {self.name} died ({how}){what}"
        return EnvWorkerError(message, worker=self.name, exitcode=code, killed=self._kill_reason is not None)

    def _died(self, error: EnvWorkerError) -> None:
        with self._cond:
            if self.death is not None:
                return
            self.death = error
            pending, self._pending = self._pending, {}
            self._queue.clear()
            self._closing = True
            self._cond.notify_all()
        if self._timer is not None:
            self._timer.cancel()
        if self._kill_reason is None and not self._shutting_down():
            logger.warning("%s", error)
        for reply in pending.values():
            reply.resolve(False, error)
        self._close_pipes()
        self.mourned()

    def _shutting_down(self) -> bool:
        return self._join(0) == 0

    def _close_pipes(self) -> None:
        for conn in (self._conn, self._lifeline):
            with contextlib.suppress(OSError):
                conn.close()

    def _terminate(self, reason: str) -> None:
        with self._cond:
            self._kill_reason = reason
            started = self._started.is_set()
        if started:  # else the starting thread sends the signal once the process exists
            self._signal()

    def _signal(self) -> None:
        if not self._signal_group(signal.SIGTERM):
            return
        self._timer = threading.Timer(KILL_GRACE_S, self._force_kill)
        self._timer.daemon = True
        self._timer.start()

    def _force_kill(self) -> None:
        if self.death is None:
            self._kill_tree()

    def _signal_group(self, signum: int) -> bool:
        """Send ``signum`` to the worker's process group (its guardian, its env's children); False once it is gone.

        The guardian makes itself a group leader as it starts (``setsid``); killed before that, it has
        no group yet (and no children): the signal goes to the process alone.
        """
        pid = self._pid()
        if pid is None:  # pragma: no cover - never started, or closed
            return False
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                return False
        except PermissionError:  # pragma: no cover - the id is another user's group now
            return False
        return True

    def _kill_tree(self) -> None:
        """SIGKILL the guardian and every process of its tree, unless it has exited (then its pid is no longer ours)."""
        pid = self._pid()
        if pid is not None and self._join(0) is None:
            kill_tree(pid)

    def _pid(self) -> int | None:
        try:
            pid: int | None = self.process.pid
        except ValueError:  # pragma: no cover - closed by shutdown()
            return None
        return pid

    def shutdown(self, timeout_s: float) -> None:
        if not self._started.wait(timeout_s) or self._reader is None:
            return  # its start failed (and was reported), or it is still starting after the wait
        if self.death is None:
            with self._cond:
                self._ids += 1
                self._queue.append((self._ids, "exit", 0, None))
                self._cond.notify()
            if self._join(timeout_s) is None:
                with self._cond:
                    self._kill_reason = "the generator shut its env workers down and it did not exit"
                self._kill_tree()
                self._join(timeout_s)
        # The reader sees the EOF, reports the death and closes the pipes: nothing is left open.
        for thread in (self._reader, self._writer):
            if thread is not None:
                thread.join(timeout_s)
        with contextlib.suppress(ValueError):  # still running after kill + join: left to the OS
            self.process.close()


class ProcessEnvExecutor(RemoteEnvExecutor):
    """``max_env_workers`` spawned worker processes (see the module docstring)."""

    kind = "process"

    def __init__(
        self,
        workers: int,
        *,
        cleanup_timeout_s: float = 30.0,
        start_method: str | None = None,
        start_timeout_s: float = 120.0,
        warm: int = 0,
        max_rss_mb: float | None = None,
    ) -> None:
        context = worker_context(start_method or _default_start_method())
        pool = WorkerPool(
            workers,
            lambda index: ProcessWorker(index, context),
            cleanup_timeout_s=cleanup_timeout_s,
            start_timeout_s=start_timeout_s,
            warm=warm,
            max_rss_mb=max_rss_mb,
        )
        super().__init__(pool)
        # At garbage collection or interpreter exit, whichever comes first (aclose() makes it a no-op).
        self._finalizer = weakref.finalize(self, pool.shutdown, 2.0)

    async def aclose(self) -> None:
        import anyio

        self._finalizer.detach()
        await anyio.to_thread.run_sync(self.pool.shutdown, 5.0)


def process_executor(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> ProcessEnvExecutor:
    """``env_executor="process"``: the row of the executor table (:mod:`~skyrl_structured.envs._kinds`)."""
    knobs = worker_pool_knobs(skyrl_gym_cfg)
    return ProcessEnvExecutor(
        workers,
        cleanup_timeout_s=cleanup_timeout_s,
        start_timeout_s=knobs.start_timeout_s,
        warm=knobs.warm,
        max_rss_mb=knobs.max_rss_mb,
    )
