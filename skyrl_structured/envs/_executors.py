"""The executor seam: where blocking environment code runs, and what happens to work nobody waits for.

Every environment a rollout opens comes from one :class:`EnvExecutor`, chosen by
``environment.skyrl_gym.env_executor`` from the one table of kinds
(:data:`~skyrl_structured.envs._kinds.EXECUTORS`); the three are peers, and no caller treats threads
apart:

- ``"thread"`` (the default, SkyRL's behaviour): :class:`~skyrl_structured.envs.EnvCallRunner`.
  The env lives in the generator's process; ``init``/``step``/``close`` run in at most
  ``max_env_workers`` daemon threads (:mod:`~skyrl_structured.envs._threads`), or inline with 0.
- ``"process"``: :class:`~skyrl_structured.envs._process.ProcessEnvExecutor`. The env lives in one of
  ``max_env_workers`` worker processes and is reached through a handle (:mod:`~skyrl_structured.envs._remote`).
- ``"ray"``: :class:`~skyrl_structured.envs._ray.RayEnvExecutor`. The same handle; the workers are Ray actors.

The seam is small: :meth:`EnvExecutor.make_env` returns an environment (a plain ``skyrl_gym`` env
for threads, an async handle with ``init``/``step``/``close``/``get_metrics`` for the others),
:meth:`EnvExecutor.check_env` refuses before any rollout what an executor cannot run,
:attr:`EnvExecutor.bound` is the number of workers, :meth:`EnvExecutor.warm_up` starts them ahead of
need, :meth:`EnvExecutor.aclose` stops them. Killing a worker is the remote handles' business
(:meth:`~skyrl_structured.envs._pool.WorkerPool.kill`). The modules import downward only: this seam,
then the transports (:mod:`._threads`, :mod:`._worker`, :mod:`._crossing`, :mod:`._pool`; a thread
call and a worker's reply are one :class:`~skyrl_structured._runtime.completion.Completion`), then the
abandoned-work policy (:mod:`._abandon`), then the handles and executors (:mod:`._adapters`,
:mod:`._remote`, :mod:`._remote_executor`, :mod:`._process`, :mod:`._ray`), then the table
(:mod:`._kinds`) and :mod:`._workers`, which holds a generator's executor.

Abandoned work, the one set of rules for every executor (docs/failures.md and docs/envs.md):

1. A call whose rollout gave up before it *started* is skipped; a close, once submitted, always runs.
2. A call whose rollout was cancelled while it *runs* is waited for by that env's cleanup (bounded by
   ``env_cleanup_timeout_s``) before the close, so a close never races a step.
3. When that bound (or, for a call in flight, the rollout's own ``rollout_timeout_s`` deadline, never
   a deadline or cancel of the caller's scopes around ``generate()``, which is rule 2's case) runs out
   (rules 2 and 3 are one policy, :func:`~skyrl_structured.envs._abandon.close_after_in_flight`, run by
   the cleanup engine, with two strategies): a thread cannot be stopped, so the call keeps its
   thread, the close is chained after it, and the env stays counted as live
   (``max_concurrent_rollouts``, ``max_env_workers``) until it returns;
   a worker process or actor is killed (SIGTERM to its whole process group, then SIGKILL after a short
   grace, or ``ray.kill``), every env living in it fails with :class:`EnvWorkerError`, and a fresh
   worker replaces it, started in the background as soon as the death is seen.
4. Nothing abandoned keeps the process alive: threads are daemons; worker processes, with the process
   groups they lead (an env's children), die with the generator's process (parent-death signal and a
   pipe watchdog) and at ``aclose()``/interpreter exit.
5. What crosses to or from a worker fails only its own call when it cannot be pickled or unpickled
   (:class:`EnvBoundaryError`); the worker and its other envs carry on.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from .._runtime.cleanup import CleanupStats
from .._runtime.pauses import PausableDeadline
from ..config import ENV_EXECUTORS, EnvExecutorKind, check_choice, invalid_value, read_knob
from ..errors import EnvBoundaryError, EnvWorkerError
from ..types import SkyRLConfig

__all__ = [
    "ENV_EXECUTORS",
    "EnvBoundaryError",
    "EnvExecutor",
    "EnvExecutorKind",
    "EnvWorkerError",
    "WorkerPoolKnobs",
    "env_executor_kind",
    "worker_pool_knobs",
]

logger = logging.getLogger(__name__)


class EnvExecutor(abc.ABC):
    """Where a generator's environments live and their blocking calls run (see the module docstring)."""

    #: ``"thread"``, ``"process"`` or ``"ray"``.
    kind: EnvExecutorKind = "thread"

    @property
    @abc.abstractmethod
    def bound(self) -> int:
        """How many env calls may run at once (the workers); 0 for inline calls."""

    @abc.abstractmethod
    def make_env(
        self,
        env_class: str,
        *,
        env_config: SkyRLConfig,
        extras: dict[str, Any],
        stats: CleanupStats,
        deadline: PausableDeadline | None = None,
    ) -> object:
        """A new environment: a ``skyrl_gym`` env, or an async handle to one living in a worker.

        The handle is an :class:`~skyrl_structured.AsyncEnvironment`, used as is; anything else is a
        synchronous (or half-async) ``skyrl_gym`` env that ``open_env`` puts behind the async protocol.
        ``env_config`` is the env's section of the gym config (a mapping or an attribute bag, as
        SkyRL hands it to ``skyrl_gym.make``).

        ``stats`` (the batch's :class:`~skyrl_structured.envs.CleanupStats`) counts what the handle
        sees: workers killed, worker crashes, envs lost with their worker. ``deadline`` is the
        rollout's own ``rollout_timeout_s`` (None without one), the only deadline a handle may kill
        its worker for while a call runs (rule 3 of the module docstring).
        """

    @property
    def workers_alive(self) -> int:
        """Workers started and not known dead (worker processes, Ray actors); 0 where there are none."""
        return 0

    def resized(self, workers: int) -> EnvExecutor:
        """This executor for ``workers`` workers (the generator's ``max_env_workers`` may change between calls).

        Only threads follow it (their pool is made again); a process or Ray pool keeps the size it
        was built with.
        """
        return self

    def warm_up(self) -> None:  # noqa: B027
        """Start ``env_workers_warm`` workers ahead of need, non-blocking (threads need nothing)."""

    def check_env(self, env_class: str, env_config: SkyRLConfig, extras: Mapping[str, Any]) -> None:  # noqa: B027
        """Refuse, before any rollout starts, an env this executor cannot run (``ValueError``, one line).

        Threads run anything ``skyrl_gym.make`` can build, so the default accepts everything.
        """

    async def aclose(self) -> None:  # noqa: B027
        """Stop the workers (nothing to stop for threads: they are daemons that exit when idle)."""


