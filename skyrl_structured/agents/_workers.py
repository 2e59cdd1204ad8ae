"""The capture endpoint's worker processes, seen from the trainer (``generator.agent_endpoint_workers``).

:class:`CaptureWorkers` is a generator's pool: N processes (:func:`~._worker.capture_main`), each on a
port of its own that the trainer binds and keeps (a duplicate is passed to the worker), so the port
never refuses while its worker is replaced. A session's base URL names its worker's port: that is
its placement, sticky per rollout (every session of one rollout, retries included, on one worker
while it lives; a new rollout on the live worker with the fewest open sessions).

Each :class:`CaptureWorker` is carried by two daemon threads, as an env worker process is
(:class:`~skyrl_structured.envs._process.ProcessWorker`): a writer sending every frame queued since
its last send, and a reader handing frames to the event loop of the session they concern (see
:mod:`._pooled`). The pool outlives event loops and ``generate()`` calls, and a worker's death is
seen between calls: each of its open sessions then fails its rollout with
:class:`~skyrl_structured.errors.CaptureWorkerError`, its port is answered by a
:class:`~._tombstone.Tombstone` (404 ``rollout_ended`` for the lost keys) until a replacement on the
same socket is ready, and a slot is given up after 3 starts in a row that failed.

Workers start from the package's multiprocessing context without ``__main__``
(:mod:`~skyrl_structured._runtime.spawning`), under a guardian that dies with the trainer
(:mod:`~skyrl_structured._runtime.guardian`); the pool ends at :meth:`CaptureWorkers.shutdown`
(``aclose()``, garbage collection, interpreter exit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._http import Request, Response
from .._runtime.completion import Completion
from .._runtime.reaper import kill_tree
from .._runtime.spawning import without_main, worker_context
from ..errors import CaptureWorkerError
from ._frames import Frame, FrameBuffer, encode, read_frames
from ._readings import WorkerReading
from ._routes import error_shape, request_parts, rollout_ended, split_path
from ._tombstone import Tombstone
from ._worker import capture_main

__all__ = ["CaptureWorker", "CaptureWorkers"]

logger = logging.getLogger(__name__)

#: Starts in a row without a ready worker after which a slot is given up.
MAX_FAILED_STARTS = 3
#: Seconds between the exit frame and killing a worker's tree, and for joining its threads.
_EXIT_S = 5.0
#: Ended sessions' keys remembered for the tombstone's answers (a bound, not a timer).
_ENDED = 65536

#: What the reader hands the pool: ``(worker, frame)``.
Deliver = Callable[["CaptureWorker", Frame], None]


def _signal_name(code: int | None) -> str:
    """How a process ended: its signal's name (a negative code, or 128 + N as a shell reports it), or its code."""
    if code is None or 0 <= code <= 128:
        return f"exit code {code}"
    number = -code if code < 0 else code - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"exit code {code}"


