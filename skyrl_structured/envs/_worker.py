"""Inside an env worker (a spawned process or a Ray actor): environments built and driven by request.

This module is what a worker imports, so it stays small: ``skyrl_gym``, the standard library and
:mod:`~skyrl_structured._runtime.reaper` (the standard library only).
A worker hosts many environments, each under the key its handle in the generator gave it, and runs
every call in its main thread, one at a time (so ``signal.alarm`` and ``setitimer`` work in env code).
An async environment (:func:`is_async_shape`) gets an asyncio event loop of its own for its whole life
(:class:`LoopEnv`): each of its calls runs to completion on that loop, so the generator's handle is the
same request-per-call handle as for a blocking env, and a deadline still kills the worker.

Requests are ``(call_id, op, key, payload)``; replies ``(call_id, ok, value, metrics)`` where
``value`` is the result or, when ``ok`` is False, the exception (replaced by a ``RuntimeError``
carrying its text when it cannot be pickled), and ``metrics`` what ``get_metrics`` returned after an
``init`` or ``step``. Each payload, value and metrics travels pickled on its own (:func:`serve`), inside
a message of plain ints and bytes: so a value that cannot be pickled here, or unpickled on the other
side, fails its own call (an :class:`Uncrossed` note in its place), never the message, the other
calls it carries, or the worker.

A worker is the child of a guardian (:func:`process_main`), the process the generator started: a
child subreaper that, when the worker exits or the generator dies, kills every process left in its
tree (:mod:`~skyrl_structured._runtime.reaper`), so an env's children and grandchildren go with their
worker, even those that left its process group or session.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import skyrl_gym

from .._runtime.guardian import guarded_child
from .._runtime.native import new_env_runner
from .._runtime.spawning import MAIN_KEYS as MAIN_KEYS

__all__ = [
    "MAIN_KEYS",
    "CallSkipped",
    "EnvHost",
    "EnvRecipe",
    "LoopEnv",
    "MakePayload",
    "Request",
    "WorkerOp",
    "is_async_shape",
    "process_main",
]

logger = logging.getLogger(__name__)

#: ``(registry id, "module:attribute" entry point, registry kwargs)``: how a worker rebuilds an env class.
EnvRecipe = tuple[str, str, dict[str, Any]]
#: A ``make`` request's payload: the env's recipe, its ``env_config`` and the rollout's env extras.
MakePayload = tuple[EnvRecipe, Any, dict[str, Any]]

#: The worker protocol's operations: ``ping`` (the start's first request), ``main`` (import the
#: generator's ``__main__``), ``make``/``init``/``step``/``close`` (one env's calls, by env key),
#: ``skip`` (drop a queued call whose rollout gave up before it started) and ``exit`` (stop serving).
WorkerOp = Literal["ping", "main", "make", "init", "step", "close", "skip", "exit"]

#: One request on the wire: ``(reply id, operation, env key, payload)``.
Request = tuple[int, WorkerOp, int, Any]


#: ``dumps`` of the process executor (Ray's actors use cloudpickle's).
Dumps = Callable[[Any], bytes]
#: How deep :func:`culprit` looks for the part of a value that cannot be pickled.
_CULPRIT_DEPTH = 16

#: Replies queued at most this long before they are sent (a burst of cheap calls costs one message).
_FLUSH_AFTER_S = 0.002


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its type, text and traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        text = "".join(traceback.format_exception(exc)).rstrip()
        return RuntimeError(f"{type(exc).__name__}: {exc} (raised in an env worker; not picklable)\n{text}")
    return exc


def dumps(value: Any) -> bytes:
    """Pickle ``value`` for the pipe (the process executor's ``dumps``)."""
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (errors from pickling can be long, or multi-line)."""
    try:
        text = str(exc).strip().splitlines()
    except BaseException:  # an exception whose __str__ raises still gets a description
        text = []
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _parts(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{index}]", item) for index, item in enumerate(value)]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return [(f".{name}", item) for name, item in attributes.items()]
    return []


def culprit(value: Any, pickle_it: Dumps) -> str:
    """The innermost part of ``value`` that fails to pickle, as ``Type at value['key'][0]``.

    Only run once pickling ``value`` failed: each level pickles the parts until one fails, and
    looks inside it (at most ``_CULPRIT_DEPTH`` levels: a list nested 200,000 deep is named at that depth).
    """
    path = "value"
    try:
        for _ in range(_CULPRIT_DEPTH):
            for where, part in _parts(value):
                try:
                    pickle_it(part)
                except BaseException:
                    path += where
                    value = part
                    break
            else:
                break
    except BaseException:  # a part that cannot even be looked at: name what was found so far
        pass
    return f"{type_name(value)} at {path}" if path != "value" else type_name(value)


class Uncrossed:
    """Sent in place of a value that could not be pickled (or a request's payload that could not be unpickled).

    Plain strings only, so it always crosses; the generator turns it into the call's
    :class:`~skyrl_structured.EnvBoundaryError`, which names the env and the call.
    """

    def __init__(self, part: str, culprit: str, error: str) -> None:
        #: ``"reply"``, ``"error"``, ``"metrics"`` or ``"argument"``.
        self.part = part
        #: What failed: ``"mymod.Handle at value['metadata']['h']"``.
        self.culprit = culprit
        #: ``"RuntimeError: no pickling"``.
        self.error = error


def _encode(value: Any, part: str, pickle_it: Dumps) -> bytes:
    try:
        return pickle_it(value)
    except BaseException as exc:  # whatever a __reduce__ raises (RecursionError too): this call's failure
        return pickle_it(Uncrossed(part, culprit(value, pickle_it), one_line(exc)))


def serve(
    host: EnvHost, op: WorkerOp, key: int, payload: bytes, pickle_it: Dumps, unpickle: Callable[[bytes], Any]
) -> tuple[bool, bytes, bytes | None]:
    """Run one request on ``host``: ``(ok, value, metrics)``, each pickled on its own (see the module docstring).

    Never raises: an env's exception (``SystemExit`` included) is the call's failure, a value that
    cannot be pickled is replaced by an :class:`Uncrossed` note, and so is a payload that cannot be
    unpickled here.
    """
    try:
        argument = unpickle(payload)
    except BaseException as exc:
        return False, pickle_it(Uncrossed("argument", "", one_line(exc))), None
    try:
        value = host.handle(op, key, argument)
    except BaseException as exc:  # an env's SystemExit is its call's failure, not the worker's end
        return False, _encode(_portable(exc), "error", pickle_it), None
    if op in ("init", "step"):
        result, metrics = value
        return True, _encode(result, "reply", pickle_it), _encode(metrics, "metrics", pickle_it)
    return True, _encode(value, "reply", pickle_it), None


class EnvHost:
    """The environments of one worker, by key; ``handle`` runs one request in the calling thread."""

    def __init__(self) -> None:
        self.envs: dict[int, Any] = {}

    def handle(self, op: WorkerOp, key: int, payload: Any) -> Any:
        try:
            return self._handle(op, key, payload)
        except KeyError as exc:
            if _from_environ(exc):
                exc.add_note(
                    "(raised in an env worker, whose environment variables are the generator's as of the worker's "
                    "start: set it before the first generate(), or pass it in env_config or extras)"
                )
            raise

    def _handle(self, op: WorkerOp, key: int, payload: Any) -> Any:
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
            env = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
            self.envs[key] = LoopEnv(env) if is_async_shape(env) else env
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


#: The methods whose being coroutine functions makes an env async (:func:`is_async_shape`).
ASYNC_METHODS = ("__aenter__", "__aexit__", "init", "step", "close", "aclose")


def is_async_shape(env: object) -> bool:
    """Whether ``env`` needs an event loop: an async context manager, or any of its calls a coroutine function."""
    return any(inspect.iscoroutinefunction(getattr(env, name, None)) for name in ASYNC_METHODS)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class LoopEnv:
    """An async environment driven from the worker's blocking request loop, on an event loop of its own.

    The loop (an :class:`asyncio.Runner`, made by the runtime's bridge) lives as long as the env: made
    here, ``__aenter__`` run on it; ``close`` runs ``__aexit__(None, None, None)`` (else an ``aclose`` or
    ``close``, awaited when it returns an awaitable), then closes the loop, cancelling whatever tasks the
    env left behind.
    An env whose ``__aenter__`` raises is not made (the protocol: it cleaned up after itself); its
    loop is closed at once. One loop for the env's life, not one per call, so clients bound to the
    loop that opened them (an ``httpx.AsyncClient``) keep working from ``init`` to the close.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self._runner = new_env_runner()
        enter = getattr(env, "__aenter__", None)
        if enter is not None and getattr(env, "__aexit__", None) is not None:
            try:
                self._run(enter())
            except BaseException:
                self._runner.close()
                raise

    def _run(self, value: Any) -> Any:
        """``value`` itself, or what it gives once awaited on this env's loop."""
        return self._runner.run(_awaited(value)) if inspect.isawaitable(value) else value

    def init(self, prompt: Any) -> Any:
        return self._run(self.env.init(prompt))

    def step(self, action: Any) -> Any:
        return self._run(self.env.step(action))

    def get_metrics(self) -> Any:
        return self.env.get_metrics()

    def close(self) -> None:
        env = self.env
        try:
            if getattr(env, "__aenter__", None) is not None and getattr(env, "__aexit__", None) is not None:
                self._run(env.__aexit__(None, None, None))
            else:
                closer = getattr(env, "aclose", None) or getattr(env, "close", None)
                if closer is not None:
                    self._run(closer())
        finally:
            self._runner.close()


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
        self.queue: collections.deque[tuple[Any, WorkerOp, int, Any]] = collections.deque()
        self.skipped: set[Any] = set()

    def absorb(self, requests: list[tuple[Any, WorkerOp, int, Any]]) -> None:
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


def _sender(conn: Any) -> Callable[[list[Any]], None]:
    def send(replies: list[Any]) -> None:
        conn.send_bytes(dumps(replies))  # ints, bools and bytes (see serve): nothing here can fail to pickle

    return send


def process_main(conn: Any, lifeline: Any) -> None:
    """A worker process's whole life: serve requests until ``exit`` or until the generator is gone.

    Before each call it reads what the pipe holds, so a ``skip`` sent after its request was queued
    here still stops that call from starting. Replies go out in bursts: once the worker has nothing
    left to run, or after ``_FLUSH_AFTER_S``.
    """
    # The process the generator started stays as the guardian, a child subreaper; the worker is its
    # child, so whatever the worker's envs start, and leave behind, stays in the guardian's tree.
    guarded_child(lifeline)
    # The worker is in its own session, out of the terminal's reach; a SIGINT sent to it anyway is
    # ignored: the generator decides what stops, and closes the envs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host = EnvHost()
    send = _sender(conn)
    inbox = _Inbox(conn)
    send([("ready", True, os.getpid(), None)])  # the worker's pid (the generator started the guardian)
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
            out.append((call_id, False, dumps(CallSkipped()), None))
        else:
            out.append((call_id, *serve(host, op, key, payload, dumps, pickle.loads)))
        now = time.monotonic()
        if len(out) == 1:
            first = now
        if now - first >= _FLUSH_AFTER_S:
            send(out)
            out = []
