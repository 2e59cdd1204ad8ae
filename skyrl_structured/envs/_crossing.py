"""What crosses between the generator and an env worker: each argument, reply and metrics dict pickled on its own.

A value that cannot be pickled on one side or unpickled on the other fails only the call that carried
it, with :class:`~skyrl_structured.EnvBoundaryError` naming the env, the call, the type and why (the
worker side is :func:`~skyrl_structured.envs._worker.serve`); the metrics sent with a reply fail only
``get_metrics``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ._executors import EnvBoundaryError
from ._worker import Dumps, Uncrossed, culprit, one_line

__all__ = ["decode", "encode_request"]


class _NamingUnpickler(pickle.Unpickler):
    """Records the last class or function it looked up: what was being rebuilt when a load failed."""

    last = ""

    def find_class(self, module: str, name: str) -> Any:
        self.last = f"{module}.{name}"
        return super().find_class(module, name)


def _unpickle_failure(data: bytes) -> str:
    """Why ``data`` cannot be unpickled here, naming what was being rebuilt (run after a load failed)."""
    unpickler = _NamingUnpickler(io.BytesIO(data))
    try:
        unpickler.load()
    except BaseException as exc:
        where = f"rebuilding {unpickler.last}" if unpickler.last else "unpickling it"
        return f"{where} failed in the generator ({one_line(exc)})"
    return "unpickling it failed once in the generator, then worked"  # pragma: no cover - a flaky reconstructor


def _load(data: bytes, what: str, part: str) -> tuple[bool, Any]:
    """``data`` unpickled, or False and the :class:`EnvBoundaryError` saying why it cannot cross."""
    try:
        value = pickle.loads(data)
    except BaseException:  # whatever a reconstructor raises: this call's failure
        why = _unpickle_failure(data)
        return False, EnvBoundaryError(f"{_part(part, what)} could not cross to the generator: {why}{_FIX}")
    if isinstance(value, Uncrossed):
        if value.part == "argument":
            return False, EnvBoundaryError(
                f"the argument of {what} could not cross to its env worker: unpickling it there failed "
                f"({value.error}); pass plain values"
            )
        return False, EnvBoundaryError(
            f"{_part(value.part, what)} could not cross to the generator: {value.culprit} cannot be pickled "
            f"in the env worker ({value.error}){_FIX}"
        )
    return True, value


_FIX = "; return plain values (str, numbers, lists, dicts), or use env_executor='thread'"


def _part(part: str, what: str) -> str:
    if part == "metrics":
        return f"the metrics (get_metrics) sent with the reply to {what}"
    if part == "error":
        return f"the error raised by {what}"
    return f"the reply to {what}"


def decode(what: str, ok: bool, data: bytes, metrics: bytes | None) -> tuple[bool, Any]:
    """A worker's reply to ``what`` (``"`step` of env 'x'"``) as ``(ok, value)`` for :meth:`Reply.resolve`.

    ``init`` and ``step`` replies carry their env's metrics: the value is ``(result, (ok, metrics))``,
    and metrics that cannot cross fail only ``get_metrics``.
    """
    loaded, value = _load(data, what, "reply" if ok else "error")
    if not loaded:
        return False, value
    if metrics is None or not ok:
        return ok, value
    loaded, pair = _load(metrics, what, "metrics")
    return True, (value, pair if loaded else (False, pair))


def encode_request(what: str, payload: Any, pickle_it: Dumps) -> bytes | EnvBoundaryError:
    """``payload`` pickled for the worker, or the error that fails its call when it cannot be."""
    try:
        return pickle_it(payload)
    except BaseException as exc:  # whatever a __reduce__ raises: this call's failure
        return EnvBoundaryError(
            f"the argument of {what} could not cross to its env worker: {culprit(payload, pickle_it)} cannot be "
            f"pickled ({one_line(exc)}); pass plain values"
        )