class CaptureWorker:
    """One endpoint worker process on one port, and the two threads that carry its channel."""

    def __init__(
        self,
        pool: CaptureWorkers,
        index: int,
        listener: socket.socket,
        url: str,
        spec: bytes,
        ended: list[tuple[str, str, str]] | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.listener = listener
        self.url = url
        self.port = int(listener.getsockname()[1])
        context = worker_context()
        self._channel, child = socket.socketpair()
        lifeline_r, self._lifeline = context.Pipe(duplex=False)
        self._child_ends: tuple[Any, ...] = (child, lifeline_r)
        self.process = context.Process(
            target=capture_main,
            args=(child, lifeline_r, listener, spec, index, ended or []),
            name=f"capture-endpoint-{index}",
            daemon=True,
        )
        #: The worker's own pid (``process`` is its guardian), once it said it is ready.
        self.pid: int | None = None
        self.ready = threading.Event()
        self.death: CaptureWorkerError | None = None
        #: Open sessions placed here, by key (each an entry of :mod:`._pooled`).
        self.sessions: dict[str, Any] = {}
        #: Frames awaiting their answer (``opened``, ``closed``), by sequence number.
        self.waiting: dict[int, Completion[Any]] = {}
        self._seq = 0
        self._cond = threading.Condition(threading.Lock())
        self._out: list[bytes] = []
        self._sending = False
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._reap = threading.Lock()

    def exited(self) -> bool:
        """Whether the worker process has ended: read now, before its reader may have seen it.

        Its channel is at EOF once the kernel closed its files (before the sockets of its connections, opened
        later), or the process is a zombie.
        """
        if self.death is not None:
            return True
        if self.pid is None:
            return False
        try:
            if self._channel.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                return True
        except BlockingIOError:
            pass
        except OSError:
            return True
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True
        except (IndexError, ValueError):
            return False

    def __repr__(self) -> str:
        return f"capture endpoint worker {self.index} (pid {self.pid}, port {self.port})"

    def start(self) -> None:
        threading.Thread(target=self._start, name=f"capture-endpoint-{self.index}-start", daemon=True).start()

    def _start(self) -> None:
        try:
            with without_main():
                self.process.start()
        except BaseException as exc:
            self._died(CaptureWorkerError(f"capture endpoint worker {self.index} could not start: {exc!r}"))
            return
        finally:
            for end in self._child_ends:
                end.close()
        for target, role in ((self._read, "reader"), (self._write, "writer")):
            thread = threading.Thread(target=target, name=f"capture-endpoint-{self.index}-{role}", daemon=True)
            self._threads.append(thread)
            thread.start()

    # ------------------------------------------------------------------ frames

    def post(self, frame: Frame) -> None:
        """Send ``frame`` to the worker (dropped once it is dead), from any thread; never blocks.

        When nothing is queued or being sent, the frame goes straight into the channel's socket buffer
        (a non-blocking send); what does not fit, or comes while the writer thread sends, is queued for it.
        Sending in place saves the writer thread a wake-up per reply, which is most of what it cost the
        trainer's process (``benchmarks/agents.py``, see the CHANGELOG's issue 46 lines).
        """
        data = encode(frame)
        with self._cond:
            if self.death is not None or self._closing:
                return
            if not self._out and not self._sending:
                try:
                    sent = self._channel.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return  # the worker is gone: the reader reports it
                if sent == len(data):
                    return
                data = data[sent:]
            self._out.append(data)
            self._cond.notify()

    def request(self, frame: Frame) -> Completion[Any]:
        """Send ``frame`` with a sequence number after its kind; the completion its answer settles."""
        done: Completion[Any] = Completion()
        with self._cond:
            self._seq += 1
            seq = self._seq
            error = self.death
            if error is None:
                self.waiting[seq] = done
        if error is not None:
            done.settle(None, error)
        else:
            self.post((frame[0], seq, *frame[1:]))
        return done

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._out and not self._closing:
                    self._cond.wait()
                if not self._out:
                    return
                data, self._out = b"".join(self._out), []
                self._sending = True  # :meth:`post` queues behind these bytes until they are all sent
            try:
                self._channel.sendall(data)
            except OSError:
                return  # the worker is gone: the reader reports it
            finally:
                with self._cond:
                    self._sending = False

    def _read(self) -> None:
        buffer = FrameBuffer()
        while (frames := read_frames(self._channel, buffer)) is not None:
            for frame in frames:
                kind = frame[0]
                if kind == "ready":
                    self.pid = frame[1]
                    self.ready.set()
                    self.pool.ready(self)
                elif kind in ("opened", "closed"):
                    with self._cond:
                        done = self.waiting.pop(frame[1], None)
                    if done is not None:
                        done.settle(frame[2:])
                else:
                    self.pool.deliver(self, frame)
        # The guardian exits as the worker did once it has killed what was left; one that does not is killed.
        if self._join(_EXIT_S) is None:
            self._kill_tree()
            self._join(_EXIT_S)
        self._died(self._death_error())

    def _death_error(self) -> CaptureWorkerError:
        code = self._join(0)
        return CaptureWorkerError(
            f"capture endpoint worker {self.index} (pid {self.pid}, port {self.port}) died ({_signal_name(code)}) "
            f"with {len(self.sessions)} session(s) open; their rollouts fail, the worker is replaced on the same port"
        )

    def _died(self, error: CaptureWorkerError) -> None:
        with self._cond:
            if self.death is not None:
                return
            self.death = error
            waiting, self.waiting = self.waiting, {}
            self._out.clear()
            closing, self._closing = self._closing, True
            self._cond.notify_all()
        for done in waiting.values():
            done.settle(None, error)
        with contextlib.suppress(OSError):
            self._channel.close()
        with contextlib.suppress(OSError):
            self._lifeline.close()
        self.ready.set()
        self.pool.died(self, error, shutting_down=closing)

    # ------------------------------------------------------------------ the end

    def _join(self, timeout_s: float) -> int | None:
        with self._reap:
            if self.process.pid is None:
                return None
            self.process.join(timeout_s)
            code: int | None = self.process.exitcode
            return code

    def _kill_tree(self) -> None:
        pid = self.process.pid
        if pid is not None and self._join(0) is None:
            kill_tree(pid)

    def shutdown(self, timeout_s: float = _EXIT_S) -> None:
        """Stop the worker: the exit frame, a bounded wait, then its tree killed; its threads joined."""
        started = self.process.pid is not None
        if started and self.death is None:
            with self._cond:
                self._out.append(encode(("exit",)))
                self._closing = True
                self._cond.notify_all()
            if self._join(timeout_s) is None:
                self._kill_tree()
                self._join(timeout_s)
        else:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        if not started:
            for end in (self._channel, self._lifeline):
                with contextlib.suppress(OSError):
                    end.close()


class CaptureWorkers:
    """A generator's endpoint worker processes, one port each; thread-safe (see the module docstring).

    ``sockets`` are the listening sockets (owned: closed at :meth:`shutdown`); ``urls`` the root URL agents
    are given for each; ``spec`` the pickled settings every worker starts from (the tokenizer among them).
    """

    def __init__(self, sockets: list[socket.socket], urls: list[str], spec: bytes, *, mode: str = "") -> None:
        self.sockets = sockets
        self.urls = urls
        self._spec = spec
        #: How the number was chosen, for logs (``"auto"`` or ``""``).
        self.mode = mode
        self._lock = threading.Lock()
        self.workers = [CaptureWorker(self, i, s, u, spec) for i, (s, u) in enumerate(zip(sockets, urls, strict=True))]
        self._failed_starts = [0] * len(sockets)
        self._given_up: dict[int, CaptureWorkerError] = {}
        self._tombstones: dict[int, Tombstone] = {}
        #: Ended sessions by key: ``(id, rollout)``, for the tombstone's answers and a replacement's.
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: Where each rollout's sessions go, by ``(batch id, rollout index)``.
        self.placed: dict[tuple[int, int], CaptureWorker] = {}
        #: ``deliver(worker, frame)``: the frames that concern a session, handed to its loop (see :mod:`._pooled`).
        self.deliver: Deliver = _unclaimed
        self.deaths = 0
        self.restarts = 0
        self.sessions_lost = 0
        #: Per slot: its workers replaced, and the sessions its deaths failed (for :meth:`readings`).
        self._slot_restarts = [0] * len(sockets)
        self._slot_lost = [0] * len(sockets)
        #: Told (from a reader thread) when a worker died or a replacement is ready (see :mod:`._readings`).
        self.watchers: list[Callable[[], None]] = []
        self._closing = False
        #: The ``serve_capture`` blocks attached now (0: the workers say the endpoint has closed).
        self._attached = 0

    @property
    def size(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker is ready or dead (at most ``timeout_s``); raises if none is ready."""
        for worker in list(self.workers):
            worker.ready.wait(timeout_s)
        if not any(w.pid is not None and w.death is None for w in self.workers):
            first = next((w.death for w in self.workers if w.death is not None), None)
            raise CaptureWorkerError(f"no capture endpoint worker started: {first or 'none ready in time'}")

    def pids(self) -> list[int]:
        """Every live process of the pool: the workers and their guardians."""
        found: list[int] = []
        for worker in self.workers:
            found += [p for p in (worker.pid, worker.process.pid) if p is not None]
        return found

    def place(self, batch: int, index: int) -> CaptureWorker:
        """The worker a rollout's session goes to: where its earlier sessions went while it lives, else the
        live worker with the fewest open sessions (ties: the lowest index)."""
        with self._lock:
            worker = self.placed.get((batch, index))
            if worker is not None and worker.death is None and worker in self.workers:
                return worker
            live = [w for w in self.workers if w.death is None and w.index not in self._given_up]
            if not live:
                raise next(iter(self._given_up.values()), None) or CaptureWorkerError(
                    "no capture endpoint worker is running (each died and is being replaced)"
                )
            worker = min(live, key=lambda w: (len(w.sessions), w.index))
            self.placed[(batch, index)] = worker
            return worker

    def readings(self) -> list[WorkerReading]:
        """Each slot's worker now: its pid and port, whether it is up, its open sessions, restarts and losses."""
        with self._lock:
            return [
                WorkerReading(w.index, w.pid, w.port, w.pid is not None and w.death is None, len(w.sessions), r, lost)
                for w, r, lost in zip(self.workers, self._slot_restarts, self._slot_lost, strict=True)
            ]

    def _changed(self) -> None:
        for watcher in list(self.watchers):
            watcher()

    def attach(self, change: int) -> None:
        """A ``serve_capture`` block attached (+1) or detached (-1); the workers hear when none or the first is."""
        with self._lock:
            self._attached += change
            frame = (
                ("attached",) if self._attached == 1 and change > 0 else ("detached",) if not self._attached else None
            )
        if frame is not None:
            for worker in list(self.workers):
                worker.post(frame)

    def remember_ended(self, key: str, session_id: str, rollout: str) -> None:
        with self._lock:
            self.ended[key] = (session_id, rollout)
            while len(self.ended) > _ENDED:
                self.ended.popitem(last=False)

    # ------------------------------------------------------------------ deaths and replacements

    def ready(self, worker: CaptureWorker) -> None:
        """A worker said it is ready (its reader thread): a replacement takes its port back from the tombstone."""
        with self._lock:
            self._failed_starts[worker.index] = 0
            tombstone = self._tombstones.pop(worker.index, None)
            ended = list(self.ended.items())
        if ended:
            worker.post(("ended", [(key, sid, rollout) for key, (sid, rollout) in ended]))
        worker.post(("attached",) if self._attached else ("detached",))
        if tombstone is not None:
            tombstone.stop()
        self._changed()

    def died(self, worker: CaptureWorker, error: CaptureWorkerError, *, shutting_down: bool) -> None:
        """A worker died (its reader thread): its sessions fail, its port answers from a tombstone, it is replaced."""
        with self._lock:
            lost = list(worker.sessions.items())
            worker.sessions.clear()
            closing = self._closing or shutting_down
            if not closing:
                self.deaths += worker.pid is not None
                self.sessions_lost += len(lost)
                self._slot_lost[worker.index] += len(lost)
                if worker.pid is None:
                    self._failed_starts[worker.index] += 1
        for key, entry in lost:
            self.remember_ended(key, entry.session.id, entry.session.rollout)
            entry.lose(error)
        if closing or self.workers[worker.index] is not worker:
            return
        logger.warning("%s", error)
        if self._failed_starts[worker.index] >= MAX_FAILED_STARTS:
            with self._lock:
                self._given_up[worker.index] = error
            message = "capture endpoint worker %d failed %d starts in a row; its port is given up"
            logger.error(message, worker.index, MAX_FAILED_STARTS)
        else:
            self._bury(worker)
            self._replace(worker)
        self._changed()

    def _bury(self, worker: CaptureWorker) -> None:
        with self._lock:
            if worker.index in self._tombstones:
                return
        try:
            tombstone = Tombstone([worker.listener], self._ended_answer, what=f"capture endpoint worker {worker.index}")
        except OSError as exc:
            logger.warning(
                "capture endpoint worker %d's port cannot be answered while it is replaced: %r", worker.index, exc
            )
            return
        with self._lock:
            self._tombstones[worker.index] = tombstone

    def _replace(self, worker: CaptureWorker) -> None:
        with self._lock:
            if self._closing:
                return
            # The ended keys go with its start: its first answer on the port already knows them.
            ended = [(key, sid, rollout) for key, (sid, rollout) in self.ended.items()]
            fresh = CaptureWorker(self, worker.index, worker.listener, worker.url, self._spec, ended)
            self.workers[worker.index] = fresh
            self.restarts += 1
            self._slot_restarts[worker.index] += 1
        fresh.start()

    def _ended_answer(self, request: Request | None) -> Response:
        """The tombstone's answer: the ended session's 404 (``rollout_ended``), naming its rollout when known."""
        if request is None:
            return _error(rollout_ended(None).body(), 404)
        _, path, headers = request_parts(request)
        path_key, bearer, route = split_path(path, headers)
        key = path_key if path_key is not None else bearer
        with self._lock:
            ended = self.ended.get(key) if key is not None else None
        error = rollout_ended(ended)
        return Response(error.status, json.dumps(error_shape(route)(error)).encode(), headers=error.headers)

    # ------------------------------------------------------------------ the end

    def shutdown(self, timeout_s: float = _EXIT_S) -> None:
        """Stop every worker (the exit frame, then kill), the tombstones, and close the ports. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            tombstones, self._tombstones = list(self._tombstones.values()), {}
        for tombstone in tombstones:
            tombstone.stop()
        for worker in list(self.workers):
            worker.shutdown(timeout_s)
        for tombstone in tombstones:
            tombstone.join()
        for one in self.sockets:
            with contextlib.suppress(OSError):
                one.close()
        logger.debug("capture endpoint workers stopped (pids %s)", self.pids())


def _unclaimed(worker: CaptureWorker, frame: Frame) -> None:
    """Before any attachment: a call for no session known here is answered at once."""
    if frame[0] == "call":
        worker.post(("fail", frame[1], (404, "capture session unknown", None, None, True, None, None, None)))


def _error(body: Any, status: int) -> Response:
    return Response(status, json.dumps(body).encode())
