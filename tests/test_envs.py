"""Environments as async context managers: threads or inline, async envs as is, close exactly once."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from skyrl_structured import SkyRLGymConfig, open_env
from skyrl_structured._runtime.cleanup import Cleanup, run_cleanups
from skyrl_structured.envs import CleanupStats, EnvCallRunner, EnvSettings, EnvThreadPool, is_async_env
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger
from tests._hooked_env import hooked_batch

from .helpers import make_batch, make_generator

pytestmark = pytest.mark.anyio

EVENTS: list[Any] = []


class AsyncCtxEnv(BaseTextEnv):
    """Already speaks the async protocol: used as is."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.fail = (extras or {}).get("fail")

    async def __aenter__(self):
        EVENTS.append("enter")
        return self

    async def __aexit__(self, exc_type, exc, tb):
        EVENTS.append(("exit", exc_type))

    async def init(self, prompt):
        return prompt, {}

    async def step(self, action):
        if self.fail:
            raise RuntimeError("async step failed")
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


class AwaitingEnv(BaseTextEnv):
    """Async init/step but no async context manager: closed through its (async) close."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()

    async def init(self, prompt):
        return prompt, {}

    async def step(self, action):
        return {"observations": [], "reward": 0.5, "done": True, "metadata": {}}

    async def close(self):
        EVENTS.append("awaited close")


class ConfigEchoEnv(AwaitingEnv):
    """Keeps the ``env_config`` it was built with."""

    configs: ClassVar[list[Any]] = []

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.configs.append(env_config)


for name, cls in (
    ("tests_async_ctx_env", AsyncCtxEnv),
    ("tests_awaiting_env", AwaitingEnv),
    ("tests_config_echo_env", ConfigEchoEnv),
):
    if name not in skyrl_gym.registry:
        skyrl_gym.register(id=name, entry_point=cls)


async def test_sync_env_calls_run_in_worker_threads_or_inline(anyio_backend):
    loop_thread = threading.get_ident()
    seen: dict[str, int] = {}
    for label, pool in (("threads", EnvThreadPool(2)), ("inline", None)):
        ledger = EnvLedger()
        extras = {"ledger": ledger, "on_step": lambda turn, label=label: seen.__setitem__(label, threading.get_ident())}
        stats = CleanupStats()
        async with open_env(SCRIPTED_ENV, EnvSettings(EnvCallRunner(pool), 5), extras=extras, stats=stats) as env:
            await env.init([{"role": "user", "content": "hi"}])
            out = await env.step("action")
            assert out["done"] is True
        ledger.assert_all_closed_once()
        assert (stats.envs_opened, stats.envs_closed) == (1, 1)
    assert seen["threads"] != loop_thread
    assert seen["inline"] == loop_thread


async def test_each_env_class_gets_its_config_from_the_settings(anyio_backend):
    ConfigEchoEnv.configs.clear()
    gym = SkyRLGymConfig(env_configs={"tests_config_echo_env": {"topk": 2}, "other": {"topk": 9}})
    stats = CleanupStats()
    for settings in (EnvSettings(EnvCallRunner(None), 5, gym), EnvSettings(EnvCallRunner(None), 5)):
        async with open_env("tests_config_echo_env", settings, extras={}, stats=stats):
            pass
    assert ConfigEchoEnv.configs == [{"topk": 2}, {}]
    assert (stats.envs_opened, stats.envs_closed) == (2, 2)


def test_a_generator_builds_its_env_settings_once_and_again_only_for_what_changed(tokenizer):
    gen = make_generator(tokenizer, workers=2)
    first = gen._env_settings()
    assert gen._env_settings() is first
    assert isinstance(first.runner, EnvCallRunner)
    assert (first.runner.bound, first.cleanup_timeout_s, first.skyrl_gym_cfg) == (2, 30.0, gen.skyrl_gym_cfg)
    gen.max_env_workers = 3  # a new thread pool of 3
    resized = gen._env_settings()
    assert isinstance(resized.runner, EnvCallRunner)
    assert resized.runner.bound == 3
    gen.resilience = dataclasses.replace(gen.resilience, env_cleanup_timeout_s=5.0)
    assert gen._env_settings().cleanup_timeout_s == 5.0
    gym = SkyRLGymConfig(max_env_workers=3)
    gen.skyrl_gym_cfg = gym
    assert gen._env_settings().skyrl_gym_cfg is gym
    assert gen._env_settings().runner is resized.runner  # the pool is kept while its size is


async def test_env_closed_exactly_once_when_the_body_raises(anyio_backend):
    ledger = EnvLedger()
    settings = EnvSettings(EnvCallRunner(EnvThreadPool(1)), 5)
    with pytest.raises(ZeroDivisionError):
        async with open_env(SCRIPTED_ENV, settings, extras={"ledger": ledger}, stats=CleanupStats()):
            1 / 0  # noqa: B018
    ledger.assert_all_closed_once()


async def test_async_env_is_used_as_is(tokenizer, anyio_backend):
    from skyrl_structured.testing import ScriptedEngine

    EVENTS.clear()
    async with open_env(
        "tests_async_ctx_env", EnvSettings(EnvCallRunner(None), 5), extras={}, stats=CleanupStats()
    ) as env:
        assert is_async_env(env)
        assert isinstance(env, AsyncCtxEnv)
    assert EVENTS == ["enter", ("exit", None)]

    EVENTS.clear()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, lambda call: "x"), skip_failed_rollouts=True)
    batch = make_batch(2, EnvLedger(), extras={1: {"fail": True}})
    batch["env_classes"] = ["tests_async_ctx_env"] * 2
    out = await gen.generate(batch, disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "rollout_error"]
    assert EVENTS.count("enter") == 2
    assert sorted(str(e) for e in EVENTS if e != "enter") == sorted([str(("exit", None)), str(("exit", RuntimeError))])


async def test_async_env_without_context_manager_is_closed_through_close(tokenizer, anyio_backend):
    from skyrl_structured.testing import ScriptedEngine

    EVENTS.clear()
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, lambda call: "x"))
    batch = make_batch(2, EnvLedger())
    batch["env_classes"] = ["tests_awaiting_env"] * 2
    out = await gen.generate(batch, disable_tqdm=True)
    reward = out["rewards"][0]
    assert isinstance(reward, list)
    assert reward[-1] == 0.5
    assert EVENTS == ["awaited close", "awaited close"]


async def test_a_call_still_queued_for_a_worker_never_starts_after_cancellation(tokenizer, anyio_backend):
    # One worker thread: the first init to get it holds it; the other waits for it. Cancelling must not
    # leave the waiting one stuck, and its init must never run after its env was closed.
    ledger = EnvLedger()
    holding = threading.Event()
    release = threading.Event()
    lock = threading.Lock()
    inits: list[int] = []

    def on_init() -> None:
        with lock:
            first = not holding.is_set()
            holding.set()
        if first:
            release.wait(10)
        else:
            inits.append(1)

    batch = hooked_batch(2, ledger, on_init=on_init)
    gen = make_generator(tokenizer, workers=1, env_cleanup_timeout_s=10)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_soon() -> None:
                await anyio.to_thread.run_sync(holding.wait, 10)
                scope.cancel()
                threading.Timer(0.1, release.set).start()

            tg.start_soon(cancel_soon)
            await gen.generate(batch, disable_tqdm=True)
    assert scope.cancelled_caught
    ledger.assert_all_closed_once()
    assert inits == []


# ---------------------------------------------------------------------- skyrl_gym's no-op close


class NoopCloseEnv(BaseTextEnv):
    """Keeps BaseTextEnv's do-nothing close."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


