"""One endpoint worker process as the trainer holds it: the process, its channel, and the two threads that carry it.

A :class:`CaptureWorker` belongs to a :class:`~._workers.CaptureWorkers` pool (see that module for
placement, deaths and replacement). Like an env worker process
(:class:`~skyrl_structured.envs._process.ProcessWorker`), it has a reader thread handing the worker's
frames to the pool (``ready``, ``opened``/``closed`` answers, and ``call``/``cancel`` frames for the
event loop of the session they concern, :mod:`._pooled`), and a writer thread sending every frame
queued since its last send. When the channel ends, the reader waits for the process, kills what is left of its
tree, and tells the pool the worker died.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any

from .._runtime.completion import Completion
from .._runtime.reaper import kill_tree
from .._runtime.spawning import without_main, worker_context
from ..errors import CaptureWorkerError
from ._frames import Frame, FrameBuffer, encode, read_frames
from ._worker import capture_main

if TYPE_CHECKING:
    from ._workers import CaptureWorkers

__all__ = ["EXIT_S", "CaptureWorker"]

#: Seconds between the exit frame and killing a worker's tree, and for joining its threads.
EXIT_S = 5.0


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
        """Queue ``frame`` for the worker (dropped once it is dead), from any thread.

        The writer thread sends everything queued since its last send at once: under a burst of replies
        that is one ``sendall`` (and one wake-up of the worker's loop) for many frames. Sending each frame
        in place from the event loop instead cost more, in the trainer and in the worker
        (``python -m benchmarks.agents --only cpu``).
        """
        data = encode(frame)
        with self._cond:
            if self.death is None and not self._closing:
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
            try:
                self._channel.sendall(data)
            except OSError:
                return  # the worker is gone: the reader reports it

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
        if self._join(EXIT_S) is None:
            self._kill_tree()
            self._join(EXIT_S)
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

    def shutdown(self, timeout_s: float = EXIT_S) -> None:
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
