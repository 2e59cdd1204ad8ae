"""``open_env``: an environment created with ``skyrl_gym.make`` and closed exactly once on exit."""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .._runtime.cleanup import Cleanup, CleanupStats, run_cleanups
from .._runtime.contexts import RolloutContext
from .._runtime.parking import RolloutParked
from ..observe import CleanupOutcome, RolloutObserver
from ..types import EnvHandle, SkyRLConfig
from ._adapters import SyncEnvAdapter, _wrap
from ._executors import EnvExecutor


@dataclass(frozen=True)
class EnvSettings:
    """How a generator opens and closes its environments: what :func:`open_env` takes from it.

    Built once per generator (again only when a changed ``max_env_workers`` gave it a new thread pool).
    """

    #: Where env calls run: the generator's worker threads, inline, worker processes or Ray actors.
    runner: EnvExecutor
    #: ``generator.env_cleanup_timeout_s``: the bound of each environment's close.
    cleanup_timeout_s: float
    #: SkyRL's ``environment.skyrl_gym`` config, where each env class's ``env_config`` is found
    #: (:func:`env_config_for`); None gives every env class an empty one.
    skyrl_gym_cfg: SkyRLConfig = None


class _OpenEnv(Cleanup):
    """The context manager :func:`open_env` returns (a class, so any exception passes through it).

    It is also the cleanup step that closes the environment, so that closing costs no objects
    beyond itself.
    """

    __slots__ = ("_cleanup_timeout", "_entered", "_env", "_env_class", "_exit", "_rollout", "_stats", "_then")

    def __init__(
        self,
        env_class: str,
        raw: object,
        settings: EnvSettings,
        stats: CleanupStats,
        rollout: RolloutContext | None,
        then: Cleanup | None,
    ) -> None:
        super().__init__()
        self._env_class = env_class
        self._env = _wrap(raw, settings.runner)
        self._cleanup_timeout = settings.cleanup_timeout_s
        self._stats = stats
        self._rollout = rollout
        self._then = then
        self._exit: tuple[type[BaseException] | None, BaseException | None, TracebackType | None] = (None, None, None)
        #: The handle once entered: a parked environment is entered once and adopted after (``adopt``).
        self._entered: EnvHandle | None = None

    async def __aenter__(self) -> EnvHandle:
        if self._entered is not None:  # adopted: already open
            return self._entered
        # Opened once its constructor has returned: for an env in a worker process or a Ray actor
        # that is here (the worker builds it), for an env with its own __aenter__ once that returned.
        # A start that fails (an env the executor cannot send, a constructor or __aenter__ that
        # raised) is a failed start: nothing was opened, so nothing is left to close (an async env
        # whose own __aenter__ failed cleans up after itself, the protocol's rule).
        handle = await self._env.__aenter__()
        self._entered = handle
        self._stats.envs_opened += 1
        if self._rollout is not None:
            self._rollout.emit(RolloutObserver.env_opened)
        return handle

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, RolloutParked):
            # Parked (generator.carry_over_cut_rollouts): handed over open, closed by whoever adopts it.
            exc.env = self
            return
        if self._rollout is not None:
            self._rollout.emit(RolloutObserver.cleanup_started, "env_close")
        self._exit = (exc_type, exc, tb)
        steps: list[Cleanup] = [self] if self._then is None else [self, self._then]
        try:
            await run_cleanups(steps, limit_s=self._cleanup_timeout, error=exc)
        finally:
            self._exit = (None, None, None)  # no reference cycle through the traceback

    # ------------------------------------------------------------------ parked (carry-over)

    def adopt(self, stats: CleanupStats, rollout: RolloutContext | None, then: Cleanup | None) -> _OpenEnv:
        """This open environment for a new owner: its exit closes it (counted in ``stats``), then runs ``then``."""
        self._stats = stats
        self._rollout = rollout
        self._then = then
        self.started = False
        rebind = getattr(self._env, "rebind", None)  # an env in a worker: its kill deadline and counters
        if rebind is not None:
            rebind(stats, rollout.deadline if rollout is not None else None)
        return self

    def close_without_loop(self) -> bool:
        """Close a synchronous env class from synchronous code (interpreter exit); False for any other."""
        if not isinstance(self._env, SyncEnvAdapter):
            return False
        self._env.env.close()
        return True

    # ------------------------------------------------------------------ as a cleanup step

    def describe(self) -> str:
        return f"closing environment {self._env_class!r}"

    def run(self) -> Awaitable[Any]:
        closing: Awaitable[Any] = self._env.__aexit__(*self._exit)
        return closing

    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        stats = self._stats
        if outcome == "error":
            stats.env_close_errors += 1
        if outcome != "timeout":
            stats.envs_closed += 1
        else:
            stats.env_cleanup_timeouts += 1
            late = getattr(self._env, "abandoned_close", None)
            if late is not None and self._rollout is not None:
                self._rollout.abandoned.append(late)
        if self._rollout is not None:
            self._rollout.emit(RolloutObserver.cleanup_finished, "env_close", outcome, error)


def env_config_for(skyrl_gym_cfg: SkyRLConfig, env_class: str) -> SkyRLConfig:
    """An environment's configuration: an attribute of the gym config, or ``env_configs[env_class]``."""
    found = getattr(skyrl_gym_cfg, env_class, None)
    if found is not None:
        return found
    return (getattr(skyrl_gym_cfg, "env_configs", None) or {}).get(env_class, {})


def open_env(
    env_class: str,
    settings: EnvSettings,
    *,
    extras: dict[str, Any],
    stats: CleanupStats,
    rollout: RolloutContext | None = None,
    then: Cleanup | None = None,
) -> AbstractAsyncContextManager[EnvHandle]:
    """Create an environment with ``skyrl_gym.make`` and close it exactly once on exit.

    ``skyrl_gym.make`` is looked up on the module at call time (as SkyRL does), so registering or
    patching environments after import works; the env's ``env_config`` is ``settings``' for its
    class. ``stats`` counts the opens, closes and cleanup timeouts.

    The env counts as opened (``stats.envs_opened``, the observers' ``env_opened``) once it is
    entered: its constructor returned, in this process or in its worker, and its own
    ``__aenter__`` if it has one. A start that fails is counted by neither side, so opened minus
    closed is what was left open.

    ``rollout`` is the attempt the env is opened for (the generator's; None outside a rollout):
    its observers hear ``env_opened`` and ``cleanup_started``/``cleanup_finished``; a close that
    overruns ``settings.cleanup_timeout_s`` still runs in its worker thread and is appended to its
    ``abandoned``, so the rollout's slot stays taken until it returns; its ``deadline`` (its own
    ``rollout_timeout_s``) is the one for which an env worker process or actor is killed when a call
    overruns it, never another scope's deadline or cancel (those get an ordinary close).
    ``then`` is run right after the close in the same shielded scope (the generator's session end);
    should the close raise an interrupt, it is left unstarted for the caller.
    """
    raw = settings.runner.make_env(
        env_class,
        env_config=env_config_for(settings.skyrl_gym_cfg, env_class),
        extras=extras,
        stats=stats,
        deadline=rollout.deadline if rollout is not None else None,
    )
    return _OpenEnv(env_class, raw, settings, stats, rollout, then)
