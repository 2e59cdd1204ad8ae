"""Wrapper environments: a registered ``skyrl_gym`` id that builds another env and instruments it.

The chaos wrappers, the leak tracker and the concurrency check all need to watch (and sometimes
interfere with) an environment's life without touching the user's environment class. Each of them
registers a wrapper id whose factory creates the inner environment with ``skyrl_gym.make`` and
returns a wrapper that reports every stage to :class:`EnvHook` objects and :class:`EnvLedger`
entries. The generator sees the wrapper like any other environment: a synchronous one for a
synchronous inner env (so it runs in worker threads exactly as the inner env would), an async one
for an inner env that speaks the async protocol.

Hooks run at two points of each stage: ``before`` the inner call and ``after`` it returned
(``create`` has only ``before``: once the inner env exists, the wrapper must reach the generator
or nothing could close it). A hook that raises makes the stage raise.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv
from skyrl_gym.metrics import default_aggregate_metrics

from ..envs import is_async_env
from ..envs._registration import REGISTRY_LOCK
from .envs import EnvLedger, next_env_key

__all__ = ["ENV_STAGES", "TAG_KEY", "EnvHook", "register_wrapper_env", "unregister_wrapper_env"]

#: Environment stages a hook sees, in the order a rollout goes through them.
ENV_STAGES = ("create", "init", "step", "close")

#: An ``env_extras`` key read (and removed before the inner env sees it) by wrapper envs: the value
#: is handed to hooks as ``tag``, so a hook can tell which rollout an environment belongs to.
TAG_KEY = "_skyrl_structured_testing_tag"


class EnvHook(Protocol):
    """Called around each stage of a wrapped environment; ``tag`` is the rollout's ``TAG_KEY`` extra."""

    def before(self, stage: str, tag: Any) -> None:
        """Before a synchronous stage (``create``, and ``init``/``step``/``close`` of a sync env)."""

    def after(self, stage: str, tag: Any) -> None:
        """After a synchronous stage returned (not called for ``create``)."""

    async def abefore(self, stage: str, tag: Any) -> None:
        """Before an async stage (``init``/``step``/``close`` of an async env)."""

    async def aafter(self, stage: str, tag: Any) -> None:
        """After an async stage returned."""


