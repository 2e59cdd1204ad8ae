"""Where one generator's environments run: its thread pool, or its ``env_executor``'s workers."""

from __future__ import annotations

import logging
from typing import Any

from ..types import SkyRLConfig
from ._executors import EnvExecutor
from ._kinds import check_envs, make_executor
from ._worker import importing_main

__all__ = ["EnvWorkers"]

logger = logging.getLogger(__name__)


class EnvWorkers:
    """The env workers of one generator, shared by all its ``generate()`` calls (as SkyRL's env executor is).

    One executor of the table (:mod:`~skyrl_structured.envs._kinds`), whatever its kind: threads start
    on first use (a new pool if the generator's ``max_env_workers`` changed; 0 runs env calls inline),
    worker processes or Ray actors on first use or ``env_workers_warm`` ahead, and :meth:`aclose` stops them.
    """

    __slots__ = ("_executor",)

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
        self._executor: EnvExecutor = make_executor(skyrl_gym_cfg, max_env_workers, cleanup_timeout_s=cleanup_timeout_s)
        if self._executor.kind != "thread" and rollout_timeout_s is None:
            logger.warning(
                "environment.skyrl_gym.env_executor=%r without generator.rollout_timeout_s: a hung env call is "
                "never killed and hangs the training step; set generator.rollout_timeout_s to bound each rollout",
                self._executor.kind,
            )

    def runner(self, max_env_workers: int) -> EnvExecutor:
        """The executor for the next rollouts."""
        self._executor = self._executor.resized(max_env_workers)
        return self._executor

    @property
    def alive(self) -> int:
        """Workers alive now: threads (0 before the first threaded call), processes or actors."""
        return self._executor.workers_alive

    def check(self, skyrl_gym_cfg: SkyRLConfig, env_classes: list[str], env_extras: list[Any]) -> None:
        """Before any rollout: every env class and row can be run by the executor (threads take anything)."""
        check_envs(self._executor, skyrl_gym_cfg, env_classes, env_extras)
        self._executor.warm_up()  # env_workers_warm: started now, replaced here after a death

    async def aclose(self) -> None:
        """Stop worker processes or actors; threads need nothing."""
        await self._executor.aclose()
