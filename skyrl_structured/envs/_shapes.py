"""The env shapes no executor can drive, refused before any rollout (one line naming the executor and the fix).

Every executor runs a blocking env's calls and awaits an async env's coroutines (in the generator for
``thread``, on an event loop of the env's own in its worker for ``process`` and ``ray``). A method written
as an async generator (``async def`` with a ``yield``) is neither: calling it gives an iterator that
nobody iterates, so the env would fail at its first call, in every rollout; a class that does not derive
from ``skyrl_gym.Env`` is refused by ``skyrl_gym.make`` in every rollout too, and one without an
``aggregate_metrics`` (``skyrl_gym.Env`` has none, ``BaseTextEnv`` has) fails each batch's metrics. All
are refused here, by looking at the registered class, before any rollout or worker starts (for
``process`` and ``ray``, a class registered by a module path this process has not imported is left
to its workers: see :func:`_env_type`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import skyrl_gym
from skyrl_gym.envs.registration import load_env_creator

from ._executors import EnvExecutorKind
from ._worker import ASYNC_METHODS

__all__ = ["check_shape"]

#: Every method an executor calls on an env (``get_metrics`` is always called synchronously).
_CALLED = (*ASYNC_METHODS, "get_metrics")


def _env_type(env_class: str, *, may_import: bool) -> type | None:
    """The class registered as ``env_class`` (None: a factory, not registered, or not imported).

    A ``"module:Class"`` entry point is imported only when ``may_import``: for the thread executor, whose
    ``skyrl_gym.make`` imports it in this process anyway. Workers import it themselves, so for them only
    a module already imported here is looked at: an import can be slow, or wait on something, and this
    check runs on the event loop.
    """
    spec = skyrl_gym.registry.get(env_class)
    if spec is None:
        return None
    entry: Any = spec.entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        if not may_import and module not in sys.modules:
            return None
        try:
            entry = load_env_creator(entry) if may_import else getattr(sys.modules[module], name, None)
        except Exception:  # an entry point that cannot be imported: the executor's own check names it
            return None
    return entry if isinstance(entry, type) else None


def check_shape(env_class: str, executor: EnvExecutorKind) -> None:
    """Refuse ``env_class`` when no executor can call it (see the module docstring; async ``get_metrics`` too).

    Raises:
        ValueError: one line naming the env class, the method, the executor and the fix.
    """
    cls = _env_type(env_class, may_import=executor == "thread")
    if cls is None:
        return
    where = f"{cls.__module__}.{cls.__qualname__}"
    if not issubclass(cls, skyrl_gym.Env):
        raise ValueError(
            f"env class {env_class!r} ({where}) cannot run under env_executor={executor!r}: skyrl_gym.make only "
            "builds subclasses of skyrl_gym.Env; derive it from skyrl_gym's BaseTextEnv (async methods are fine)"
        )
    if not callable(getattr(cls, "aggregate_metrics", None)):
        raise ValueError(
            f"env class {env_class!r} ({where}) cannot run under env_executor={executor!r}: it has no "
            "`aggregate_metrics`, which skyrl_gym calls on every batch's env metrics; derive it from skyrl_gym's "
            "BaseTextEnv (or define a static `aggregate_metrics(metrics)`)"
        )
    for name in _CALLED:
        method = getattr(cls, name, None)
        if inspect.isasyncgenfunction(method):
            raise ValueError(
                f"env class {env_class!r} ({where}) cannot run under env_executor={executor!r}: its `{name}` is an "
                f"async generator (async def with yield), which no env executor can call; make `{name}` an "
                "`async def` that returns its result (or a plain `def`)"
            )
    if inspect.iscoroutinefunction(getattr(cls, "get_metrics", None)):
        raise ValueError(
            f"env class {env_class!r} ({where}) cannot run under env_executor={executor!r}: its `get_metrics` is "
            "`async def`, but executors read metrics synchronously; make `get_metrics` a plain `def`"
        )