class OverridingCloseEnv(NoopCloseEnv):
    """Its own close, even one that only defers to the base: blocking work to a worker thread."""

    closes: ClassVar[list[str]] = []

    def close(self):
        OverridingCloseEnv.closes.append(threading.current_thread().name)
        super().close()


class InheritedOverrideEnv(OverridingCloseEnv):
    """Inherits the override."""


class ProxyingEnv(NoopCloseEnv):
    """Resolves its attributes itself: its ``close`` may be anything, so it is not taken as the no-op."""

    def __getattribute__(self, name):
        return super().__getattribute__(name)


class InheritedProxyEnv(ProxyingEnv):
    """Inherits the custom lookup."""


def test_skyrl_gyms_base_closes_do_nothing():
    """The shortcut's premise, checked against the installed skyrl_gym: its base ``close`` bodies
    are empty (only a docstring or ``pass``), so running one on the event loop cannot block."""

    def documented(self):
        """Only a docstring."""

    def bare(self):
        pass

    empty = {(f.__code__.co_code, f.__code__.co_consts[1:]) for f in (documented, bare)}
    for cls in (skyrl_gym.Env, BaseTextEnv):
        code = cls.close.__code__
        assert not code.co_names, f"{cls.__name__}.close calls {code.co_names}: drop it from _NOOP_BASE_CLOSES"
        assert (code.co_code, code.co_consts[1:]) in empty, f"{cls.__name__}.close does work"


