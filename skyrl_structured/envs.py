"""Environments as async context managers: created, used and closed exactly once on every path.

``skyrl_gym`` environments are synchronous. :func:`open_env` wraps one so that ``init``,
``step`` and ``close`` run in the generator's worker threads (at most ``max_env_workers``, see
:mod:`skyrl_structured._env_threads`), or inline when ``max_env_workers`` is 0, as SkyRL does. An
environment that already speaks the async protocol (``__aenter__``/``__aexit__`` and ``async``
``init``/``step``) is used as is; one with async ``init``/``step`` but a plain ``close`` gets that
close run in a worker thread, never on the event loop. Where the env lives is the executor's
(:mod:`skyrl_structured._env_executors`, ``env_executor``): with ``process`` or ``ray`` it is an async
handle to an env in a worker, and the rules for abandoned work are that module's.

Cleanup is shielded from cancellation and bounded in time: if the rollout was cancelled while a
worker thread was still inside ``step``, cleanup first waits for that call so that ``close``
never races it; a cleanup that overruns ``env_cleanup_timeout_s`` is abandoned with a warning,
and the close still runs in its thread once it can. A failing ``close`` (``GeneratorExit``
included) is logged and counted but never replaces the rollout's own result or error.
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from ._env_executors import EnvExecutor
from ._env_threads import EnvCall, EnvThreadPool, _Waker, active_env_thread_calls
from .observe import CleanupOutcome, RolloutEmitter, RolloutObserver
from .types import ConversationType

__all__ = [
    "AsyncEnvironment",
    "CleanupStats",
    "EnvCallRunner",
    "EnvThreadPool",
    "SyncEnvAdapter",
    "active_env_thread_calls",
    "env_config_for",
    "is_async_env",
    "open_env",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@runtime_checkable
class AsyncEnvironment(Protocol):
    """What the agent loop needs from an environment."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any: ...

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]: ...

    async def step(self, action: str) -> Any: ...

    def get_metrics(self) -> Any: ...


@dataclass
class CleanupStats:
    """Cleanup trouble seen during one ``generate()`` call (reported in ``rollout_metrics``)."""

    envs_opened: int = 0
    #: Environments whose close ran to the end (successfully or with an error), not abandoned.
    envs_closed: int = 0
    env_close_errors: int = 0
    env_cleanup_timeouts: int = 0
    finish_session_errors: int = 0
    finish_session_timeouts: int = 0
    #: Env worker processes or actors killed because a call overran its deadline (not threads: they cannot be).
    env_workers_killed: int = 0
    #: Env workers that died on their own (segfault, ``os._exit``, the OOM killer).
    env_worker_crashes: int = 0
    #: Environments whose close could not run because their worker had died.
    envs_lost_with_worker: int = 0


class EnvCallRunner(EnvExecutor):
    """The thread executor: envs in this process, blocking calls inline or in an :class:`EnvThreadPool`."""

    kind = "thread"

    def __init__(self, pool: EnvThreadPool | None) -> None:
        self.pool = pool

    @property
    def bound(self) -> int:
        return 0 if self.pool is None else self.pool.max_workers

    def make_env(self, env_class: str, *, env_config: Any, extras: dict[str, Any], stats: Any) -> Any:
        # Looked up on the module at call time (as SkyRL does), so registering or patching later works.
        return skyrl_gym.make(env_class, env_config=env_config, extras=extras)

    @property
    def inline(self) -> bool:
        return self.pool is None

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


def _trivial_bodies() -> tuple[tuple[bytes, tuple[Any, ...]], ...]:
    """(bytecode, constants after the docstring) of ``def f(self)`` whose body does nothing."""

    def documented(self: Any) -> None:
        """Only a docstring."""

    def bare(self: Any) -> None:
        pass

    return tuple((f.__code__.co_code, f.__code__.co_consts[1:]) for f in (documented, bare))


def _noop_base_closes() -> frozenset[Any]:
    """skyrl_gym's base-class ``close`` functions, kept only if their body is seen to do nothing.

    Checked on the bytecode, not assumed: a skyrl_gym whose base ``close`` does some work drops
    out of the set, and its environments' closes go to a worker thread like any other.
    """
    trivial = _trivial_bodies()
    found = set()
    for cls in (skyrl_gym.Env, BaseTextEnv):
        close = cls.__dict__.get("close")
        code = getattr(close, "__code__", None)
        if code is not None and not code.co_names and (code.co_code, code.co_consts[1:]) in trivial:
            found.add(close)
    return frozenset(found)


