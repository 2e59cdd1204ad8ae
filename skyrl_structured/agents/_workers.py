"""The capture endpoint's worker processes, seen from the trainer (``generator.agent_endpoint_workers``).

:class:`CaptureWorkers` is a generator's pool: N processes (:func:`~._worker.capture_main`), each on a
port of its own that the trainer binds and keeps (a duplicate is passed to the worker), so the port
never refuses while its worker is replaced. A session's base URL names its worker's port: that is
its placement, sticky per rollout (every session of one rollout, retries included, on one worker
while it lives; a new rollout on the live worker with the fewest open sessions).

Each :class:`~._worker_link.CaptureWorker` is carried by two daemon threads, as an env worker
process is (:class:`~skyrl_structured.envs._process.ProcessWorker`): a writer sending every frame
queued since its last send, and a reader handing frames to the event loop of the session they concern (see
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
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._http import Request, Response
from ..errors import CaptureWorkerError
from ._frames import Frame
from ._readings import WorkerReading
from ._routes import error_shape, request_parts, rollout_ended, split_path
from ._tombstone import Tombstone
from ._worker_link import EXIT_S, CaptureWorker

__all__ = ["CaptureWorkers"]

logger = logging.getLogger(__name__)

#: Starts in a row without a ready worker after which a slot is given up.
MAX_FAILED_STARTS = 3
#: Ended sessions' keys remembered for the tombstone's answers (a bound, not a timer).
_ENDED = 65536

#: What the reader hands the pool: ``(worker, frame)``.
Deliver = Callable[["CaptureWorker", Frame], None]


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
        """Block until every slot's worker is ready or the slot is given up (at most ``timeout_s``); raises if
        none is ready.

        A start that failed is replaced like any dead worker, and this waits for the replacement: a start
        can fail once for a reason of the moment (the multiprocessing fork server dying as a start
        connected to it, seen once in a loaded test run), and the pool's own retries then start it.
        """
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            with self._lock:
                waiting = [w for w in self.workers if w.index not in self._given_up and not _up(w)]
            if not waiting:
                break
            worker = waiting[0]
            if worker.death is None:
                worker.ready.wait(left)
            else:  # dead, its replacement not in place yet
                time.sleep(min(left, 0.01))
        if not any(_up(w) for w in self.workers):
            first = next(iter(self._given_up.values()), None) or next(
                (w.death for w in self.workers if w.death is not None), None
            )
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
                WorkerReading(w.index, w.pid, w.port, _up(w), len(w.sessions), r, lost)
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

    def shutdown(self, timeout_s: float = EXIT_S) -> None:
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


def _up(worker: CaptureWorker) -> bool:
    """Whether a worker said it is ready and has not died since."""
    return worker.pid is not None and worker.death is None


def _unclaimed(worker: CaptureWorker, frame: Frame) -> None:
    """Before any attachment: a call for no session known here is answered at once."""
    if frame[0] == "call":
        worker.post(("fail", frame[1], (404, "capture session unknown", None, None, True, None, None, None)))


def _error(body: Any, status: int) -> Response:
    return Response(status, json.dumps(body).encode())
