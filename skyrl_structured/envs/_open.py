"""``open_env``: an environment created with ``skyrl_gym.make`` and closed exactly once on exit."""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

from .._runtime.cleanup import AbandonedClose, Cleanup, CleanupStats, run_cleanups
from .._runtime.pauses import PausableDeadline
from ..observe import CleanupOutcome, RolloutEmitter, RolloutObserver
from ..types import EnvHandle, SkyRLConfig
from ._adapters import _wrap
from ._executors import EnvExecutor

#: Tells the rollout's observers ``env_opened``, ``cleanup_started`` and ``cleanup_finished``.
EnvObserver = RolloutEmitter


class _OpenEnv(Cleanup):
    """The context manager :func:`open_env` returns (a class, so any exception passes through it).

    It is also the cleanup step that closes the environment, so that closing costs no objects
    beyond itself.
    """

    __slots__ = ("_abandoned", "_cleanup_timeout", "_env", "_env_class", "_exit", "_observe", "_stats", "_then")

    def __init__(
        self,
        env_class: str,
        raw: object,
        runner: EnvExecutor,
        cleanup_timeout: float,
        stats: CleanupStats,
        abandoned: list[AbandonedClose] | None,
        observe: EnvObserver | None,
        then: Cleanup | None,
    ) -> None:
        super().__init__()
        self._env_class = env_class
        self._env = _wrap(raw, runner)
        self._cleanup_timeout = cleanup_timeout
        self._stats = stats
        self._abandoned = abandoned
        self._observe = observe
        self._then = then
        self._exit: tuple[type[BaseException] | None, BaseException | None, TracebackType | None] = (None, None, None)

    async def __aenter__(self) -> EnvHandle:
        try:
            return await self._env.__aenter__()
        except BaseException:
            # An async env whose own __aenter__ failed cleans up after itself (the protocol's rule).
            self._stats.envs_closed += 1
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._observe is not None:
            self._observe(RolloutObserver.cleanup_started, "env_close")
        self._exit = (exc_type, exc, tb)
        steps: list[Cleanup] = [self] if self._then is None else [self, self._then]
        try:
            await run_cleanups(steps, limit_s=self._cleanup_timeout, error=exc)
        finally:
            self._exit = (None, None, None)  # no reference cycle through the traceback

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
            if late is not None and self._abandoned is not None:
                self._abandoned.append(late)
        if self._observe is not None:
            self._observe(RolloutObserver.cleanup_finished, "env_close", outcome, error)


def env_config_for(skyrl_gym_cfg: SkyRLConfig, env_class: str) -> SkyRLConfig:
    """An environment's configuration: an attribute of the gym config, or ``env_configs[env_class]``."""
    found = getattr(skyrl_gym_cfg, env_class, None)
    if found is not None:
        return found
    return (getattr(skyrl_gym_cfg, "env_configs", None) or {}).get(env_class, {})


def open_env(
    env_class: str,
    *,
    env_config: SkyRLConfig,
    extras: dict[str, Any],
    runner: EnvExecutor,
    cleanup_timeout: float,
    stats: CleanupStats,
    deadline: PausableDeadline | None = None,
    abandoned: list[AbandonedClose] | None = None,
    observe: EnvObserver | None = None,
    _then: Cleanup | None = None,
) -> AbstractAsyncContextManager[EnvHandle]:
    """Create an environment with ``skyrl_gym.make`` and close it exactly once on exit.

    ``skyrl_gym.make`` is looked up on the module at call time (as SkyRL does), so registering or
    patching environments after import works. A close that overruns ``cleanup_timeout`` still runs
    in its worker thread; it is appended to ``abandoned`` so the caller can keep the environment
    counted as live until it returns. ``deadline`` is the rollout's own ``rollout_timeout_s`` (the
    supervisor's; None without one): an env worker process or actor is killed when a call overruns
    it, never for another scope's deadline or cancel (those get an ordinary close). ``observe``
    hears ``env_opened`` and ``cleanup_started``/``cleanup_finished``.
    (``_then`` is the generator's: its session's end, run right after the close in the same
    shielded scope; should the close raise an interrupt, it is left unstarted for the caller.)
    """
    raw = runner.make_env(env_class, env_config=env_config, extras=extras, stats=stats, deadline=deadline)
    stats.envs_opened += 1
    if observe is not None:
        observe(RolloutObserver.env_opened)
    return _OpenEnv(env_class, raw, runner, cleanup_timeout, stats, abandoned, observe, _then)