_NOOP_BASE_CLOSES = _noop_base_closes()
_OBJECT_GETATTRIBUTE: Any = object.__getattribute__


def has_noop_close(env: Any) -> bool:
    """True when ``env.close`` is exactly skyrl_gym's inherited do-nothing ``close``.

    Looked up as Python would: an instance attribute, or a ``close`` defined by any class of the
    MRO before the base one (a user override, even one that only calls ``super().close()``), or a
    custom ``__getattribute__`` makes it False. Such a close cannot block, so it need not go to a
    worker thread.
    """
    if "close" in getattr(env, "__dict__", ()):
        return False
    cls: Any = type(env)
    # Attribute lookup on the class walks the MRO as an instance's lookup would, in C.
    return cls.__getattribute__ is _OBJECT_GETATTRIBUTE and getattr(cls, "close", None) in _NOOP_BASE_CLOSES


class SyncEnvAdapter:
    """A synchronous ``skyrl_gym`` environment behind the async protocol."""

    def __init__(self, env: Any, runner: EnvCallRunner) -> None:
        self.env = env
        self._runner = runner
        self._in_flight: EnvCall[Any] | None = None
        #: The event loop's waker, looked up by the first thread call and reused by the next ones.
        self._waker: _Waker | None = None
        #: A close handed to a thread that cleanup stopped waiting for; it still runs.
        self.abandoned_close: EnvCall[None] | None = None

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
        close: EnvCall[None] = EnvCall(self._close, skippable=False, waker=self._waker)
        if call is not None and not call.skip() and not call.done:
            # The rollout was cancelled while a worker thread was inside init/step: let that call
            # finish before closing, so close never runs concurrently with it.
            try:
                await self.settle(call)
            except BaseException:
                # env_cleanup_timeout_s ran out first: close it in that thread once the call returns.
                call.then(close, pool)
                self.abandoned_close = close
                raise
        pool.submit(close)
        try:
            await close.wait()
        except BaseException:
            self.abandoned_close = close
            raise
        close.result()

    async def settle(self, call: EnvCall[Any]) -> None:
        """Wait for a call still running in its thread (cleanup's bound applies)."""
        await call.wait()

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

    async def step(self, action: str) -> Any:
        return await self._call(self.env.step, action)

    def get_metrics(self) -> Any:
        return self.env.get_metrics()

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
        self.abandoned_close: EnvCall[Any] | None = None

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
            close: EnvCall[Any] = EnvCall(closer, skippable=False)
            self._runner.pool.submit(close)
            try:
                await close.wait()
            except BaseException:
                self.abandoned_close = close
                raise
            result = close.result()
        if inspect.isawaitable(result):
            await result

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        result: tuple[ConversationType, dict[str, Any]] = await self.env.init(prompt)
        return result

    async def step(self, action: str) -> Any:
        return await self.env.step(action)

    def get_metrics(self) -> Any:
        return self.env.get_metrics()


def env_config_for(skyrl_gym_cfg: Any, env_class: str) -> Any:
    """An environment's configuration: an attribute of the gym config, or ``env_configs[env_class]``."""
    found = getattr(skyrl_gym_cfg, env_class, None)
    if found is not None:
        return found
    return (getattr(skyrl_gym_cfg, "env_configs", None) or {}).get(env_class, {})


def is_async_env(env: Any) -> bool:
    """True when ``env`` already is an async context manager with async ``init`` and ``step``."""
    return (
        hasattr(env, "__aenter__")
        and hasattr(env, "__aexit__")
        and inspect.iscoroutinefunction(getattr(env, "step", None))
        and inspect.iscoroutinefunction(getattr(env, "init", None))
    )


def _wrap(env: Any, runner: EnvExecutor) -> Any:
    if is_async_env(env):
        return env  # also every env handle of a process or Ray executor
    if not isinstance(runner, EnvCallRunner):  # pragma: no cover - remote executors hand out async handles
        raise TypeError(f"the {runner.kind} env executor returned a synchronous env: {env!r}")
    if inspect.iscoroutinefunction(getattr(env, "step", None)):
        return _AwaitingEnvAdapter(env, runner)
    return SyncEnvAdapter(env, runner)


def _cleanup_failed(
    what: str,
    cleanup_exc: BaseException,
    error: BaseException | None,
    on_outcome: Callable[[CleanupOutcome, BaseException | None], None],
) -> None:
    """Log a failed cleanup, note it on the rollout's own ``error`` (if any) and report it."""
    logger.warning("%s failed with %s: %s", what, type(cleanup_exc).__name__, cleanup_exc)
    if error is not None and error is not cleanup_exc:
        error.add_note(f"while cleaning up, {what} also failed: {type(cleanup_exc).__name__}: {cleanup_exc}")
    on_outcome("error", cleanup_exc)


