"""Inside an env worker (a spawned process or a Ray actor): environments built and driven by request.

This module is what a worker imports, so it stays small: ``skyrl_gym`` and the standard library.
A worker hosts many environments, each under the key its handle in the generator gave it, and runs
every call in its main thread, one at a time (so ``signal.alarm`` and ``setitimer`` work in env code).

Requests are ``(call_id, op, key, payload)``; replies ``(call_id, ok, value)`` where ``value`` is
the result or, when ``ok`` is False, the exception (replaced by a ``RuntimeError`` carrying its text
when it cannot be pickled).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import skyrl_gym

__all__ = ["CallSkipped", "EnvHost", "process_main"]

logger = logging.getLogger(__name__)

#: ``(registry id, "module:attribute" entry point, registry kwargs)``: how a worker rebuilds an env class.
EnvRecipe = tuple[str, str, dict[str, Any]]

#: Replies queued at most this long before they are sent (a burst of cheap calls costs one message).
_FLUSH_AFTER_S = 0.002
_PR_SET_PDEATHSIG = 1


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its type, text and traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        text = "".join(traceback.format_exception(exc)).rstrip()
        return RuntimeError(f"{type(exc).__name__}: {exc} (raised in an env worker; not picklable)\n{text}")
    return exc


class EnvHost:
    """The environments of one worker, by key; ``handle`` runs one request in the calling thread."""

    def __init__(self) -> None:
        self.envs: dict[int, Any] = {}

    def handle(self, op: str, key: int, payload: Any) -> Any:
        try:
            return self._handle(op, key, payload)
        except KeyError as exc:
            if _from_environ(exc):
                exc.add_note(
                    "(raised in an env worker, whose environment variables are the generator's as of the worker's "
                    "start: set it before the first generate(), or pass it in env_config or extras)"
                )
            raise

    def _handle(self, op: str, key: int, payload: Any) -> Any:
        if op == "ping":  # the worker's first request: its start (see _start)
            _start(payload)
            return os.getpid()
        if op == "main":
            _import_main(payload)
            return None
        if op == "make":
            recipe, env_config, extras = payload
            env_id, entry_point, kwargs = recipe
            if env_id not in skyrl_gym.registry:
                skyrl_gym.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
            self.envs[key] = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
            return None
        if op == "close":
            env = self.envs.pop(key, None)
            if env is not None:  # None: its make was skipped, nothing to close
                env.close()
            return None
        env = self.envs[key]
        if op == "init":
            return env.init(payload), self._metrics(env)
        if op == "step":
            return env.step(payload), self._metrics(env)
        raise ValueError(f"unknown env worker request {op!r}")

    @staticmethod
    def _metrics(env: Any) -> tuple[bool, Any]:  # env: what skyrl_gym.make built (untyped upstream)
        # Sent with every init/step reply: the handle's get_metrics() is synchronous and cannot ask.
        try:
            return True, env.get_metrics()
        except Exception as exc:
            return False, _portable(exc)


def _from_environ(exc: KeyError) -> bool:
    """Whether ``exc`` is ``os.environ[name]`` missing its key (the innermost frame is ``os.environ``'s)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is type(os.environ).__getitem__.__code__


def _start(ping: dict[str, Any]) -> None:
    """Take the generator's environment variables (if sent) and import the env classes' modules.

    An import that fails is left for the env's ``make`` to report, with its own error.
    """
    environ = ping.get("environ")
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    for module in ping.get("modules", ()):
        try:
            importlib.import_module(module)
        except Exception:
            logger.debug("env worker: importing %s failed; the env's make will report it", module, exc_info=True)


#: The generator's main script while a worker imports it (for an env class defined there), else None.
_importing_main: str | None = None


def importing_main() -> str | None:
    """The script an env worker is importing as ``__main__`` right now (None: not in such an import).

    A generator built while it is set is a script without an ``if __name__ == "__main__":`` guard,
    re-running itself inside its own env worker: :class:`~skyrl_structured.envs.EnvWorkers` refuses it.
    """
    return _importing_main


def _import_main(spec: dict[str, str]) -> None:
    """Import the generator's ``__main__`` here (as multiprocessing's spawn would), for envs defined there.

    Only a worker hosting such an env pays for it: a worker's start never runs the user's script.
    """
    global _importing_main
    from multiprocessing import process, spawn

    _importing_main = spec.get("init_main_from_path") or spec.get("init_main_from_name") or "__main__"
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]  # multiprocessing's own "bootstrapping" flag
    try:
        spawn.prepare(spec)
    finally:
        del current._inheriting  # type: ignore[attr-defined]
        _importing_main = None


