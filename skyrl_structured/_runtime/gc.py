"""A garbage-collector policy for the length of ``generate()``: fewer, younger collections.

A batch allocates hundreds of thousands of container objects (messages, token lists, outputs) that
mostly live until the batch returns. With CPython's default generation-0 threshold (700) that
churn triggers a full collection per batch, which walks the whole heap (a tokenizer and a model
trainer make it large): about a quarter of a second at 1,024 rollouts. While any ``generate()``
runs, :func:`relaxed_gc` raises the generation-0 threshold so young collections are rarer and
the full one is not triggered; reference counting still frees everything acyclic at once.

The policy is process-wide, so it is reference-counted: overlapping ``generate()`` calls (on one
loop or on several threads) share one raise, and the threshold the application had is restored
exactly when the last of them ends, on every path (return, error, cancellation). A collector the
application disabled (``gc.disable()``) is left alone, and so is a generation-0 threshold already
at or above ours. Not ``gc.freeze()``: applications use that for their own ends (fork servers).
Opt out with ``generator.gc_tuning: false``.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

#: Generation-0 threshold while a batch runs (CPython's default is 700).
GEN0_THRESHOLD = 50_000

_lock = threading.Lock()
_active = 0
#: The thresholds to restore when the last call ends; None when nothing was changed.
_saved: tuple[int, int, int] | None = None


def _enter() -> None:
    global _active, _saved
    with _lock:
        _active += 1
        if _active > 1:
            return
        current = gc.get_threshold()
        if not gc.isenabled() or current[0] == 0 or current[0] >= GEN0_THRESHOLD:
            _saved = None
            return
        _saved = current
        gc.set_threshold(GEN0_THRESHOLD, current[1], current[2])
        logger.debug("gc generation-0 threshold raised from %d to %d during generate()", current[0], GEN0_THRESHOLD)


def _exit() -> None:
    global _active, _saved
    with _lock:
        _active -= 1
        if _active > 0 or _saved is None:
            return
        saved, _saved = _saved, None
        gc.set_threshold(*saved)


def active_calls() -> int:
    """How many calls are inside :func:`relaxed_gc` now (for tests and diagnostics)."""
    return _active


@contextmanager
def relaxed_gc(enabled: bool = True) -> Iterator[None]:
    """Raise the generation-0 threshold for the duration of the block (see the module docstring)."""
    if not enabled:
        yield
        return
    _enter()
    try:
        yield
    finally:
        _exit()
