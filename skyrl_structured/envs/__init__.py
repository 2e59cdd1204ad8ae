"""Environments as async context managers: created, used and closed exactly once on every path.

``skyrl_gym`` environments are synchronous. :func:`open_env` wraps one so that ``init``,
``step`` and ``close`` run in the generator's worker threads (at most ``max_env_workers``, see
:mod:`skyrl_structured.envs._threads`), or inline when ``max_env_workers`` is 0, as SkyRL does. An
environment that already speaks the async protocol (``__aenter__``/``__aexit__`` and ``async``
``init``/``step``) is used as is; one with async ``init``/``step`` but a plain ``close`` gets that
close run in a worker thread, never on the event loop. Where the env lives is the executor's
(:mod:`skyrl_structured.envs._executors`, ``env_executor``): with ``process`` or ``ray`` it is an async
handle to an env in a worker, and the rules for abandoned work are that module's.

Cleanup is shielded from cancellation and bounded in time: if the rollout was cancelled while a
worker thread was still inside ``step``, cleanup first waits for that call so that ``close``
never races it; a cleanup that overruns ``env_cleanup_timeout_s`` is abandoned with a warning,
and the close still runs in its thread once it can. A failing ``close`` (``GeneratorExit``
included) is logged and counted but never replaces the rollout's own result or error.
"""

from .._runtime.cleanup import CleanupStats
from ..types import EnvHandle
from ._adapters import AsyncEnvironment, EnvCallRunner, SyncEnvAdapter, is_async_env
from ._adapters import has_noop_close as has_noop_close
from ._open import EnvSettings, env_config_for, open_env
from ._threads import EnvThreadPool, active_env_thread_calls, wait_env_thread_calls

__all__ = [
    "AsyncEnvironment",
    "CleanupStats",
    "EnvCallRunner",
    "EnvHandle",
    "EnvSettings",
    "EnvThreadPool",
    "SyncEnvAdapter",
    "active_env_thread_calls",
    "env_config_for",
    "is_async_env",
    "open_env",
    "wait_env_thread_calls",
]