class Cleanup(abc.ABC):
    """One step of :func:`run_cleanups`: awaited shielded and bounded, then told how it ended."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        #: Set when :func:`run_cleanups` starts the step: a step runs at most once.
        self.started = False

    @abc.abstractmethod
    def describe(self) -> str:
        """What the step does, for log lines (``closing environment 'x'``)."""

    @abc.abstractmethod
    def run(self) -> Awaitable[Any]:
        """The cleanup itself."""

    @abc.abstractmethod
    def outcome(self, outcome: CleanupOutcome, error: BaseException | None) -> None:
        """Hears once how the step ended (count it, tell the observers)."""


async def run_cleanups(cleanups: Sequence[Cleanup], *, limit_s: float, error: BaseException | None) -> None:
    """Run each step in order, shielded from cancellation and each bounded by ``limit_s`` seconds.

    Each step's ``outcome`` hears once how it ended: ``"ok"``; ``"error"`` with the exception
    (``GeneratorExit`` included), which is logged and noted on ``error``, the exception the rollout
    is already raising, if any; or ``"timeout"``: the step overran and was abandoned. None of them
    stops the next step or replaces the rollout's own outcome. An interrupt (``KeyboardInterrupt``,
    ``SystemExit``) is reported as an error and then propagates.

    The steps share one shielded scope (an environment's close and its session's end cost one
    scope, not two), its deadline set afresh as each step starts; a step that overruns is cancelled
    by it, and the steps after it get a new scope. No shortcut beyond that: arming the deadline only
    once a step suspends, and closing an inline env outside any scope, were measured in one run
    (``benchmarks/cleanup_shortcuts.py`` at commit f727660: 1,024 rollouts cancelled, 5 interleaved
    repeats) to save nothing: 101 ms of CPU with both, 90 ms without, ranges overlapping (60-119 and
    74-148 ms), env calls inline; 93 and 84 ms with 32 threads. So they went (issue 21).
    """
    index = 0
    while index < len(cleanups):
        step: Cleanup | None = None
        with anyio.CancelScope(shield=True) as scope:
            while index < len(cleanups) and not scope.cancel_called:
                step = cleanups[index]
                index += 1
                step.started = True
                scope.deadline = anyio.current_time() + limit_s
                try:
                    await step.run()
                except (Exception, GeneratorExit) as cleanup_exc:
                    _cleanup_failed(step.describe(), cleanup_exc, error, step.outcome)
                    continue
                except (KeyboardInterrupt, SystemExit) as interrupt:
                    _cleanup_failed(step.describe(), interrupt, error, step.outcome)
                    raise
                step.outcome("ok", None)
        if scope.cancelled_caught and step is not None:
            logger.warning("%s did not finish within env_cleanup_timeout_s=%gs; abandoned it", step.describe(), limit_s)
            step.outcome("timeout", None)


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
        raw: Any,
        runner: EnvExecutor,
        cleanup_timeout: float,
        stats: CleanupStats,
        abandoned: list[EnvCall[Any]] | None,
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

    async def __aenter__(self) -> Any:
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


def open_env(
    env_class: str,
    *,
    env_config: Any,
    extras: dict[str, Any],
    runner: EnvExecutor,
    cleanup_timeout: float,
    stats: CleanupStats,
    abandoned: list[EnvCall[Any]] | None = None,
    observe: EnvObserver | None = None,
    _then: Cleanup | None = None,
) -> AbstractAsyncContextManager[Any]:
    """Create an environment with ``skyrl_gym.make`` and close it exactly once on exit.

    ``skyrl_gym.make`` is looked up on the module at call time (as SkyRL does), so registering or
    patching environments after import works. A close that overruns ``cleanup_timeout`` still runs
    in its worker thread; it is appended to ``abandoned`` so the caller can keep the environment
    counted as live until it returns. ``observe`` hears ``env_opened`` and ``cleanup_started``/``cleanup_finished``.
    (``_then`` is the generator's: its session's end, run right after the close in the same
    shielded scope; should the close raise an interrupt, it is left unstarted for the caller.)
    """
    raw = runner.make_env(env_class, env_config=env_config, extras=extras, stats=stats)
    stats.envs_opened += 1
    if observe is not None:
        observe(RolloutObserver.env_opened)
    return _OpenEnv(env_class, raw, runner, cleanup_timeout, stats, abandoned, observe, _then)
