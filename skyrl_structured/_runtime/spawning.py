"""How the package starts its worker processes: one multiprocessing context, never re-running ``__main__``.

Env workers (:mod:`skyrl_structured.envs._process`) and capture endpoint workers
(:mod:`skyrl_structured.agents._workers`) start from the same context: the fork server where the
platform has it (one server, preloading both kinds of worker's module), else ``spawn``; never a
bare ``fork`` of a process that has threads and an event loop. CPython's spawn and fork-server
hand-offs re-run the main script in every child (seconds for a trainer's entrypoint that imports
torch, and a script without an ``if __name__ == "__main__":`` guard would start itself again):
:func:`without_main` keeps the main module out of the data a child starts from.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from multiprocessing import spawn
from typing import Any

__all__ = ["FORKSERVER_PRELOAD", "MAIN_KEYS", "start_method", "without_main", "worker_context"]

#: The keys of multiprocessing's preparation data that make a child re-run the main module.
MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
#: What the fork server imports before forking workers (never ``__main__``).
FORKSERVER_PRELOAD = ("skyrl_gym", "skyrl_structured.envs._worker", "skyrl_structured.agents._worker")

_lean = threading.local()
_original_preparation_data: Callable[[str], dict[str, Any]] = spawn.get_preparation_data


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data, less the main module inside :func:`without_main`."""
    data = _original_preparation_data(name)
    if getattr(_lean, "active", False):
        for key in MAIN_KEYS:
            data.pop(key, None)
    return data


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """Start processes in this block (this thread only) without re-running ``__main__`` in them.

    Both hand-offs (``popen_forkserver`` and ``popen_spawn_posix``) read ``spawn.get_preparation_data``
    when they launch: it is wrapped once, and the wrapper drops the main keys only for a thread inside
    this block, so every other user of multiprocessing sees the standard behaviour.
    """
    if spawn.get_preparation_data is not _preparation_data:
        spawn.get_preparation_data = _preparation_data
    _lean.active = True
    try:
        yield
    finally:
        _lean.active = False


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def worker_context(method: str | None = None) -> Any:
    """The multiprocessing context workers start from (``method``: ``spawn`` or ``forkserver``; None: the default).

    The fork server imports :data:`FORKSERVER_PRELOAD` once; each worker forked from it then starts
    in milliseconds. The preload has no effect once the server runs, hence one list for every kind.
    """
    method = method or start_method()
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"worker processes start with 'spawn' or 'forkserver', never {method!r}")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context
