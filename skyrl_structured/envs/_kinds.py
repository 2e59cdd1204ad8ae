"""The one table of env executors: each ``environment.skyrl_gym.env_executor`` kind and its factory.

A factory takes the gym config, the number of workers and ``env_cleanup_timeout_s`` and returns an
:class:`~skyrl_structured.envs._executors.EnvExecutor`. Adding an executor is one new module (its
executor class and factory) and one row here; docs/architecture.md walks through it. Each row
imports its module when first used, so the table costs nothing for kinds a run never picks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ..config import EnvExecutorKind
from ..types import SkyRLConfig
from ._executors import EnvExecutor, env_executor_kind
from ._open import env_config_for
from ._shapes import check_shape

__all__ = ["EXECUTORS", "ExecutorFactory", "check_envs", "make_executor"]

#: ``factory(skyrl_gym_cfg, workers, cleanup_timeout_s)``.
ExecutorFactory = Callable[[SkyRLConfig, int, float], EnvExecutor]


def _threads(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> EnvExecutor:
    from ._adapters import thread_executor

    return thread_executor(skyrl_gym_cfg, workers, cleanup_timeout_s)


def _processes(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> EnvExecutor:
    from ._process import process_executor

    return process_executor(skyrl_gym_cfg, workers, cleanup_timeout_s)


def _ray_actors(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> EnvExecutor:
    from ._ray import ray_executor

    return ray_executor(skyrl_gym_cfg, workers, cleanup_timeout_s)


#: Every executor kind and its factory.
EXECUTORS: Mapping[EnvExecutorKind, ExecutorFactory] = MappingProxyType(
    {"thread": _threads, "process": _processes, "ray": _ray_actors}
)


def make_executor(skyrl_gym_cfg: SkyRLConfig, workers: int, *, cleanup_timeout_s: float = 30.0) -> EnvExecutor:
    """The executor ``environment.skyrl_gym.env_executor`` asks for, with ``workers`` workers.

    ``max_env_workers=0`` means inline calls whatever the kind: there is no worker to host an env,
    so the thread executor runs them in the rollout's own task.

    Raises:
        ValueError: an unknown kind, or a worker-pool knob out of range (one line naming it).
    """
    kind = env_executor_kind(skyrl_gym_cfg)
    return EXECUTORS[kind if workers > 0 else "thread"](skyrl_gym_cfg, workers, cleanup_timeout_s)


def check_envs(
    executor: EnvExecutor, skyrl_gym_cfg: SkyRLConfig, env_classes: list[str], env_extras: list[Any]
) -> None:
    """Before any rollout: every env class and every row's extras can be run by ``executor``.

    Raises:
        ValueError: one line naming the env class, what cannot cross to a worker (or what no
            executor can call, :func:`~skyrl_structured.envs._shapes.check_shape`), and the fix.
    """
    seen: set[str] = set()
    for env_class, extras in zip(env_classes, env_extras, strict=True):
        if env_class not in seen:
            seen.add(env_class)
            check_shape(env_class, executor.kind)
            executor.check_env(env_class, env_config_for(skyrl_gym_cfg, env_class), {})
        executor.check_env(env_class, None, extras or {})