def test_only_the_inherited_noop_close_is_recognised():
    from skyrl_structured.envs import has_noop_close

    assert has_noop_close(NoopCloseEnv())
    assert not has_noop_close(OverridingCloseEnv())
    assert not has_noop_close(InheritedOverrideEnv())
    assert not has_noop_close(ProxyingEnv())
    assert not has_noop_close(InheritedProxyEnv())
    patched = NoopCloseEnv()
    patched.close = lambda: None  # an instance attribute shadows the class's close
    assert not has_noop_close(patched)


@pytest.mark.parametrize("env_class", [OverridingCloseEnv, InheritedOverrideEnv])
async def test_an_overridden_close_still_runs_in_a_worker_thread_exactly_once(anyio_backend, env_class):
    for name, cls in (("tests_noop_close_env", NoopCloseEnv), ("tests_override_close_env", env_class)):
        skyrl_gym.registry.pop(name, None)
        skyrl_gym.register(id=name, entry_point=cls)
    OverridingCloseEnv.closes.clear()
    for name in ("tests_noop_close_env", "tests_override_close_env"):
        pool, stats = EnvThreadPool(2), CleanupStats()
        with anyio.CancelScope() as scope:
            async with open_env(name, EnvSettings(EnvCallRunner(pool), 5), extras={}, stats=stats):
                scope.cancel()  # closed on the cancellation path
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert (stats.envs_opened, stats.envs_closed, stats.env_close_errors) == (1, 1, 0)
        # The no-op close is not worth a thread: none was ever started for that environment.
        assert pool.threads == (0 if name == "tests_noop_close_env" else 1), name
    assert len(OverridingCloseEnv.closes) == 1
    assert OverridingCloseEnv.closes[0] != threading.current_thread().name
    assert OverridingCloseEnv.closes[0].startswith("skyrl-structured-env")


class _Step(Cleanup):
    """A cleanup step for run_cleanups that records how it ended."""

    def __init__(self, name: str, body: Any, outcomes: list[tuple[str, str]]) -> None:
        super().__init__()
        self.name, self.body, self.outcomes = name, body, outcomes

    def describe(self) -> str:
        return self.name

    def run(self) -> Any:
        return self.body()

    def outcome(self, outcome: Any, error: BaseException | None) -> None:
        self.outcomes.append((self.name, outcome))


async def test_run_cleanups_bounds_each_step_that_suspends_and_goes_on_after_one_that_overran(anyio_backend):
    outcomes: list[tuple[str, str]] = []

    async def instant() -> None:
        return None

    async def short() -> None:
        await anyio.sleep(0.01)

    async def hung() -> None:
        await anyio.sleep_forever()

    async def failing() -> None:
        await anyio.lowlevel.checkpoint()
        raise OSError("sandbox gone")

    steps = [_Step(f.__name__, f, outcomes) for f in (instant, short, hung, short, failing, instant)]
    error = RuntimeError("the rollout's own error")
    with anyio.CancelScope() as scope:
        scope.cancel()  # every step runs on the cancellation path, shielded from it
        await run_cleanups(steps, limit_s=1.0, error=error)  # 100 times the short step: only the hang overruns
    assert outcomes == [
        ("instant", "ok"),
        ("short", "ok"),
        ("hung", "timeout"),  # abandoned after its own bound, and the steps after it still run
        ("short", "ok"),
        ("failing", "error"),
        ("instant", "ok"),
    ]
    assert all(step.started for step in steps)
    assert error.__notes__ == ["while cleaning up, failing also failed: OSError: sandbox gone"]


async def test_run_cleanups_stops_at_an_interrupt_and_leaves_later_steps_unstarted(anyio_backend):
    outcomes: list[tuple[str, str]] = []

    async def interrupted() -> None:
        raise KeyboardInterrupt

    async def later() -> None:
        return None

    steps = [_Step("interrupted", interrupted, outcomes), _Step("later", later, outcomes)]
    with pytest.raises(KeyboardInterrupt):
        await run_cleanups(steps, limit_s=1.0, error=None)
    assert outcomes == [("interrupted", "error")]
    assert [step.started for step in steps] == [True, False]  # the caller runs what was not started