def env_executor_kind(skyrl_gym_cfg: SkyRLConfig) -> EnvExecutorKind:
    """``environment.skyrl_gym.env_executor``, ``"thread"`` when the config lacks it (SkyRL's own).

    Raises:
        ValueError: a value other than ``thread``, ``process`` or ``ray``, worded by
            :func:`~skyrl_structured.config.check_choice`.
    """
    kind = read_knob(skyrl_gym_cfg, "env_executor", "thread")
    if kind is None:
        return "thread"
    check_choice("environment.skyrl_gym.env_executor", kind)
    return cast(EnvExecutorKind, kind)


@dataclass(frozen=True)
class WorkerPoolKnobs:
    """The worker-pool knobs of ``environment.skyrl_gym`` (process and Ray executors), read and checked once."""

    start_timeout_s: float
    warm: int
    max_rss_mb: float | None


def worker_pool_knobs(skyrl_gym_cfg: SkyRLConfig) -> WorkerPoolKnobs:
    """``env_workers_warm``, ``env_worker_start_timeout_s`` and ``env_worker_max_rss_mb``, checked.

    Raises:
        ValueError: a value out of range (one line naming the knob).
    """
    warm = read_knob(skyrl_gym_cfg, "env_workers_warm", 0)
    if warm is None:
        warm = 0
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        raise invalid_value(
            "environment.skyrl_gym.env_workers_warm", warm, "an int >= 0", "0 starts workers on demand."
        )
    start_timeout_s = read_knob(skyrl_gym_cfg, "env_worker_start_timeout_s", 120.0)
    if start_timeout_s is None:
        start_timeout_s = math.inf
    if isinstance(start_timeout_s, bool) or not isinstance(start_timeout_s, int | float) or start_timeout_s <= 0:
        raise invalid_value(
            "environment.skyrl_gym.env_worker_start_timeout_s", start_timeout_s, "a number > 0", "null: no bound."
        )
    max_rss_mb = read_knob(skyrl_gym_cfg, "env_worker_max_rss_mb", None)
    if max_rss_mb is not None and (
        isinstance(max_rss_mb, bool) or not isinstance(max_rss_mb, int | float) or max_rss_mb <= 0
    ):
        raise invalid_value(
            "environment.skyrl_gym.env_worker_max_rss_mb", max_rss_mb, "a number > 0 or null", "null: never recycle."
        )
    return WorkerPoolKnobs(float(start_timeout_s), warm, max_rss_mb)
