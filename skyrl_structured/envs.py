"""Environments as async context managers: created, used and closed exactly once on every path.

``skyrl_gym`` environments are synchronous. :func:`open_env` wraps one so that ``init``,
``step`` and ``close`` run in worker threads through one shared :class:`anyio.CapacityLimiter`
(or inline, when ``max_env_workers`` is 0, as SkyRL does). An environment that already speaks
the async protocol (``__aenter__``/``__aexit__`` and ``async`` ``init``/``step``) is used as is.

Cleanup is shielded from cancellation and bounded in time: if the rollout was cancelled while a
worker thread was still inside ``step``, cleanup first waits for that call so that ``close``
never races it; a cleanup that overruns ``env_cleanup_timeout_s`` is abandoned with a warning.
A failing ``close`` is logged and counted but never replaces the rollout's own result or error.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.from_thread
import anyio.to_thread
import skyrl_gym

from .types import ConversationType

__all__ = [
    "AsyncEnvironment",
    "CleanupStats",
    "EnvCallRunner",
    "SyncEnvAdapter",
    "active_env_thread_calls",
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


_thread_calls_lock = threading.Lock()
_thread_calls = 0


def active_env_thread_calls() -> int:
    """Environment calls still running in worker threads (abandoned ones included)."""
    return _thread_calls


def _enter_thread_call() -> None:
    global _thread_calls
    with _thread_calls_lock:
        _thread_calls += 1


def _leave_thread_call() -> None:
    global _thread_calls
    with _thread_calls_lock:
        _thread_calls -= 1


class EnvCallRunner:
    """Runs blocking environment calls inline or in worker threads under one limiter."""

    def __init__(self, limiter: anyio.CapacityLimiter | None) -> None:
        self.limiter = limiter

    @property
    def inline(self) -> bool:
        return self.limiter is None


class _ThreadCall:
    """One environment call handed to a worker thread: pending, running, then finished.

    Cleanup calls :meth:`settle`: a call still pending (queued for the limiter or a thread) is
    marked so it never starts; a running one is waited for; a finished one needs nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "pending"
        self._waiter: anyio.Event | None = None
        self._after: Callable[[], None] | None = None

    def start(self) -> bool:
        """In the worker thread: claim the call; False if cleanup already cancelled it."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "running"
            return True

    def finish(self) -> Callable[[], None] | None:
        """In the worker thread, once the call has returned or raised; returns a deferred close, if any."""
        with self._lock:
            self._state = "finished"
            waiter = self._waiter
            after = self._after
        if waiter is not None:
            with suppress(Exception):
                anyio.from_thread.run_sync(waiter.set)
        return after

    def close_when_finished(self, close: Callable[[], None]) -> None:
        """Cleanup gave up waiting for this call: close the environment as soon as the call returns.

        The close then runs in the call's own worker thread, still never concurrently with it.
        """
        with self._lock:
            if self._state == "running":
                self._after = close
                return

        def run() -> None:
            _enter_thread_call()
            try:
                close()
            finally:
                _leave_thread_call()

        threading.Thread(target=run, name="skyrl-structured-late-close", daemon=True).start()

    async def settle(self) -> None:
        with self._lock:
            if self._state == "pending":
                self._state = "skipped"
                return
            if self._state != "running":
                return
            self._waiter = waiter = anyio.Event()
        await waiter.wait()


class SyncEnvAdapter:
    """A synchronous ``skyrl_gym`` environment behind the async protocol."""

    def __init__(self, env: Any, runner: EnvCallRunner) -> None:
        self.env = env
        self._runner = runner
        self._in_flight: _ThreadCall | None = None

    async def __aenter__(self) -> SyncEnvAdapter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        call = self._in_flight
        if call is not None:
            # The rollout was cancelled while a worker thread was inside init/step: let that call
            # finish before closing, so close never runs concurrently with it.
            try:
                await call.settle()
            except anyio.get_cancelled_exc_class():
                # env_cleanup_timeout_s ran out first: close it once the stuck call returns instead.
                call.close_when_finished(self._close_late)
                raise
        await self._call(self.env.close)

    def _close_late(self) -> None:
        try:
            self.env.close()
        except Exception as exc:
            logger.warning("closing an environment after its abandoned call returned failed: %r", exc)
        else:
            logger.warning("closed an environment after its abandoned call finally returned")

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
        call = _ThreadCall()

        def work() -> T | None:
            if not call.start():
                return None  # cancelled before it began; its result is never read
            _enter_thread_call()
            try:
                return fn(*args)
            finally:
                try:
                    deferred_close = call.finish()
                    if deferred_close is not None:
                        deferred_close()
                finally:
                    _leave_thread_call()

        self._in_flight = call
        result = await anyio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=self._runner.limiter)
        self._in_flight = None
        return result  # type: ignore[return-value]  # None only when cancelled, never returned


class _AwaitingEnvAdapter:
    """An environment with async ``init``/``step`` but no async context manager of its own."""

    def __init__(self, env: Any) -> None:
        self.env = env

    async def __aenter__(self) -> _AwaitingEnvAdapter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        closer = getattr(self.env, "aclose", None) or getattr(self.env, "close", None)
        if closer is not None:
            result = closer()
            if inspect.isawaitable(result):
                await result

    async def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        result: tuple[ConversationType, dict[str, Any]] = await self.env.init(prompt)
        return result

    async def step(self, action: str) -> Any:
        return await self.env.step(action)

    def get_metrics(self) -> Any:
        return self.env.get_metrics()


def is_async_env(env: Any) -> bool:
    """True when ``env`` already is an async context manager with async ``init`` and ``step``."""
    return (
        hasattr(env, "__aenter__")
        and hasattr(env, "__aexit__")
        and inspect.iscoroutinefunction(getattr(env, "step", None))
        and inspect.iscoroutinefunction(getattr(env, "init", None))
    )


def _wrap(env: Any, runner: EnvCallRunner) -> Any:
    if is_async_env(env):
        return env
    if inspect.iscoroutinefunction(getattr(env, "step", None)):
        return _AwaitingEnvAdapter(env)
    return SyncEnvAdapter(env, runner)


async def shielded_cleanup(
    what: str,
    cleanup: Callable[[], Any],
    *,
    limit_s: float,
    error: BaseException | None,
    on_error: Callable[[], None],
    on_timeout: Callable[[], None],
) -> None:
    """Run ``cleanup()`` shielded from cancellation and bounded by ``timeout`` seconds.

    A failure is logged and reported through ``on_error`` (and noted on ``error``, the exception
    the rollout is already raising, if any); an overrun is abandoned, logged and reported through
    ``on_timeout``. Neither replaces the rollout's own outcome.
    """
    # One scope does both jobs: shielded from outside cancellation, cancelled by its own deadline.
    with anyio.CancelScope(shield=True, deadline=anyio.current_time() + limit_s) as scope:
        try:
            await cleanup()
        except Exception as cleanup_exc:
            on_error()
            logger.warning("%s failed with %s: %s", what, type(cleanup_exc).__name__, cleanup_exc)
            if error is not None:
                error.add_note(f"while cleaning up, {what} also failed: {type(cleanup_exc).__name__}: {cleanup_exc}")
    if scope.cancelled_caught:
        on_timeout()
        logger.warning("%s did not finish within env_cleanup_timeout_s=%gs; abandoned it", what, limit_s)


@asynccontextmanager
async def open_env(
    env_class: str,
    *,
    env_config: Any,
    extras: dict[str, Any],
    runner: EnvCallRunner,
    cleanup_timeout: float,
    stats: CleanupStats,
) -> AsyncIterator[Any]:
    """Create an environment with ``skyrl_gym.make`` and close it exactly once on exit.

    ``skyrl_gym.make`` is looked up on the module at call time (as SkyRL does), so registering or
    patching environments after import works.
    """
    raw = skyrl_gym.make(env_class, env_config=env_config, extras=extras)
    stats.envs_opened += 1
    env = _wrap(raw, runner)
    try:
        entered = await env.__aenter__()
    except BaseException:
        # An async env whose own __aenter__ failed cleans up after itself (the protocol's rule).
        stats.envs_closed += 1
        raise

    def count_error() -> None:
        stats.env_close_errors += 1
        stats.envs_closed += 1

    def count_timeout() -> None:
        stats.env_cleanup_timeouts += 1

    async def close(exc: BaseException | None) -> None:
        if exc is None:
            await env.__aexit__(None, None, None)
        else:
            await env.__aexit__(type(exc), exc, exc.__traceback__)
        stats.envs_closed += 1

    try:
        yield entered
    except BaseException as exc:
        error = exc
        await shielded_cleanup(
            f"closing environment {env_class!r}",
            lambda: close(error),
            limit_s=cleanup_timeout,
            error=error,
            on_error=count_error,
            on_timeout=count_timeout,
        )
        raise
    await shielded_cleanup(
        f"closing environment {env_class!r}",
        lambda: close(None),
        limit_s=cleanup_timeout,
        error=None,
        on_error=count_error,
        on_timeout=count_timeout,
    )
