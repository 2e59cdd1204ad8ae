"""Where one generator's environments run: its thread pool, or its ``env_executor``'s workers."""

from __future__ import annotations

import logging
from typing import Any

from ..types import SkyRLConfig
from ._adapters import EnvCallRunner
from ._executors import EnvExecutor, check_envs, make_executor
from ._threads import EnvThreadPool
from ._worker import importing_main

__all__ = ["EnvWorkers"]

logger = logging.getLogger(__name__)


class EnvWorkers:
    """The env workers of one generator, shared by all its ``generate()`` calls (as SkyRL's env executor is).

    Threads (``env_executor=thread``) are a pool created on first use, and created again if the
    generator's ``max_env_workers`` changed; 0 runs env calls inline. Worker processes or Ray actors
    (``process``, ``ray``) are started on first use and stopped by :meth:`aclose`.
    """

    __slots__ = ("_executor", "_pool")

    def __init__(
        self,
        skyrl_gym_cfg: SkyRLConfig,
        max_env_workers: int,
        *,
        cleanup_timeout_s: float,
        rollout_timeout_s: float | None = None,
    ) -> None:
        script = importing_main()
        if script is not None:
            raise RuntimeError(
                f'your script {script} has no `if __name__ == "__main__":` guard: an env worker imported it to '
                "build an env class defined there, and it built a generator again; put the code that runs under "
                "the guard (or define the env class in a module of its own)"
            )
        self._pool: EnvThreadPool | None = None
        self._executor: EnvExecutor | None = make_executor(
            skyrl_gym_cfg, max_env_workers, cleanup_timeout_s=cleanup_timeout_s
        )
        if self._executor is not None and rollout_timeout_s is None:
            logger.warning(
                "environment.skyrl_gym.env_executor=%r without generator.rollout_timeout_s: a hung env call is "
                "never killed and hangs the training step; set generator.rollout_timeout_s to bound each rollout",
                self._executor.kind,
            )

    def runner(self, max_env_workers: int) -> EnvExecutor:
        """The executor for the next rollouts."""
        if self._executor is not None:
            return self._executor
        if max_env_workers <= 0:
            return EnvCallRunner(None)
        if self._pool is None or self._pool.max_workers != max_env_workers:
            self._pool = EnvThreadPool(max_env_workers)
        return EnvCallRunner(self._pool)

    @property
    def alive(self) -> int:
        """Workers alive now: threads (0 before the first threaded call), processes or actors."""
        if self._executor is not None:
            return self._executor.workers_alive
        return self._pool.threads if self._pool is not None else 0

    def check(self, skyrl_gym_cfg: SkyRLConfig, env_classes: list[str], env_extras: list[Any]) -> None:
        """Before any rollout: every env class and row can cross to a worker (threads take anything)."""
        if self._executor is not None:
            check_envs(self._executor, skyrl_gym_cfg, env_classes, env_extras)
            self._executor.warm_up()  # env_workers_warm: started now, replaced here after a death

    async def aclose(self) -> None:
        """Stop worker processes or actors; threads need nothing."""
        if self._executor is not None:
            await self._executor.aclose()
