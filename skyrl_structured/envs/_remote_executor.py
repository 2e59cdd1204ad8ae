"""What the process and Ray executors share: how an env class is rebuilt in a worker, and the executor base.

:func:`env_recipe` turns a registered env class into what a worker can import; :func:`check_picklable`
refuses, before any rollout, a config or extras that cannot reach a worker; :class:`RemoteEnvExecutor`
is the :class:`~skyrl_structured.envs._executors.EnvExecutor` over a
:class:`~skyrl_structured.envs._remote.WorkerPool`, whichever transport the pool's workers use
(:mod:`~skyrl_structured.envs._process`, :mod:`~skyrl_structured.envs._ray`).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Mapping
from multiprocessing import spawn
from typing import Any

import skyrl_gym

from .._runtime.cleanup import CleanupStats
from .._runtime.pauses import PausableDeadline
from ..types import SkyRLConfig
from ._executors import EnvExecutor, EnvExecutorKind
from ._pool import WorkerPool
from ._remote import WorkerEnv
from ._worker import MAIN_KEYS, EnvRecipe

__all__ = ["RemoteEnvExecutor", "check_picklable", "env_recipe", "main_spec"]


def main_spec() -> dict[str, str]:
    """How a worker imports the generator's ``__main__`` (multiprocessing's own keys for it)."""
    data = spawn.get_preparation_data("main")
    return {key: data[key] for key in MAIN_KEYS if key in data}


def env_recipe(env_class: str) -> EnvRecipe:
    """How a worker rebuilds ``env_class``: its registry id, an importable entry point, its kwargs.

    Raises:
        ValueError: the class is not registered, or cannot be imported by a worker (one line naming
            the class and the fix).
    """
    spec = skyrl_gym.registry.get(env_class)
    if spec is None:
        known = ", ".join(sorted(skyrl_gym.registry))
        raise ValueError(f"env class {env_class!r} is not registered with skyrl_gym (registered: {known})")
    entry = spec.entry_point
    kwargs = dict(spec.kwargs or {})
    fix = (
        "define it at module level in an importable module and register it by name "
        "(skyrl_gym.register(id=..., entry_point='package.module:Class')), or use env_executor='thread'"
    )
    if isinstance(entry, str):
        target = entry
    else:
        module = getattr(entry, "__module__", None)
        qualname = getattr(entry, "__qualname__", "")
        where = f"{module}.{qualname}"
        if not module or "<" in qualname or "." in qualname:
            raise ValueError(
                f"env class {env_class!r} ({where}) cannot be rebuilt in an env worker process: "
                f"it is a lambda or a nested definition; {fix}"
            )
        if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
            raise ValueError(
                f"env class {env_class!r} ({where}) is defined in __main__ of `python -c` or a REPL, which a "
                f"worker process cannot import; {fix}"
            )
        found = getattr(sys.modules.get(module), qualname, None)
        if found is not entry:
            raise ValueError(
                f"env class {env_class!r} ({where}) is not what `{module}:{qualname}` names, so a worker "
                f"would build something else; {fix}"
            )
        target = f"{module}:{qualname}"
    try:
        pickle.dumps(kwargs)
    except Exception as exc:
        raise ValueError(
            f"env class {env_class!r} was registered with kwargs that cannot be pickled for an env worker: "
            f"{exc!r}; register it with plain values, or use env_executor='thread'"
        ) from None
    return env_class, target, kwargs


def check_picklable(env_class: str, what: str, value: Any, executor: EnvExecutorKind) -> None:
    """Refuse ``value`` (an env's config or extras) that cannot be sent to a worker; one line with the fix."""
    try:
        pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(
            f"the {what} of env class {env_class!r} cannot be pickled to reach an env worker "
            f"(env_executor={executor!r}): {exc!r}; pass plain values (str, numbers, lists, dicts), "
            "or use env_executor='thread'"
        ) from None


class RemoteEnvExecutor(EnvExecutor):
    """What the process and Ray executors share: recipes, checks, handles, the pool's shutdown."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._recipes: dict[str, EnvRecipe] = {}

    @property
    def bound(self) -> int:
        return self.pool.size

    @property
    def workers_alive(self) -> int:
        return len(self.pool.workers)

    def _recipe(self, env_class: str) -> EnvRecipe:
        recipe = self._recipes.get(env_class)
        if recipe is None:
            recipe = self._recipes[env_class] = env_recipe(env_class)
            module = recipe[1].partition(":")[0]
            if module == "__main__":
                if self.pool.main_spec is None:
                    self.pool.main_spec = main_spec()
            else:
                self.pool.env_modules.add(module)
        return recipe

    def warm_up(self) -> None:
        self.pool.warm_up()

    def check_env(self, env_class: str, env_config: SkyRLConfig, extras: Mapping[str, Any]) -> None:
        self._recipe(env_class)
        check_picklable(env_class, "env_config", env_config, self.kind)
        check_picklable(env_class, "env extras", extras, self.kind)

    def make_env(
        self,
        env_class: str,
        *,
        env_config: SkyRLConfig,
        extras: dict[str, Any],
        stats: CleanupStats,
        deadline: PausableDeadline | None = None,
    ) -> WorkerEnv:
        return WorkerEnv(self.pool, env_class, (self._recipe(env_class), env_config, extras), stats, deadline)