class _Instrumentation:
    """What a wrapper reports to: its hooks, its ledgers and its ledger key."""

    def __init__(self, hooks: Sequence[EnvHook], ledgers: Sequence[EnvLedger], tag: Any) -> None:
        self.hooks = tuple(hooks)
        self.ledgers = tuple(ledgers)
        self.tag = tag
        self.key = next_env_key()
        for ledger in self.ledgers:
            ledger.add(self.key)

    def enter(self, stage: str) -> None:
        for ledger in self.ledgers:
            ledger.enter(self.key, stage)

    def leave(self) -> None:
        for ledger in self.ledgers:
            ledger.leave(self.key)

    def call(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.enter(stage)
        try:
            for hook in self.hooks:
                hook.before(stage, self.tag)
            result = fn(*args)
            for hook in self.hooks:
                hook.after(stage, self.tag)
            return result
        finally:
            self.leave()

    async def acall(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.enter(stage)
        try:
            for hook in self.hooks:
                await hook.abefore(stage, self.tag)
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
            for hook in self.hooks:
                await hook.aafter(stage, self.tag)
            return result
        finally:
            self.leave()


class _SyncWrapper(BaseTextEnv):  # type: ignore[misc]
    """Wraps a synchronous environment; the generator drives it like the inner env."""

    def __init__(self, inner: Any, instrumentation: _Instrumentation) -> None:
        super().__init__()
        self.inner = inner
        self._inst = instrumentation

    def init(self, prompt: Any) -> Any:
        return self._inst.call("init", self.inner.init, prompt)

    def step(self, action: str) -> Any:
        return self._inst.call("step", self.inner.step, action)

    def close(self) -> None:
        self._inst.call("close", self.inner.close)

    def get_metrics(self) -> Any:
        return self.inner.get_metrics()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: expose the inner env's own attributes.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _AsyncWrapper(skyrl_gym.Env):  # type: ignore[misc]
    """Wraps an environment with async ``init``/``step`` (with or without its own context manager)."""

    def __init__(self, inner: Any, instrumentation: _Instrumentation) -> None:
        super().__init__()
        self.inner = inner
        self._target = inner
        self._inst = instrumentation

    async def __aenter__(self) -> _AsyncWrapper:
        enter = getattr(self.inner, "__aenter__", None)
        if enter is not None:
            try:
                self._target = await enter()
            except BaseException:
                # An async env whose own __aenter__ failed cleaned up after itself (the protocol's
                # rule), and nobody will call its __aexit__: record that as its one close.
                self._inst.enter("close")
                self._inst.leave()
                raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._inst.acall("close", self._close_inner, exc_type, exc, tb)

    async def _close_inner(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        exit_ = getattr(self.inner, "__aexit__", None)
        if exit_ is not None:
            await exit_(exc_type, exc, tb)
            return
        closer = getattr(self.inner, "aclose", None) or getattr(self.inner, "close", None)
        if closer is not None:
            result = closer()
            if inspect.isawaitable(result):
                await result

    async def init(self, prompt: Any) -> Any:
        return await self._inst.acall("init", self._target.init, prompt)

    async def step(self, action: str) -> Any:
        return await self._inst.acall("step", self._target.step, action)

    def get_metrics(self) -> Any:
        getter = getattr(self._target, "get_metrics", None)
        return getter() if getter is not None else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "_target"):
            raise AttributeError(name)
        return getattr(self._target, name)


def _inner_creator(env_class: str) -> Any:
    spec = skyrl_gym.registry[env_class]
    entry = spec.entry_point
    if callable(entry):
        return entry
    from skyrl_gym.envs.registration import load_env_creator

    return load_env_creator(entry)


class _WrapperFactory:
    """The registered entry point: builds the inner env, returns the instrumented wrapper.

    A callable object rather than a function, because ``skyrl_gym`` aggregates metrics by calling
    ``aggregate_metrics`` on the entry point; that is forwarded to the inner env class.
    """

    def __init__(self, inner_env_class: str, hooks: Sequence[EnvHook], ledgers: Sequence[EnvLedger]) -> None:
        self.inner_env_class = inner_env_class
        self.hooks = tuple(hooks)
        self.ledgers = tuple(ledgers)

    def __call__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> Any:
        extras = extras if extras is not None else {}
        tag = extras.get(TAG_KEY)
        if TAG_KEY in extras and not isinstance(_inner_creator(self.inner_env_class), _WrapperFactory):
            # The innermost env never sees the key: an env that validates its extras stays happy.
            extras = {k: v for k, v in extras.items() if k != TAG_KEY}
        for hook in self.hooks:
            hook.before("create", tag)
        inner = skyrl_gym.make(self.inner_env_class, env_config=env_config, extras=extras)
        instrumentation = _Instrumentation(self.hooks, self.ledgers, tag)
        if is_async_env(inner) or inspect.iscoroutinefunction(getattr(inner, "step", None)):
            return _AsyncWrapper(inner, instrumentation)
        return _SyncWrapper(inner, instrumentation)

    def aggregate_metrics(self, metrics: list[dict[str, Any]]) -> dict[str, Any]:
        aggregate = getattr(_inner_creator(self.inner_env_class), "aggregate_metrics", None)
        if aggregate is None:
            aggregate = default_aggregate_metrics
        result: dict[str, Any] = dict(aggregate(metrics))
        return result


_names = itertools.count(1)
_names_lock = threading.Lock()


def register_wrapper_env(
    inner_env_class: str,
    *,
    hooks: Sequence[EnvHook] = (),
    ledgers: Sequence[EnvLedger] = (),
    env_id: str | None = None,
    kind: str = "wrapped",
) -> str:
    """Register a wrapper of ``inner_env_class`` with ``skyrl_gym`` and return its id.

    ``env_id`` defaults to a fresh ``"<inner>+<kind>-<n>"``. Registering an id that already holds a
    wrapper replaces it; an id that holds any other environment is refused.

    Raises:
        ValueError: ``inner_env_class`` is not registered, or ``env_id`` is taken by another env.
    """
    if not isinstance(inner_env_class, str) or inner_env_class not in skyrl_gym.registry:
        raise ValueError(
            f"`inner_env_class` {inner_env_class!r} is not a registered skyrl_gym environment; register "
            "it first with skyrl_gym.register(id=..., entry_point=YourEnvClass)"
        )
    if env_id is None:
        with _names_lock:
            env_id = f"{inner_env_class}+{kind}-{next(_names)}"
    factory = _WrapperFactory(inner_env_class, hooks, ledgers)
    # The check's cases register and unregister wrappers from several threads at once.
    with REGISTRY_LOCK:
        existing = skyrl_gym.registry.get(env_id)
        if existing is not None:
            if not isinstance(existing.entry_point, _WrapperFactory):
                raise ValueError(
                    f"`env_id` {env_id!r} is already registered for another environment; choose another id "
                    "or leave env_id=None for a fresh one"
                )
            del skyrl_gym.registry[env_id]
        skyrl_gym.register(id=env_id, entry_point=factory)
    return env_id


def unregister_wrapper_env(env_id: str) -> None:
    """Remove a wrapper id registered by this kit (other ids are left alone)."""
    with REGISTRY_LOCK:
        spec = skyrl_gym.registry.get(env_id)
        if spec is not None and isinstance(spec.entry_point, _WrapperFactory):
            del skyrl_gym.registry[env_id]
