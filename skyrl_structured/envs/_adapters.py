"""Synchronous and half-async environments behind the async protocol, and the thread executor.

:class:`SyncEnvAdapter` runs a ``skyrl_gym`` env's blocking ``init``/``step``/``close`` in the
generator's worker threads (or inline when ``max_env_workers`` is 0); an env with async
``init``/``step`` but a plain ``close`` gets that close run in a worker thread.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeGuard, TypeVar

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from .._runtime.cleanup import CleanupStats
from .._runtime.pauses import PausableDeadline
from .._runtime.wakers import LoopWaker
from ..types import AsyncEnvironment, ConversationType, EnvStepOutput, SkyRLConfig
from ._abandon import ChainClose, close_after_in_flight
from ._executors import EnvExecutor
from ._threads import EnvCall, EnvThreadPool

logger = logging.getLogger(__name__)

T = TypeVar("T")


__all__ = ["AsyncEnvironment", "EnvCallRunner", "SyncEnvAdapter", "has_noop_close", "is_async_env"]


class EnvCallRunner(EnvExecutor):
    """The thread executor: envs in this process, blocking calls inline or in an :class:`EnvThreadPool`."""

    kind = "thread"

    def __init__(self, pool: EnvThreadPool | None) -> None:
        self.pool = pool

    @property
    def bound(self) -> int:
        return 0 if self.pool is None else self.pool.max_workers

    def make_env(
        self,
        env_class: str,
        *,
        env_config: SkyRLConfig,
        extras: dict[str, Any],
        stats: CleanupStats,
        deadline: PausableDeadline | None = None,
    ) -> object:
        # Looked up on the module at call time (as SkyRL does), so registering or patching later works.
        return skyrl_gym.make(env_class, env_config=env_config, extras=extras)

    @property
    def inline(self) -> bool:
        return self.pool is None

    @property
    def workers_alive(self) -> int:
        return 0 if self.pool is None else self.pool.threads

    def resized(self, workers: int) -> EnvCallRunner:
        """The same pool while ``workers`` is its size; else a new pool of ``workers`` threads (0: inline)."""
        return self if workers == self.bound else EnvCallRunner(EnvThreadPool(workers) if workers > 0 else None)

    async def run(self, call: EnvCall[T]) -> T:
        """Run ``call`` in a worker thread and return its result.

        Cancelled while waiting, a call that has not started is skipped; one already running is
        left to finish in its thread (the caller still holds it to wait for or chain a close after).
        """
        assert self.pool is not None
        self.pool.submit(call)
        try:
            await call.wait()
        except BaseException:
            call.skip()
            raise
        return call.result()


def thread_executor(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> EnvCallRunner:
    """``env_executor="thread"``: the row of the executor table (:mod:`~skyrl_structured.envs._kinds`).

    The pool's threads start on first use; ``workers=0`` runs every env call inline.
    """
    return EnvCallRunner(EnvThreadPool(workers) if workers > 0 else None)


#: skyrl_gym's base-class ``close`` functions, which do nothing (tests/test_envs.py checks that
#: against the installed skyrl_gym).
_NOOP_BASE_CLOSES: frozenset[Any] = frozenset({skyrl_gym.Env.close, BaseTextEnv.close})
_OBJECT_GETATTRIBUTE: Any = object.__getattribute__


def has_noop_close(env: object) -> bool:
    """True when ``env.close`` is exactly skyrl_gym's inherited do-nothing ``close``.

    Looked up as Python would: an instance attribute, or a ``close`` defined by any class of the
    MRO before the base one (a user override, even one that only calls ``super().close()``), or a
    custom ``__getattribute__`` makes it False. Such a close cannot block, so :class:`SyncEnvAdapter`
    runs it on the event loop instead of in a worker thread: a shortcut kept because it pays
    (``python -m benchmarks.noop_close``; the figures are in docs/benchmarks.md, "Cleanup shortcuts:
    which pay"), since most skyrl_gym envs inherit this close.
    """
    if "close" in getattr(env, "__dict__", ()):
        return False
    cls: Any = type(env)
    # Attribute lookup on the class walks the MRO as an instance's lookup would, in C.
    return cls.__getattribute__ is _OBJECT_GETATTRIBUTE and getattr(cls, "close", None) in _NOOP_BASE_CLOSES


class SyncEnvAdapter:
    """A synchronous ``skyrl_gym`` environment behind the async protocol."""

    # ``env`` is what ``skyrl_gym.make`` built: skyrl_gym ships no type information, and user envs
    # only duck-type its ``Env``, so it stays ``Any`` (here and in ``_AwaitingEnvAdapter``).
    def __init__(self, env: Any, runner: EnvCallRunner) -> None:
        self.env = env
        self._runner = runner
        self._in_flight: EnvCall[Any] | None = None
        #: The event loop's waker, looked up by the first thread call and reused by the next ones.
        self._waker: LoopWaker | None = None
        self._closing: ChainClose | None = None

    async def __aenter__(self) -> SyncEnvAdapter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pool = self._runner.pool
        if pool is None:
            self.env.close()
            return
        call = self._in_flight
        noop_close = has_noop_close(self.env)
        if noop_close and (call is None or call.skip() or call.done):
            # Nothing runs in a thread and the close does nothing: no thread round-trip for it.
            self.env.close()
            return
        stuck = call if call is not None and not call.skip() and not call.done else None
        # The rollout was cancelled while a worker thread was inside init/step: the close waits for that
        # call (never racing it), or past env_cleanup_timeout_s runs in its thread once it returns.
        self._closing = ChainClose(pool, EnvCall(self._close, skippable=False, waker=self._waker))
        close = await close_after_in_flight(stuck, self._closing)
        assert close is not None
        close.result()

    @property
    def abandoned_close(self) -> EnvCall[Any] | None:
        """A close handed to a thread that cleanup stopped waiting for; it still runs."""
        return None if self._closing is None else self._closing.late

    def _close(self) -> None:
        late = self.abandoned_close is not None
        try:
            self.env.close()
        except Exception as exc:
            if late:
                logger.warning("closing an environment after its cleanup was abandoned failed: %r", exc)
            raise
        if late:
            logger.warning("closed an environment after its cleanup was abandoned (env_cleanup_timeout_s ran out)")

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        result: tuple[ConversationType, dict[str, Any]] = await self._call(self.env.init, prompt)
        return result

    async def step(self, action: str) -> EnvStepOutput:
        result: EnvStepOutput = await self._call(self.env.step, action)
        return result

    def get_metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = self.env.get_metrics()
        return metrics

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._runner.inline:
            return fn(*args)
        call = EnvCall(fn, *args, waker=self._waker)
        self._waker = call.waker
        self._in_flight = call
        result = await self._runner.run(call)
        self._in_flight = None
        return result


class _AwaitingEnvAdapter:
    """An environment with async ``init``/``step`` but no async context manager of its own.

    Its ``close`` (or ``aclose``) is awaited when it is a coroutine function; a plain function is
    blocking work like any sync env call, so it runs in a worker thread, never on the event loop.
    """

    def __init__(self, env: Any, runner: EnvCallRunner) -> None:
        self.env = env
        self._runner = runner
        self._closing: ChainClose | None = None

    @property
    def abandoned_close(self) -> EnvCall[Any] | None:
        """A close handed to a thread that cleanup stopped waiting for; it still runs."""
        return None if self._closing is None else self._closing.late

    async def __aenter__(self) -> _AwaitingEnvAdapter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        closer = getattr(self.env, "aclose", None) or getattr(self.env, "close", None)
        if closer is None:
            return
        if inspect.iscoroutinefunction(closer) or self._runner.pool is None:
            result = closer()
        else:
            self._closing = ChainClose(self._runner.pool, EnvCall(closer, skippable=False))
            close = await close_after_in_flight(None, self._closing)
            assert close is not None
            result = close.result()
        if inspect.isawaitable(result):
            await result

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        result: tuple[ConversationType, dict[str, Any]] = await self.env.init(prompt)
        return result

    async def step(self, action: str) -> EnvStepOutput:
        result: EnvStepOutput = await self.env.step(action)
        return result

    def get_metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = self.env.get_metrics()
        return metrics


def is_async_env(env: object) -> TypeGuard[AsyncEnvironment]:
    """True when ``env`` already is an async context manager with async ``init`` and ``step``."""
    return (
        hasattr(env, "__aenter__")
        and hasattr(env, "__aexit__")
        and inspect.iscoroutinefunction(getattr(env, "step", None))
        and inspect.iscoroutinefunction(getattr(env, "init", None))
    )


def _wrap(env: object, runner: EnvExecutor) -> AsyncEnvironment:
    if is_async_env(env):
        return env  # also every env handle of a process or Ray executor
    if not isinstance(runner, EnvCallRunner):  # pragma: no cover - remote executors hand out async handles
        raise TypeError(f"the {runner.kind} env executor returned a synchronous env: {env!r}")
    if inspect.iscoroutinefunction(getattr(env, "step", None)):
        return _AwaitingEnvAdapter(env, runner)
    return SyncEnvAdapter(env, runner)