class CallSkipped(Exception):
    """The reply to a request skipped before it started: its rollout had given up on it."""


class _Inbox:
    """A worker's requests in arrival order, and the ids of those to skip (``skip`` requests)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.queue: collections.deque[tuple[Any, str, int, Any]] = collections.deque()
        self.skipped: set[Any] = set()

    def absorb(self, requests: list[tuple[Any, str, int, Any]]) -> None:
        for request in requests:
            if request[1] == "skip":
                self.skipped.add(request[3])
            else:
                self.queue.append(request)

    def fill(self, *, block: bool) -> bool:
        """Take what the pipe holds (waiting for something if ``block``); False at EOF."""
        try:
            if block and not self.queue:
                self.absorb(self._conn.recv())
            while self._conn.poll(0):
                self.absorb(self._conn.recv())
        except (EOFError, OSError):
            return False
        return True


def _die_with_parent(lifeline: Any) -> None:
    """Exit when the generator's process dies, even by SIGKILL: a parent-death signal and a pipe watchdog.

    The parent is the generator (spawn) or multiprocessing's fork server, which exits when the
    generator does; the lifeline pipe's other end is the generator's alone, whichever it is.
    """
    parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog still works
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(70)

    def watch() -> None:
        with contextlib.suppress(OSError, EOFError):
            lifeline.poll(None)  # the generator never writes: this returns at EOF, when it is gone
        os._exit(70)

    threading.Thread(target=watch, name="skyrl-structured-env-lifeline", daemon=True).start()


def _sender(conn: Any) -> Callable[[list[Any]], None]:
    def send(replies: list[Any]) -> None:
        try:
            conn.send(replies)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError):
            for reply in replies:  # one reply cannot be pickled: send the others, and an error for it
                try:
                    conn.send([reply])
                except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
                    conn.send([(reply[0], False, RuntimeError(f"an env's reply could not be pickled: {exc!r}"))])

    return send


def process_main(conn: Any, lifeline: Any) -> None:
    """A worker process's whole life: serve requests until ``exit`` or until the generator is gone.

    Before each call it reads what the pipe holds, so a ``skip`` sent after its request was queued
    here still stops that call from starting. Replies go out in bursts: once the worker has nothing
    left to run, or after ``_FLUSH_AFTER_S``.
    """
    _die_with_parent(lifeline)
    # Ctrl-C reaches the whole process group; the generator decides what stops, and closes the envs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host = EnvHost()
    send = _sender(conn)
    inbox = _Inbox(conn)
    conn.send([("ready", True, os.getpid())])
    out: list[Any] = []
    first = 0.0
    while True:
        if not inbox.fill(block=not out):
            return
        if not inbox.queue:
            send(out)  # nothing more to run now: answer what is done
            out = []
            continue
        call_id, op, key, payload = inbox.queue.popleft()
        if op == "exit":
            if out:
                send(out)
            return
        if len(inbox.skipped) > 1024:  # skips that came after their call had run: ids only grow
            inbox.skipped = {i for i in inbox.skipped if i >= call_id}
        if call_id in inbox.skipped:
            inbox.skipped.discard(call_id)
            out.append((call_id, False, CallSkipped()))
        else:
            try:
                out.append((call_id, True, host.handle(op, key, payload)))
            except BaseException as exc:  # an env's SystemExit is its call's failure, not the worker's end
                out.append((call_id, False, _portable(exc)))
        now = time.monotonic()
        if len(out) == 1:
            first = now
        if now - first >= _FLUSH_AFTER_S:
            send(out)
            out = []
